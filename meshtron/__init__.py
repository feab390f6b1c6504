"""meshtron: train, serve and post-train large language models on PyTorch's own distributed engine."""

__version__ = "0.1.0"
