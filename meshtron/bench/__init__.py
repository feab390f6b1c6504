"""Benchmarks that compare meshtron with plain PyTorch; each prints a table and writes JSON (`meshtron bench ...`)."""
