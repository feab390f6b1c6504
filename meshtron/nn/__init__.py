"""Layers as math, single-device: norms, rotary, attention, MLP, loss, and the context objects."""
