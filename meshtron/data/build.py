"""Build the train/valid/test datasets a run's config asks for.

Empty `data.paths` reads the embedded stdlib corpus raw (stream.py); `data.format: sft` reads chat
jsonl (sft.py). Otherwise each prefix is an indexed dataset split by documents; each split is a
GPTDataset (or a best-fit PackedDataset), with FIM when data.fim_rate > 0, blended by weight when
several prefixes are given.
"""

from __future__ import annotations

import functools
import warnings

from meshtron.config.fields import ConfigError
from meshtron.config.schema import DataConfig, RunConfig
from meshtron.data.blended import BlendedDataset, blend_counts
from meshtron.data.fim import FIMSpec, GPTFIMDataset, apply_fim
from meshtron.data.gpt_dataset import GPTDataset, split_document_ranges
from meshtron.data.indexed import IndexedDataset, IndexedDatasetError
from meshtron.data.packing import PackedDataset
from meshtron.data.stream import build_stream_datasets
from meshtron.data.tokenizer import Tokenizer

SPLIT_NAMES = ("train", "valid", "test")


def token_id_limit(cfg: RunConfig, tokenizer: Tokenizer) -> tuple[int, str]:
    """How many ids the model's embedding takes, and the setting that decides it. A model.vocab_size
    below the tokenizer's shrinks it (a HF init refuses a tokenizer larger than the model)."""
    declared = cfg.model.vocab_size
    if declared and not cfg.train.init_from_hf and declared < tokenizer.vocab_size:
        return declared, "model.vocab_size"
    return tokenizer.vocab_size, "the tokenizer's vocab_size"


def open_indexed(prefix: str, tokenizer: Tokenizer, limit: tuple[int, str] | None = None) -> IndexedDataset:
    """Open one prefix for training: it must match the tokenizer, and its ids must fit `limit`."""
    try:
        ds = IndexedDataset(prefix)
    except IndexedDatasetError as e:
        raise ConfigError(f"data.paths: {e}") from None
    if ds.vocab_size is not None and ds.vocab_size != tokenizer.vocab_size:
        raise ConfigError(f"data.paths: {prefix} was preprocessed with a tokenizer of vocab_size {ds.vocab_size}, "
                          f"but the tokenizer section gives {tokenizer.vocab_size}; preprocess again or fix tokenizer")
    num_ids, source = limit or (tokenizer.vocab_size, "the tokenizer's vocab_size")
    if ds.max_token_id is not None and ds.max_token_id >= num_ids:
        raise ConfigError(f"data.paths: {prefix} holds token ids up to {ds.max_token_id} but {source} is {num_ids}; "
                          f"make it at least {ds.max_token_id + 1} (model.vocab_size: null takes the tokenizer's), "
                          "or preprocess with the model's tokenizer")
    if ds.max_token_id is None and ds.vocab_size is None and ds.id_limit > num_ids:
        # A Megatron prefix without meshtron's sidecar records neither; reads refuse bad ids.
        warnings.warn(f"data.paths: {prefix} (Megatron's format, no {prefix}.meshtron.json sidecar) records no "
                      f"vocabulary size or maximum token id; an id >= {num_ids} ({source}) stops training when read. "
                      f"Check it with `meshtron data info {prefix} --verify --vocab-size {num_ids}`; `meshtron data "
                      f"convert --input {prefix} --output NEW --format megatron --vocab-size {num_ids}` writes a copy "
                      "with a sidecar", stacklevel=2)
    elif ds.max_token_id is None and ds.vocab_size is not None and ds.vocab_size > num_ids:
        # Written before the maximum was recorded: the writer only bounds ids by vocab_size, which is
        # too large here. A full scan could take minutes on every rank, so warn; reads refuse bad ids.
        warnings.warn(f"data.paths: {prefix} has no recorded maximum token id and its vocab_size {ds.vocab_size} "
                      f"exceeds {source} {num_ids}; an id >= {num_ids} stops training when read. Check it with "
                      f"`meshtron data info {prefix} --verify --vocab-size {num_ids}`; `meshtron data merge --input "
                      f"{prefix} --output-prefix NEW` writes a copy that records it", stacklevel=2)
    ds.id_limit = num_ids
    return ds


