"""Inference: sampling and (for now) a simple generation loop."""
