"""config.json of released checkpoints spell RoPE the older way (top-level `rope_theta`, a `rope_scaling`
dict with `type` or `rope_type`, or null); transformers >= 5 writes `rope_parameters`. Both spellings
read to the same ModelConfig, through the adapter and through `hf-to-meshtron` on a directory."""

from __future__ import annotations

import json

import pytest
import yaml

from meshtron.models.hf import adapter_for_hf, hf_to_meshtron
from meshtron.models.hf.adapter import architecture_fields
from tests.models.hf.conftest import build_hf_model, transformers

SMALL = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)


def released() -> dict:
    """New-spelling configs whose RoPE values are those of released checkpoints (other sizes tiny)."""
    return {
        # Llama-3.1: llama3 frequency scaling
        "llama3.1": (transformers.LlamaConfig(**SMALL, intermediate_size=48, num_hidden_layers=2,
                                              max_position_embeddings=131072, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}), "rope_type"),
        # Qwen2(.5): plain RoPE with a large theta (rope_scaling null) ...
        "qwen2": (transformers.Qwen2Config(**SMALL, intermediate_size=48, num_hidden_layers=2,
                                           max_position_embeddings=32768,
                                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
                  "type"),
        # ... and its long-context YaRN setting, spelled with "type" as the Qwen model cards give it
        "qwen2-yarn": (transformers.Qwen2Config(**SMALL, intermediate_size=48, num_hidden_layers=2,
                                                max_position_embeddings=131072, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768}),
            "type"),
        # GPT-OSS: YaRN without truncation
        "gpt_oss": (transformers.GptOssConfig(**SMALL, num_hidden_layers=2, head_dim=8, intermediate_size=16,
                                              num_local_experts=4, num_experts_per_tok=2, sliding_window=128,
                                              max_position_embeddings=131072, rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 4096, "truncate": False}), "rope_type"),
    }


def old_spelling(new: dict, type_key: str) -> dict:
    """The same config.json as a transformers 4.x checkpoint has it."""
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    params = dict(new["rope_parameters"])
    old["rope_theta"] = params.pop("rope_theta")
    kind = params.pop("rope_type")
    old["rope_scaling"] = None if kind == "default" else {type_key: kind, **params}
    return old


def new_dict(config) -> dict:
    new = config.to_dict()
    new["architectures"] = [type(config).__name__.replace("Config", "ForCausalLM")]
    assert "rope_parameters" in new and "rope_scaling" not in new and "rope_theta" not in new
    return new


@pytest.mark.parametrize("name", sorted(released()))
def test_old_and_new_spelling_read_to_the_same_model_config(name):
    config, type_key = released()[name]
    new = new_dict(config)
    old = old_spelling(new, type_key)
    from_new = adapter_for_hf(new).to_model_config(new)
    from_old = adapter_for_hf(old).to_model_config(old)
    from_new.validate()
    assert architecture_fields(from_old) == architecture_fields(from_new)
    # the fields the RoPE values land in, checked against the literal values
    params = config.rope_parameters
    assert from_old.rotary_base == params["rope_theta"]
    if params["rope_type"] == "llama3":
        assert from_old.rope_scaling and from_old.rope_scaling_factor == 8.0
        assert from_old.rope_scaling_original_max_position_embeddings == 8192
    elif params["rope_type"] == "yarn":
        assert from_old.position_embedding_type == "yarn"
        assert from_old.yarn_rotary_scaling_factor == params["factor"]
        assert from_old.yarn_original_max_position_embeddings == params["original_max_position_embeddings"]
        assert from_old.correction_range_round_to_int == params.get("truncate", True)
    else:
        assert from_old.position_embedding_type == "rope" and not from_old.rope_scaling


def test_hf_to_meshtron_reads_an_old_spelling_directory(tmp_path):
    config, type_key = released()["llama3.1"]
    build_hf_model(config).save_pretrained(tmp_path / "new")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "model.safetensors").write_bytes((tmp_path / "new" / "model.safetensors").read_bytes())
    new = json.loads((tmp_path / "new" / "config.json").read_text())
    (tmp_path / "old" / "config.json").write_text(json.dumps(old_spelling(new, type_key)))
    models = [yaml.safe_load((hf_to_meshtron(tmp_path / d, tmp_path / f"ckpt_{d}") / "config.yaml").read_text())["model"]
              for d in ("new", "old")]
    assert models[0] == models[1] and models[0]["rope_scaling"] is True
