"""Helpers for tests and benchmarks: starting gloo ranks quickly and safely."""
