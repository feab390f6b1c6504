"""Tiny random-weight transformers models of every supported family, saved as safetensors (built from
configs; nothing is downloaded), and helpers to run meshtron and transformers side by side."""

from __future__ import annotations

import pytest
import torch

from tests.models.hf.pin import import_transformers

transformers = import_transformers()

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, initializer_range=0.2)


def family_configs() -> dict:
    """One config per family, each exercising that family's particular options."""
    return {
        # Llama-3 frequency scaling, GQA, separate head
        "llama": transformers.LlamaConfig(**COMMON, num_key_value_heads=2, rms_norm_eps=1e-5, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
        # sliding window on every layer, MQA, head_dim != hidden / heads
        "mistral": transformers.MistralConfig(**COMMON, num_key_value_heads=1, head_dim=16, sliding_window=5),
        # q/k/v biases, tied head, YaRN, window on layer 1 only (max_window_layers=1)
        "qwen2": transformers.Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True,
                                          use_sliding_window=True, sliding_window=4, max_window_layers=1,
                                          rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                                           "original_max_position_embeddings": 32}),
        # QK-norm
        "qwen3": transformers.Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=8),
        # learned positions, LayerNorm, GELU (tanh), biases, tied head
        "gpt2": transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                        initializer_range=0.2),
    }


FAMILIES = sorted(family_configs())


def build_hf_model(config, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms and biases away from 1 and 0, so that a swapped one would show
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """{family: directory with config.json + model.safetensors} for every family."""
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for name, config in family_configs().items():
        build_hf_model(config).save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


def load_hf(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def greedy_pair(hf, model, prompt_len: int = 9, new: int = 8) -> tuple[list[int], list[int]]:
    """(transformers' greedy `generate`, meshtron's greedy tokens through a KV cache) from one random prompt."""
    from meshtron.nn.context import KVCacheContext

    prompt = torch.randint(0, 96, (1, prompt_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=new, do_sample=False)[0, prompt_len:].tolist()
        ctx, tokens, ours = KVCacheContext(1, prompt_len + new), prompt, []
        for _ in range(new):
            next_id = model(tokens, ctx.begin(tokens))[:, -1].argmax(-1, keepdim=True)
            ctx.advance()
            ours.append(int(next_id))
            tokens = next_id
    return expected, ours

