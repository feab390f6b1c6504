"""Sequence packing for RL: rollouts (prompt + completion) packed best-fit into rows of `pack_length`
tokens, with per-document boundaries and, per token, the loss weight, the advantage and the rollout
engine's log probability.

A sequence of n tokens gives n - 1 input/label positions; the positions whose label is a completion
token carry the sequence's weight (the loss aggregation, see `loss.token_weights`), its advantage
and the engine's log prob of that token; prompt positions and padding carry weight 0. Every row has
`document_ids` and restarted `position_ids`, so attention never crosses from one sequence into
another and each sequence sees the positions it had when it was generated. Placement uses the data
pipeline's `best_fit_decreasing`. Rollouts of an MoE model also carry the engine's routing, placed
the same way (`meshtron.rl.replay`). The warm-up (supervised) packs demonstrations the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from meshtron.data.packing import best_fit_decreasing
from meshtron.rl.replay import ROUTING_PREFIX, pack_routing

FIELDS = ("input_ids", "labels", "document_ids", "position_ids", "weights", "advantages", "rollout_log_probs")


@dataclass
class TrainSequence:
    token_ids: list[int]
    num_prompt: int  # tokens before the first trained one (the first label is token num_prompt)
    weight: float
    advantage: float = 0.0
    rollout_log_probs: Optional[list[float]] = None  # one per completion token
    routing: Optional[dict[str, np.ndarray]] = None  # MoE router name -> (len(token_ids) - 1, k) expert ids


def pack_sequences(sequences: Sequence[TrainSequence], pack_length: int, pad_id: int) -> list[dict[str, np.ndarray]]:
    """Rows of `pack_length` positions, each a dict of FIELDS arrays; sequences whole, best fit."""
    lengths = np.array([len(s.token_ids) - 1 for s in sequences], dtype=np.int64)
    too_long = [i for i, n in enumerate(lengths) if n > pack_length]
    if too_long:
        raise ValueError(f"a sequence of {lengths[too_long[0]] + 1} tokens does not fit rl.pack_length={pack_length}; "
                         "raise rl.pack_length or lower rl.max_new_tokens")
    rows = []
    for bin_items in best_fit_decreasing(np.maximum(lengths, 1), pack_length):
        row = {
            "input_ids": np.full(pack_length, pad_id, dtype=np.int64),
            "labels": np.full(pack_length, pad_id, dtype=np.int64),
            "document_ids": np.full(pack_length, len(bin_items), dtype=np.int64),  # padding: its own document
            "position_ids": np.arange(pack_length, dtype=np.int64),
            "weights": np.zeros(pack_length, dtype=np.float32),
            "advantages": np.zeros(pack_length, dtype=np.float32),
            "rollout_log_probs": np.zeros(pack_length, dtype=np.float32),
        }
        at = 0
        for k, i in enumerate(sorted(bin_items)):
            s = sequences[i]
            n = len(s.token_ids) - 1
            if n < 1:
                continue
            tokens = np.asarray(s.token_ids, dtype=np.int64)
            row["input_ids"][at:at + n], row["labels"][at:at + n] = tokens[:-1], tokens[1:]
            row["document_ids"][at:at + n] = k
            row["position_ids"][at:at + n] = np.arange(n)
            first = at + s.num_prompt - 1  # the position whose label is the first trained token
            row["weights"][first:at + n] = s.weight
            row["advantages"][first:at + n] = s.advantage
            if s.rollout_log_probs is not None:
                assert len(s.rollout_log_probs) == n - (s.num_prompt - 1), "one rollout log prob per completion token"
                row["rollout_log_probs"][first:at + n] = s.rollout_log_probs
            pack_routing(row, s.routing, at, n, pack_length)
            at += n
        row["position_ids"][at:] = np.arange(pack_length - at)
        rows.append(row)
    routed = next((s.routing for s in sequences if s.routing is not None), None)
    if routed is not None:  # a row of empty sequences only still needs (padding) tables
        for row in rows:
            for name, table in routed.items():
                row.setdefault(ROUTING_PREFIX + name, np.tile(np.arange(table.shape[1], dtype=np.int64),
                                                              (pack_length, 1)))
    return rows


def micro_batches(rows: list[dict[str, np.ndarray]], micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Rows stacked into (micro_batch_size, pack_length) tensors (the last micro-batch may be smaller)."""
    names = list(FIELDS) + sorted(k for k in (rows[0] if rows else {}) if k.startswith(ROUTING_PREFIX))
    return [{name: torch.from_numpy(np.stack([r[name] for r in rows[k:k + micro_batch_size]])) for name in names}
            for k in range(0, len(rows), micro_batch_size)]


def unpacked_rows(sequences: Sequence[TrainSequence], pad_id: int) -> list[dict[str, np.ndarray]]:
    """One sequence per row, padded to the longest (the reference layout packing must agree with)."""
    longest = max(len(s.token_ids) - 1 for s in sequences)
    return [pack_sequences([s], longest, pad_id)[0] for s in sequences]
