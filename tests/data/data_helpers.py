"""Helpers shared by the data tests: multilingual text, small documents, indexed datasets from id lists."""

from __future__ import annotations

import numpy as np

from meshtron.data.corpus import iter_stdlib_documents
from meshtron.data.indexed import IndexedDataset, IndexedDatasetWriter

MULTILINGUAL = [
    "The quick brown fox jumps over the lazy dog.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "敏捷的棕色狐狸跳过了懒狗。我们在学习机器学习。",
    "いろはにほへと ちりぬるを わかよたれそ つねならむ",
    "다람쥐 헌 쳇바퀴에 타고파. 한국어 문장입니다.",
    "Falsches Üben von Xylophonmusik quält jeden größeren Zwerg.",
    "El pingüino Wenceslao hizo kilómetros bajo exhaustiva lluvia y frío.",
    "نص حكيم له سر قاطع وذو شأن عظيم مكتوب على ثوب أخضر",
    "Numbers 1234567890 and symbols: {x: [1, 2, 3]} -> ok? émoji 🎉🚀 done.",
]


def small_documents(count: int = 40) -> list[str]:
    """Deterministic documents of varied length: stdlib source snippets and multilingual lines."""
    docs = []
    for k, (_, text) in enumerate(iter_stdlib_documents()):
        if k >= count:
            break
        start = (k * 997) % max(1, len(text) - 1)
        docs.append(text[start:start + 200 + (k * 131) % 1500] + " " + MULTILINGUAL[k % len(MULTILINGUAL)])
    return docs


def write_indexed(prefix, docs: list[list[int]], vocab_size: int = 1000, format: str = "meshtron") -> IndexedDataset:
    """meshtron's format by default: the corruption helpers below rewrite its headers."""
    writer = IndexedDatasetWriter(prefix, vocab_size, format)
    for d in docs:
        writer.add_document(np.asarray(d, dtype=np.int64))
    writer.finalize()
    return IndexedDataset(prefix)


def random_docs(rng: np.random.Generator, num_docs: int, max_len: int, vocab_size: int = 1000,
                min_len: int = 0) -> list[list[int]]:
    return [rng.integers(0, vocab_size, size=int(rng.integers(min_len, max_len + 1))).tolist() for _ in range(num_docs)]


def rewrite_idx(prefix, *, sizes=None, offsets=None, max_id_field=None) -> None:
    """Overwrite parts of PREFIX.idx in place (what a corrupt or older file looks like)."""
    from meshtron.data.indexed import IDX_HEADER

    path = f"{prefix}.idx"
    raw = bytearray(open(path, "rb").read())
    num_docs = IDX_HEADER.unpack(bytes(raw[:IDX_HEADER.size]))[4]
    at = IDX_HEADER.size
    if offsets is not None:
        raw[at:at + 8 * (num_docs + 1)] = np.asarray(offsets, dtype=np.int64).tobytes()
    if sizes is not None:
        raw[at + 8 * (num_docs + 1):] = np.asarray(sizes, dtype=np.int32).tobytes()
    if max_id_field is not None:   # the header's last u32: max id + 1, 0 in files written before it was recorded
        raw[IDX_HEADER.size - 4:IDX_HEADER.size] = np.uint32(max_id_field).tobytes()
    open(path, "wb").write(bytes(raw))


def set_token(prefix, position: int, value: int, dtype=np.uint16) -> None:
    """Overwrite token `position` of PREFIX.bin (a same-size corruption the header cannot see)."""
    with open(f"{prefix}.bin", "r+b") as f:
        f.seek(IndexedDataset(prefix).data_offset + position * np.dtype(dtype).itemsize)
        f.write(np.asarray([value], dtype=dtype).tobytes())
