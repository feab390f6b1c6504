"""Fixtures of the data tests: small documents, a jsonl file of them, and a tiny trained BPE tokenizer."""

from __future__ import annotations

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
from data_helpers import small_documents  # noqa: E402


@pytest.fixture(scope="session")
def documents() -> list[str]:
    return small_documents()


@pytest.fixture(scope="session")
def jsonl_file(tmp_path_factory, documents):
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for k, d in enumerate(documents):
            f.write(json.dumps({"text": d, "id": k}, ensure_ascii=False) + "\n")
    return path


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory, jsonl_file):
    from meshtron.data.tokenizer_train import train_bpe

    return train_bpe([str(jsonl_file)], 600, tmp_path_factory.mktemp("bpe"))