def fim_spec(data: DataConfig, tokenizer: Tokenizer) -> FIMSpec:
    def token_id(field: str) -> int:
        name = getattr(data, field)
        i = tokenizer.token_to_id(name)
        if i is None:
            raise ConfigError(f"data.{field}: {name!r} is not a token of the tokenizer; "
                              "train the tokenizer with FIM tokens or name one it has")
        return i

    return FIMSpec(
        prefix_id=token_id("fim_prefix_token"), middle_id=token_id("fim_middle_token"),
        suffix_id=token_id("fim_suffix_token"),
        pad_id=token_id("fim_pad_token") if data.fim_pad_token else tokenizer.pad_id, eod_id=tokenizer.eod_id,
        rate=data.fim_rate, spm_rate=data.fim_spm_rate, fragment_rate=data.fim_fragment_rate,
        split_id=token_id("fim_split_sample") if data.fim_split_sample else None,
        no_prefix_ids=tuple(tokenizer.encode(data.fim_no_prefix)) if data.fim_no_prefix else (),
    )


def _build_one(indexed: IndexedDataset, doc_range: tuple[int, int], name: str, num_samples: int | None,
               data: DataConfig, tokenizer: Tokenizer, spec: FIMSpec | None):
    if data.packing == "best_fit":
        transform = functools.partial(apply_fim, spec=spec) if spec else None
        return PackedDataset(indexed, doc_range, seq_length=data.seq_length, pad_id=tokenizer.pad_id,
                             cache_dir=data.cache_dir, name=name, transform=transform, seed=data.seed)
    ds = GPTDataset(indexed, doc_range, seq_length=data.seq_length, seed=data.seed, eod_id=tokenizer.eod_id,
                    pad_id=tokenizer.pad_id, num_samples=num_samples, cache_dir=data.cache_dir, name=name,
                    reset_attention_mask=data.reset_attention_mask, reset_position_ids=data.reset_position_ids,
                    sample_order=data.sample_order, add_extra_token=data.add_extra_token_to_sequence)
    return GPTFIMDataset(ds, spec, data.seed) if spec else ds


def build_split(indexed: list[IndexedDataset], weights: list[float], k: int, requested: int,
                data: DataConfig, tokenizer: Tokenizer, spec: FIMSpec | None):
    """Split k of every prefix, blended to max(requested, the size at which no dataset repeats)."""
    name = SPLIT_NAMES[k]
    ranges = [split_document_ranges(len(ix), data.split_weights())[k] for ix in indexed]
    parts = [_build_one(ix, r, name, None, data, tokenizer, spec) for ix, r in zip(indexed, ranges)]
    if len(parts) == 1:
        return parts[0] if len(parts[0]) >= requested else _build_one(indexed[0], ranges[0], name, requested,
                                                                      data, tokenizer, spec)
    keep = [d for d, (p, w) in enumerate(zip(parts, weights)) if w > 0 and len(p) > 0]
    if name != "train" and len(keep) < sum(w > 0 for w in weights):
        # Small datasets may have no valid/test documents; blend the others rather than fail.
        warnings.warn(f"data.paths: some datasets have no {name} samples; the {name} blend leaves them out",
                      stacklevel=2)
        if not keep:
            return parts[0]
        indexed, ranges, parts = [indexed[d] for d in keep], [ranges[d] for d in keep], [parts[d] for d in keep]
        weights = [weights[d] for d in keep]
    natural = min((len(p) / w for p, w in zip(parts, weights) if w > 0), default=0)
    size = max(requested, int(natural))
    counts = blend_counts(weights, size)
    parts = [p if len(p) >= c else _build_one(ix, r, name, int(c), data, tokenizer, spec)
             for p, c, ix, r in zip(parts, counts, indexed, ranges)]
    return BlendedDataset(parts, weights, size, cache_dir=data.cache_dir, name=name)


def build_datasets(cfg: RunConfig, tokenizer: Tokenizer):
    """Returns [train, valid, test]; an empty `data.paths` reads the embedded stdlib corpus raw."""
    data = cfg.data
    if data.format == "sft":
        from meshtron.data.sft import build_sft_datasets

        return build_sft_datasets(cfg, tokenizer)
    if not data.paths:
        return build_stream_datasets(data, tokenizer)
    weights, prefixes = data.blend()
    limit = token_id_limit(cfg, tokenizer)
    indexed = [open_indexed(p, tokenizer, limit) for p in prefixes]
    spec = fim_spec(data, tokenizer) if data.fim_rate > 0 else None
    # Training asks for every sample it will consume (more epochs if needed); valid/test take one epoch.
    num_train = cfg.train.train_iters * cfg.train.global_batch_size
    out = [build_split(indexed, weights, k, num_train if k == 0 else 0, data, tokenizer, spec) for k in range(3)]
    if len(out[0]) == 0:
        raise ConfigError(f"data.paths: {', '.join(prefixes)} give no training samples of data.seq_length="
                          f"{data.seq_length}; add documents, lower data.seq_length or raise the train share of data.split")
    return out
