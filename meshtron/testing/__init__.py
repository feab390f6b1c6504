"""Helpers for tests and benchmarks: starting gloo ranks quickly and safely."""

__meshtron_api__ = "internal"  # outside the checked public API (docs/api.md)
