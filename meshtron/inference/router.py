"""Where the coordinator places a request among its live replicas: the least loaded one, where load is
a replica's outstanding tokens (for each request it holds: prompt tokens + new tokens still allowed),
unless a replica that already served the same prompt prefix is within `affinity_margin` tokens of
the least loaded, whose prefix cache then likely holds that prefix's keys and values.

A request's prefix is a chain of hashes, one per leading full KV block of its prompt (the client
computes them with `prefix_hashes`: the router never sees tokens); the longest chain a live replica
served and within the margin wins. Ties between equally loaded replicas rotate, so idle replicas take turns.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from typing import Optional

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

# How many leading blocks of a prompt are hashed for affinity: enough to tell a shared system prompt
# apart, few enough that hashing costs nothing next to tokenizing.
AFFINITY_BLOCKS = 4


def prefix_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int = AFFINITY_BLOCKS) -> list[bytes]:
    """One 8-byte hash per leading full block (at most `max_blocks`), each covering every token
    before it too, so equal hashes mean equal prefixes (up to collisions)."""
    hashes, running = [], hashlib.blake2b(digest_size=8)
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        block = token_ids[i * block_size:(i + 1) * block_size]
        running.update(struct.pack(f"<{len(block)}q", *block))
        hashes.append(running.copy().digest())
    return hashes


class Router:
    """Picks a replica from their loads; remembers which replica served which prefix (the most recent
    `max_prefixes` of them)."""

    def __init__(self, affinity_margin: float = 512, max_prefixes: int = 65536):
        if affinity_margin < 0:
            raise ValueError(f"affinity_margin: {affinity_margin} is negative; give tokens >= 0 (0 turns affinity "
                             "into a tie-break)")
        self.affinity_margin, self.max_prefixes = affinity_margin, max_prefixes
        self.owner: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> replica that last served it
        self._turn = 0

    def pick(self, loads: dict[int, float], prefix: Sequence[bytes] = ()) -> Optional[int]:
        """The replica (a key of `loads`, replica -> outstanding tokens) for a request with `prefix`;
        None when there is none. Records the choice for the prefix."""
        if not loads:
            return None
        least = min(loads.values())
        choice = self._affine(loads, prefix, least)
        if choice is None:
            tied = sorted(r for r, load in loads.items() if load == least)
            choice = tied[self._turn % len(tied)]
            self._turn += 1
        for h in prefix:
            self.owner[h] = choice
            self.owner.move_to_end(h)
        while len(self.owner) > self.max_prefixes:
            self.owner.popitem(last=False)
        return choice

    def _affine(self, loads: dict[int, float], prefix: Sequence[bytes], least: float) -> Optional[int]:
        for h in reversed(prefix):  # the longest shared prefix within the margin
            replica = self.owner.get(h)
            if replica in loads and loads[replica] <= least + self.affinity_margin:
                return replica
        return None

    def forget(self, replica: int) -> None:
        """A replica left: its prefixes have no owner any more."""
        for h in [h for h, r in self.owner.items() if r == replica]:
            del self.owner[h]
