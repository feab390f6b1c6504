"""Tiny random models, seeded workloads and the one-request-at-a-time full-recompute reference."""

from __future__ import annotations

import time

import torch

from meshtron.config import ModelConfig
from meshtron.data.tokenizer import ByteTokenizer
from meshtron.inference.config import EngineConfig
from meshtron.inference.engine import LLMEngine
from meshtron.inference.request import SamplingParams
from meshtron.models import GPTModel

TOKENIZER = ByteTokenizer()

MODELS = {
    "gqa-rope": dict(num_attention_heads=4, num_query_groups=2, position_embedding_type="rope"),
    "window-sinks-learned-pos": dict(num_attention_heads=2, position_embedding_type="learned_absolute",
                                     window_size=5, softmax_type="learnable"),
    "window-rope": dict(num_attention_heads=4, num_query_groups=2, position_embedding_type="rope", window_size=5),
    "mla": dict(num_attention_heads=2, position_embedding_type="rope", multi_latent_attention=True,
                kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8),
    "moe": dict(num_attention_heads=4, num_moe_experts=4, moe_router_topk=2, moe_shared_expert_intermediate_size=16,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
}


def tiny_model(kind: str = "gqa-rope", seed: int = 0, max_len: int = 96) -> GPTModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(num_layers=2, hidden_size=32, max_position_embeddings=max_len, make_vocab_size_divisible_by=1,
                      init_method_std=0.2, **MODELS[kind])
    model = GPTModel(cfg, TOKENIZER.vocab_size).eval()
    if kind == "window-sinks-learned-pos":
        with torch.no_grad():
            for layer in model.layers:
                if getattr(layer.mixer, "sinks", None) is not None:
                    layer.mixer.sinks.normal_()
    return model


def workload(num_requests: int = 32, seed: int = 1, max_prompt: int = 40, max_output: int = 24,
             shared_prefix: int = 0) -> tuple[list[list[int]], list[int]]:
    """Seeded prompts of mixed lengths (optionally all starting with the same prefix) and output lengths."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 256, (shared_prefix,), generator=g).tolist()
    prompts, max_tokens = [], []
    for _ in range(num_requests):
        n = int(torch.randint(1, max_prompt + 1, (1,), generator=g))
        prompts.append(prefix + torch.randint(0, 256, (n,), generator=g).tolist())
        max_tokens.append(int(torch.randint(1, max_output + 1, (1,), generator=g)))
    return prompts, max_tokens


@torch.no_grad()
def reference_greedy(model: GPTModel, prompt: list[int], max_tokens: int, eos: int = TOKENIZER.eod_id) -> list[int]:
    """Full recompute of the whole sequence for every token, one request at a time, no cache."""
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        token = int(model(torch.tensor([ids]))[0, -1].argmax())
        out.append(token)
        ids.append(token)
        if token == eos:
            break
    return out


def greedy_params(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens]


def engine(model: GPTModel, **options) -> LLMEngine:
    return LLMEngine(model, TOKENIZER, EngineConfig(**options))


def save_tiny_checkpoint(directory, kind: str = "gqa-rope", max_len: int = 96) -> str:
    """A model-only checkpoint of `tiny_model(kind)` with a byte tokenizer, as the trainer would save it."""
    import yaml

    from meshtron.checkpoint import CheckpointManager
    from meshtron.config.loader import config_to_dict
    from meshtron.config.schema import RunConfig

    model = tiny_model(kind, max_len=max_len)
    cfg = RunConfig(model=model.cfg)
    cfg.tokenizer.type = "byte"
    CheckpointManager(directory).save(0, model, None, {"step": 0}, yaml.safe_dump(config_to_dict(cfg)))
    return str(directory)


def wait_ready(url: str, proc=None, timeout_s: float = 180.0) -> None:
    """Poll `url`/health until it answers 200; `proc` (a server subprocess) failing ends the wait."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError("server did not become ready")


class RecordingRunner:
    """A TP follower's model runner that records what it is asked to do (the leader/follower tests)."""

    def __init__(self):
        self.calls = []

    def forward_only(self, chunks):
        self.calls.append(("step", chunks))

    def release(self):
        self.calls.append(("release", None))
