"""FIM: undoing the PSM/SPM permutation gives back the original tokens (every document keeps its
length, losing only the tail of the suffix to the sentinels), eod tokens stay in place, and the
rates, fragments and exclusions behave as configured."""

from __future__ import annotations

import numpy as np
from data_helpers import random_docs, write_indexed

from meshtron.data.fim import NUM_SENTINELS, FIMSpec, GPTFIMDataset, apply_fim, permute
from meshtron.data.gpt_dataset import GPTDataset

P, M, S, PAD, EOD, SPLIT = 1001, 1002, 1003, 1004, 1005, 1006


def spec(**kw) -> FIMSpec:
    return FIMSpec(prefix_id=P, middle_id=M, suffix_id=S, pad_id=PAD, eod_id=EOD, **{"rate": 1.0, **kw})


def undo(doc: list[int]) -> tuple[list[int], str]:
    """Original order (prefix + middle + truncated suffix) of a rearranged document, and its mode."""
    if not doc or doc[0] != P:
        return doc, "none"
    m = doc.index(M)
    if doc[1] == S:                       # SPM: P S suffix M prefix+middle
        return doc[m + 1:] + doc[2:m], "spm"
    s = doc.index(S)                      # PSM: P prefix S suffix M middle
    return doc[1:s] + doc[m + 1:] + doc[s + 1:m], "psm"


def documents_of(window: list[int]) -> list[list[int]]:
    out, cur = [], []
    for t in window:
        if t == EOD:
            out.append(cur)
            cur = []
        else:
            cur.append(t)
    return out + [cur]


def test_undo_gives_back_the_original_tokens():
    rng = np.random.default_rng(0)
    modes = set()
    for _ in range(300):
        doc = rng.integers(0, 1000, size=int(rng.integers(0, 40)))
        out = permute(doc, rng, 1.0, spec())
        assert len(out) == len(doc)
        original, mode = undo(out.tolist())
        modes.add(mode)
        if mode == "none":
            assert out.tolist() == doc.tolist()
        else:
            assert original == doc.tolist()[:len(doc) - NUM_SENTINELS]
    assert modes == {"none", "psm", "spm"}


def test_windows_keep_eod_positions_and_length():
    rng = np.random.default_rng(1)
    for _ in range(100):
        docs = random_docs(rng, int(rng.integers(1, 6)), 30)
        window = np.array([t for d in docs for t in d + [EOD]][:-1] or [EOD])
        out = apply_fim(window, rng, spec(rate=0.7))
        assert len(out) == len(window)
        assert np.array_equal(out == EOD, window == EOD)
        for before, after in zip(documents_of(window.tolist()), documents_of(out.tolist())):
            original, mode = undo(after)
            assert original == (before if mode == "none" else before[:len(before) - NUM_SENTINELS])


def test_rates():
    rng = np.random.default_rng(2)
    doc = np.arange(200)
    assert all(np.array_equal(permute(doc, rng, 0.0, spec()), doc) for _ in range(50))
    modes = [undo(permute(doc, rng, 0.5, spec(spm_rate=0.25)).tolist())[1] for _ in range(2000)]
    # Suffixes of >= 3 tokens: P(cut leaves >= 3) ~ 0.97; the rates are checked loosely around it.
    assert 0.45 < np.mean([m != "none" for m in modes]) < 0.53
    rearranged = [m for m in modes if m != "none"]
    assert 0.2 < np.mean([m == "spm" for m in rearranged]) < 0.3


def test_fragments_are_rearranged_separately():
    rng = np.random.default_rng(3)
    for _ in range(100):
        frags = random_docs(rng, 4, 20)
        doc = np.array([t for f in frags for t in f + [SPLIT]])
        out = apply_fim(doc, rng, spec(split_id=SPLIT, fragment_rate=0.5))
        assert np.array_equal(out == SPLIT, doc == SPLIT)
        before = np.split(doc, np.flatnonzero(doc == SPLIT))
        after = np.split(out, np.flatnonzero(out == SPLIT))
        for b, a in zip(before, after):
            b, a = b[b != SPLIT].tolist(), a[a != SPLIT].tolist()
            original, mode = undo(a)
            assert original == (b if mode == "none" else b[:len(b) - NUM_SENTINELS])


def test_no_prefix_documents_are_left_alone():
    rng = np.random.default_rng(4)
    doc = np.array([7, 8] + list(range(100)))
    assert all(np.array_equal(permute(doc, rng, 1.0, spec(no_prefix_ids=(7, 8))), doc) for _ in range(20))


def test_fim_dataset_is_seeded_per_sample(tmp_path):
    rng = np.random.default_rng(5)
    docs = [d + [EOD] for d in random_docs(rng, 30, 40, min_len=5)]
    indexed = write_indexed(tmp_path / "d", docs, vocab_size=2000)
    base = GPTDataset(indexed, (0, 30), seq_length=32, seed=0, eod_id=EOD, pad_id=PAD, cache_dir=str(tmp_path / "c"))
    fim = GPTFIMDataset(base, spec(rate=0.5), seed=11)
    assert len(fim) == len(base)
    samples = [fim[i] for i in range(len(fim))]
    assert all(np.array_equal(fim[i]["input_ids"], samples[i]["input_ids"]) for i in reversed(range(len(fim))))
    changed = 0
    for i, s in enumerate(samples):
        window = base.window(i)
        got = np.concatenate([s["input_ids"], s["labels"][-1:]])
        changed += not np.array_equal(got, window)
        for before, after in zip(documents_of(window.tolist()), documents_of(got.tolist())):
            original, mode = undo(after)
            assert original == (before if mode == "none" else before[:len(before) - NUM_SENTINELS])
    assert changed > 0
    padded = fim.base.to_sample(np.array([5, 6, PAD, PAD]))
    assert padded["loss_mask"].tolist() == [1, 0, 0]


def test_eod_labels_stay_in_the_loss_when_pad_is_eod(tmp_path):
    """allow_ambiguous_pad_tokens: pad id == eod id. FIM pads nothing, so every position, eod labels
    included, stays in the loss."""
    rng = np.random.default_rng(6)
    docs = [d + [EOD] for d in random_docs(rng, 30, 40, min_len=5)]
    indexed = write_indexed(tmp_path / "d", docs, vocab_size=2000)
    base = GPTDataset(indexed, (0, 30), seq_length=32, seed=0, eod_id=EOD, pad_id=EOD, cache_dir=str(tmp_path / "c"))
    fim = GPTFIMDataset(base, FIMSpec(prefix_id=P, middle_id=M, suffix_id=S, pad_id=EOD, eod_id=EOD, rate=1.0), seed=3)
    eod_labels = 0
    for i in range(len(fim)):
        sample = fim[i]
        eod_labels += int((sample["labels"] == EOD).sum())
        assert sample["loss_mask"].tolist() == [1.0] * 32
    assert eod_labels > 0
