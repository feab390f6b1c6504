"""Every context class the mixers are handed implements `MixerContext`, and either gives attention its masks
(`MaskingContext`) or computes the product itself (`attend`), with the protocols' signatures."""

from __future__ import annotations

import inspect

import pytest
import torch

from meshtron.inference.paged_context import PagedContext
from meshtron.inference.varlen_context import VarlenPagedContext
from meshtron.nn.context import KVCacheContext, MaskingContext, MixerContext, PackedContext, RecurrentContext
from meshtron.parallel.context_parallel import CPContext

CLASSES = [PackedContext, KVCacheContext, CPContext, PagedContext, VarlenPagedContext]


def _methods(protocol) -> list[str]:
    return [n for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("_")]


def _same_parameters(cls, protocol, name: str) -> None:
    ours = list(inspect.signature(getattr(cls, name)).parameters)
    wanted = list(inspect.signature(getattr(protocol, name)).parameters)
    assert ours == wanted, f"{cls.__name__}.{name}{ours} differs from the protocol's {wanted}"


@pytest.mark.parametrize("cls", CLASSES)
def test_context_classes_implement_the_protocols(cls):
    for name in _methods(MixerContext):
        _same_parameters(cls, MixerContext, name)
    fields = getattr(cls, "__dataclass_fields__", None)
    assert fields is None or {"positions", "rope"} <= fields.keys(), f"{cls.__name__} lacks positions or rope"
    masking = all(callable(getattr(cls, n, None)) for n in _methods(MaskingContext))
    assert masking or callable(getattr(cls, "attend", None)), f"{cls.__name__}: neither masks nor attend"
    if masking:
        for name in _methods(MaskingContext):
            _same_parameters(cls, MaskingContext, name)
    if callable(getattr(cls, "mamba_states", None)):
        _same_parameters(cls, RecurrentContext, "mamba_states")


def test_instances_are_mixer_contexts():
    tokens = torch.zeros(2, 5, dtype=torch.long)
    packed = PackedContext.for_tokens(tokens)
    cache = KVCacheContext(batch_size=2, max_len=8).begin(tokens)
    for ctx in (packed, cache):
        assert isinstance(ctx, MixerContext) and isinstance(ctx, MaskingContext) and isinstance(ctx, RecurrentContext)
    assert not isinstance(object(), MixerContext)
