"""Data: tokenizers, the embedded corpus, datasets, sampling and batching."""
