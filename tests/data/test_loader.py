"""Sampler/loader: data-parallel ranks get disjoint shares of each global batch, and resuming from
`consumed_samples` continues with exactly the next samples — also mid-epoch, across an epoch
boundary, and after the number of data-parallel ranks changes."""

from __future__ import annotations

import numpy as np

from meshtron.data.loader import BatchLoader, ShuffledOrder, fixed_batches


class IdDataset:
    """Sample i holds i, so batches say which samples they took."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"input_ids": np.array([i, i], dtype=np.int64)}


def ids(global_batch) -> list[int]:
    return [int(x) for mb in global_batch for x in mb["input_ids"][:, 0]]


def run(dataset, num_steps, *, dp_size=1, consumed=0, gbs=8, mbs=2, seed=7):
    """Global sample ids of num_steps steps, concatenated over ranks in rank order."""
    loaders = [BatchLoader(dataset, micro_batch_size=mbs, global_batch_size=gbs, seed=seed, dp_rank=r,
                           dp_size=dp_size, consumed_samples=consumed) for r in range(dp_size)]
    steps = [[x for loader in loaders for x in ids(loader.next_global_batch())] for _ in range(num_steps)]
    assert len({loader.consumed_samples for loader in loaders}) == 1
    return steps, loaders[0].state_dict()


def test_order_is_a_fresh_permutation_per_epoch():
    order = ShuffledOrder(10, seed=1)
    epoch0, epoch1 = order(np.arange(10)), order(np.arange(10, 20))
    assert sorted(epoch0.tolist()) == sorted(epoch1.tolist()) == list(range(10))
    assert epoch0.tolist() != epoch1.tolist()
    assert order(np.arange(20)).tolist() == epoch0.tolist() + epoch1.tolist()
    assert ShuffledOrder(5, seed=0, shuffle=False)(np.arange(7)).tolist() == [0, 1, 2, 3, 4, 0, 1]


def test_resume_mid_epoch_continues_with_the_next_samples():
    ds = IdDataset(30)   # 8 per step: epoch boundaries fall inside steps 4 and 8
    straight, _ = run(ds, 10)
    first, state = run(ds, 3)
    assert state == {"consumed_samples": 24}
    loader = BatchLoader(ds, micro_batch_size=2, global_batch_size=8, seed=7)
    loader.load_state_dict(state)
    resumed = [ids(loader.next_global_batch()) for _ in range(7)]
    assert first + resumed == straight
    # every epoch is a permutation of the dataset
    flat = [x for step in straight for x in step]
    assert sorted(flat[:30]) == list(range(30)) and sorted(flat[30:60]) == list(range(30))


def test_ranks_split_each_global_batch():
    ds = IdDataset(100)
    single, _ = run(ds, 5, dp_size=1)
    for dp_size in (2, 4):
        sharded, _ = run(ds, 5, dp_size=dp_size)
        assert sharded == single   # rank r takes the r-th contiguous block of the global batch


def test_resume_after_the_number_of_ranks_changes():
    ds = IdDataset(50)
    straight, _ = run(ds, 9, dp_size=1)
    _, state = run(ds, 4, dp_size=2)
    resumed, _ = run(ds, 5, dp_size=4, consumed=state["consumed_samples"])
    assert resumed == straight[4:]


def test_fixed_batches_are_the_first_samples_in_order():
    batches = fixed_batches(IdDataset(7), 3, 5)
    assert [b["input_ids"][:, 0].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6]]
