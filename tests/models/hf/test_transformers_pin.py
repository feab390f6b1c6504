"""pyproject.toml pins one transformers minimum in every extra, new enough for what the tests use."""

from __future__ import annotations

from packaging.version import Version

from tests.models.hf.pin import pinned_minimum, transformers_pins


def test_every_extra_pins_the_same_transformers_minimum():
    pins = transformers_pins()
    assert len(pins) == 2 and len(set(pins)) == 1, pins  # the hf and dev extras, identical
    # rope_parameters (the config spelling the parity tests build) and from_pretrained(dtype=) are 5.x
    assert pinned_minimum() >= Version("5.0")
