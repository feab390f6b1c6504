"""Benchmarks that compare meshtron with plain PyTorch; each prints a table and writes JSON (`meshtron bench ...`)."""

__meshtron_api__ = "internal"  # outside the checked public API (docs/api.md)
