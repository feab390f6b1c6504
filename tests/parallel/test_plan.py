"""The memory plan against closed forms (parameter shards under FSDP and TP, optimizer states,
pipeline in-flight counts) and against the saved tensors of a real CPU forward; the `plan` verb."""

from __future__ import annotations

import math

import pytest
import torch

from meshtron.config import RunConfig, load_config
from meshtron.data.tokenizer import build_tokenizer
from meshtron.models.gpt import GPTModel, count_parameters
from meshtron.models.mtp import combine_losses, forward_for_loss
from meshtron.nn.context import PackedContext
from meshtron.parallel.activation_checkpoint import apply_activation_checkpoint
from meshtron.parallel.dims import ParallelDims
from meshtron.parallel.plan import (
    SavedTensorCounter,
    _estimate_memory,
    estimate_memory,
    microbatches_in_flight,
    representative_layers,
)

BYTE_VOCAB = build_tokenizer(RunConfig().tokenizer).vocab_size  # the model pads it to 384
TINY = {
    "model.num_layers": "2", "model.hidden_size": "32", "model.num_attention_heads": "4",
    "model.num_query_groups": "2", "model.ffn_hidden_size": "64", "model.max_position_embeddings": "64",
    "data.seq_length": "32", "train.micro_batch_size": "2", "train.global_batch_size": "8",
}


def config(world_size: int = 1, **overrides: str):
    return load_config(overrides={**TINY, **overrides}, world_size=world_size)


def plan(world_size: int = 1, **overrides: str) -> list[dict]:
    return estimate_memory(config(world_size, **overrides), world_size)


def tiny_shapes(vocab: int = 384, d: int = 32, heads: int = 4, groups: int = 2, f: int = 64,
                num_layers: int = 2) -> dict[str, tuple[int, ...]]:
    """Every parameter of the TINY model, written from the architecture (SwiGLU, RMSNorm, untied)."""
    hd = d // heads
    shapes = {"embedding.weight": (vocab, d), "final_norm.weight": (d,), "output.weight": (vocab, d)}
    for layer in range(num_layers):
        a, m = f"layers.{2 * layer}", f"layers.{2 * layer + 1}"
        shapes |= {f"{a}.norm.weight": (d,), f"{a}.mixer.wq.weight": (heads * hd, d),
                   f"{a}.mixer.wk.weight": (groups * hd, d), f"{a}.mixer.wv.weight": (groups * hd, d),
                   f"{a}.mixer.wo.weight": (d, heads * hd), f"{m}.norm.weight": (d,),
                   f"{m}.mixer.w_gate.weight": (f, d), f"{m}.mixer.w_up.weight": (f, d),
                   f"{m}.mixer.w_down.weight": (d, f)}
    return shapes


def adam_bytes(numels: list[int]) -> int:
    return sum(8 * n + 4 for n in numels)  # exp_avg + exp_avg_sq, and a 4-byte step per tensor


# ---- parameters, gradients, optimizer states -------------------------------------------------------

@pytest.mark.parametrize("extra", [{}, {"model.tie_word_embeddings": "true", "model.normalization": "LayerNorm"},
                                   {"model.position_embedding_type": "learned_absolute", "model.add_bias_linear": "true",
                                    "model.activation": "gelu", "model.mtp_num_layers": "1"}])
def test_single_process_parameters_are_four_bytes_each(extra):
    cfg = config(**extra)
    (row,) = estimate_memory(cfg, 1)
    count = count_parameters(cfg.model, BYTE_VOCAB)
    assert row["num_params"] == count
    assert row["param_bytes"] == row["grad_bytes"] == 4 * count
    with torch.device("meta"):
        num_tensors = len(list(GPTModel(cfg.model, BYTE_VOCAB).parameters()))
    assert row["optimizer_bytes"] == 8 * count + 4 * num_tensors


def test_optimizer_states_per_optimizer():
    count = count_parameters(config().model, BYTE_VOCAB)
    assert plan(**{"optimizer.type": "sgd"})[0]["optimizer_bytes"] == 0
    assert plan(**{"optimizer.type": "sgd", "optimizer.sgd_momentum": "0.9"})[0]["optimizer_bytes"] == 4 * count


def test_tiny_shapes_are_the_model():
    with torch.device("meta"):
        model = GPTModel(config().model, BYTE_VOCAB)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == tiny_shapes()


def test_fsdp4_holds_a_quarter():
    single, (fsdp,) = plan()[0], plan(4, **{"parallel.dp_shard": "4"})
    numels = [math.prod(s) // 4 for s in tiny_shapes().values()]  # every dim 0 divides by 4 here
    assert fsdp["param_bytes"] * 4 == single["param_bytes"] == 4 * 4 * sum(numels)
    assert fsdp["optimizer_bytes"] == adam_bytes(numels)
    # parameters + states: a quarter, up to the unsharded 4-byte steps
    assert (fsdp["param_bytes"] + fsdp["optimizer_bytes"]) * 4 - (single["param_bytes"] + single["optimizer_bytes"]) \
        == 3 * 4 * len(numels)


def test_fsdp_pads_dim0_to_the_shard_degree():
    # an unpadded vocabulary (262 rows) does not split into 4: each rank allocates ceil(262 / 4) = 66 rows
    (row,) = plan(4, **{"parallel.dp_shard": "4", "model.make_vocab_size_divisible_by": "1"})
    numels = [math.ceil(s[0] / 4) * math.prod(s[1:]) for s in tiny_shapes(vocab=BYTE_VOCAB).values()]
    assert BYTE_VOCAB % 4
    assert row["param_bytes"] == 4 * sum(numels)
    assert row["optimizer_bytes"] == adam_bytes(numels)


def test_hsdp_shards_only_over_dp_shard():
    (hsdp,) = plan(4, **{"parallel.dp_replicate": "2", "parallel.dp_shard": "2"})
    (fsdp2,) = plan(2, **{"parallel.dp_shard": "2"})
    assert hsdp["param_bytes"] == fsdp2["param_bytes"] == plan()[0]["param_bytes"] // 2


def test_tp2_embedding_gradients_are_whole_without_fsdp():
    """Which parameters TP2 splits, and their local shapes, are checked against apply_tp's DTensors
    on 2 ranks in test_tp_plan.py; here the gradients and optimizer states that follow from them."""
    (row,) = plan(2, **{"parallel.tp": "2"})
    assert row["optimizer_bytes"] == 2 * row["param_bytes"] + 4 * len(tiny_shapes())
    # DTensor returns the vocabulary-parallel embedding's gradient whole (Replicate) on every TP rank
    embedding = math.prod(tiny_shapes()["embedding.weight"])
    assert row["grad_bytes"] == row["param_bytes"] + 4 * embedding // 2
    (with_fsdp,) = plan(4, **{"parallel.tp": "2", "parallel.dp_shard": "2"})
    assert with_fsdp["grad_bytes"] == with_fsdp["param_bytes"] == row["param_bytes"] // 2


def test_tp2_splits_learnable_sinks_by_head():
    base = plan(2, **{"parallel.tp": "2"})[0]["num_params"]
    (row,) = plan(2, **{"parallel.tp": "2", "model.softmax_type": "learnable"})
    assert row["num_params"] == base + 2 * 4 // 2  # two attention layers of 4 heads, 2 per rank


MAMBA = {"model.layer_pattern": "M-*M", "model.mamba_head_dim": "8", "model.mamba_num_groups": "2",
         "model.mamba_state_dim": "4", "model.mamba_chunk_size": "8"}


def test_tp2_splits_every_mamba_parameter_by_head():
    from meshtron.models import count_parameters

    total = count_parameters(config(**MAMBA).model, BYTE_VOCAB)
    replicated = 5 * 32  # four sublayer norms and the final norm
    assert plan(1, **MAMBA)[0]["num_params"] == total
    assert plan(2, **{"parallel.tp": "2", **MAMBA})[0]["num_params"] == (total - replicated) // 2 + replicated
    with pytest.raises(ValueError, match=r"^parallel.tp: 4 must divide the Mamba heads \(8\) and "
                                         r"model.mamba_num_groups=2; change one of them$"):
        plan(4, **{"parallel.tp": "4", "model.num_query_groups": "4", **MAMBA})


def test_tp_refuses_what_apply_tp_refuses():
    with pytest.raises(ValueError, match="parallel.tp"):
        plan(8, **{"parallel.tp": "8"})  # 4 heads


# ---- activations against a real forward ----------------------------------------------------------

def real_saved_bytes(cfg, recompute: str = "none") -> int:
    """Saved-tensor bytes of one real CPU forward + loss of a micro-batch (the reference)."""
    torch.manual_seed(0)
    model = GPTModel(cfg.model, BYTE_VOCAB)
    if recompute != "none":
        apply_activation_checkpoint(model, recompute)
    shape = (cfg.train.micro_batch_size, cfg.data.seq_length)
    tokens, labels = torch.randint(0, BYTE_VOCAB, shape), torch.randint(0, BYTE_VOCAB, shape)
    with SavedTensorCounter(model) as counter:
        logits, mtp_logits = forward_for_loss(model, tokens, PackedContext.for_tokens(tokens))
        combine_losses(logits, mtp_logits, labels, torch.ones(shape), None, cfg.model)
        return counter.total


@pytest.mark.parametrize("extra", [
    {},
    {"model.normalization": "LayerNorm", "model.position_embedding_type": "learned_absolute",
     "model.activation": "gelu", "model.softmax_type": "learnable", "model.window_size": "8",
     "model.qk_layernorm": "true", "model.hidden_dropout": "0.1", "model.mtp_num_layers": "1"},
    MAMBA,
])
def test_single_process_activations_equal_a_real_forward(extra):
    cfg = config(**extra)
    (row,) = estimate_memory(cfg, 1)
    assert row["microbatches_in_flight"] == 1
    assert row["activation_bytes"] == row["activation_bytes_per_microbatch"] == real_saved_bytes(cfg)


@pytest.mark.parametrize("mode, num_recomputed", [("full", 4), ("selective", 2)])
def test_recompute_keeps_only_sublayer_inputs(mode, num_recomputed):
    cfg = config(**{"parallel.activation_checkpoint": mode})
    (row,) = estimate_memory(cfg, 1)
    # the checkpoint saves each recomputed sublayer's input through autograd, so the hook sees it too
    assert row["activation_bytes"] == real_saved_bytes(cfg, mode)
    (none,) = estimate_memory(config(), 1)
    inputs = num_recomputed * cfg.train.micro_batch_size * cfg.data.seq_length * cfg.model.hidden_size * 4
    assert inputs < row["activation_bytes"] < none["activation_bytes"]


def test_sequence_parallel_and_context_parallel_shrink_activations():
    single = plan()[0]["activation_bytes"]
    tp = plan(2, **{"parallel.tp": "2", "parallel.sequence_parallel": "false"})[0]["activation_bytes"]
    sp = plan(2, **{"parallel.tp": "2"})[0]["activation_bytes"]
    cp = plan(2, **{"parallel.cp": "2"})[0]["activation_bytes"]
    assert sp < tp < single
    assert cp == pytest.approx(single / 2, rel=0.05)  # attention is linear in the local sequence here


# ---- pipelines ------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule, virtual, expected", [
    ("gpipe", 1, [8, 8, 8, 8]),
    ("1f1b", 1, [4, 3, 2, 1]),
    ("interleaved_1f1b", 2, [(4 + 6 + 1) / 2, (4 + 4 + 1) / 2, (4 + 2 + 1) / 2, (4 + 0 + 1) / 2]),
    ("zero_bubble", 2, [4, 4, 4, 4]),
])
def test_microbatches_in_flight(schedule, virtual, expected):
    cfg = config(8, **{"parallel.pp": "4", "parallel.pp_schedule": schedule, "parallel.pp_virtual_stages": str(virtual)})
    dims = ParallelDims.from_config(cfg.parallel, 8)
    assert [microbatches_in_flight(cfg, dims, r, 8) for r in range(4)] == expected


def test_pipeline_stages_split_parameters_and_hold_micro_batches():
    pytest.importorskip("meshtron.parallel.pipeline_stages")
    rows = plan(2, **{"parallel.pp": "2", "parallel.pp_schedule": "gpipe"})
    shapes = tiny_shapes()
    first = [s for n, s in shapes.items() if n.startswith(("embedding", "layers.0.", "layers.1."))]
    assert [r["sublayers"] for r in rows] == ["0-1", "2-3"]
    assert rows[0]["num_params"] == sum(math.prod(s) for s in first)
    assert sum(r["num_params"] for r in rows) == plan()[0]["num_params"]
    # GPipe keeps all 4 micro-batches (global 8 / micro 2) of each stage
    assert [r["activation_bytes"] for r in rows] == [4 * r["activation_bytes_per_microbatch"] for r in rows]


def test_tied_pipeline_last_stage_holds_the_embedding_copy():
    """With tied embeddings the last stage keeps its own copy of the embedding for the head: a parameter
    (with gradient and optimizer state) of that stage, not an activation; the untied run's activations."""
    pytest.importorskip("meshtron.parallel.pipeline_stages")
    layout = {"parallel.pp": "2", "parallel.pp_schedule": "gpipe"}
    tied = plan(2, **layout, **{"model.tie_word_embeddings": "true"})
    untied = plan(2, **layout)
    shapes = tiny_shapes()
    last = [s for n, s in shapes.items() if n.startswith(("embedding", "final_norm", "layers.2.", "layers.3."))]
    assert tied[1]["num_params"] == sum(math.prod(s) for s in last)
    assert tied[1]["num_params"] == untied[1]["num_params"]  # the copy replaces the output head, same shape
    assert tied[0]["num_params"] == untied[0]["num_params"]
    assert [r["activation_bytes"] for r in tied] == [r["activation_bytes"] for r in untied]


# ---- the command ----------------------------------------------------------------------------------

@pytest.fixture
def tiny_yaml(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text("model:\n  num_layers: 2\n  hidden_size: 32\n  num_attention_heads: 4\n  num_query_groups: 2\n"
                    "  ffn_hidden_size: 64\n  max_position_embeddings: 64\ndata:\n  seq_length: 32\n"
                    "train:\n  micro_batch_size: 2\n  global_batch_size: 8\n")
    return path


def test_plan_command_prints_the_table(tiny_yaml, capsys):
    from meshtron.cli import main

    assert main(["plan", "--config", str(tiny_yaml), "--world-size", "4", "--parallel.dp_shard", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(out) if line.split()[:2] == ["stage", "sublayers"])
    row = out[header + 1].split()
    expected = plan(4, **{"parallel.dp_shard": "4"})[0]
    assert row[:2] == ["0", "0-3"] and float(row[2]) == pytest.approx(expected["param_bytes"] / 2**20, abs=0.01)
    assert float(row[6]) == pytest.approx(expected["total_bytes"] / 2**20, abs=0.01)


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "3", "--parallel.tp", "2"], "error: parallel"),
    (["--world-size", "4", "--parallel.tp", "4"], "error: parallel.tp"),  # 2 key/value heads
    (["--world-size", "0"], "error: --world-size"),
    (["--world-size", "1", "--parallel.nope", "1"], "error: unrecognized arguments"),
])
def test_plan_command_config_errors_exit_2_in_one_line(tiny_yaml, capsys, argv, message):
    from meshtron.cli import main

    assert main(["plan", "--config", str(tiny_yaml), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1



def test_plan_command_lists_parameter_placements(tiny_yaml, capsys):
    from meshtron.cli import main

    assert main(["plan", "--config", str(tiny_yaml), "--world-size", "2", "--parallel.tp", "2", "--parameters"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines() if line.startswith(
        ("layers.0.", "layers.1.", "embedding"))}
    # Megatron's layout of the TINY model: Wo row-parallel (32 x 4*8 -> 32 x 16), W_up column-parallel,
    # the vocabulary split by rows, sublayer norms replicated under sequence parallelism
    assert rows["layers.0.mixer.wo.weight"] == ["32x32", "S(1)", "32x16"]
    assert rows["layers.1.mixer.w_up.weight"] == ["64x32", "S(0)", "32x32"]
    assert rows["embedding.weight"] == ["384x32", "S(0)", "192x32"]
    assert rows["layers.0.norm.weight"] == ["32", "R", "32"]


# ---- tracing one sublayer of each kind ------------------------------------------------------------

MOE = {"model.num_moe_experts": "4", "model.moe_router_topk": "2", "model.moe_ffn_hidden_size": "16"}
MIXED = {
    "mla_moe_mtp": {**MOE, "model.num_layers": "5", "model.moe_layer_freq": "[0,1,1,0,1]",
                    "model.multi_latent_attention": "true", "model.q_lora_rank": "16", "model.kv_lora_rank": "8",
                    "model.qk_head_dim": "8", "model.qk_pos_emb_head_dim": "4", "model.v_head_dim": "8",
                    "model.moe_shared_expert_intermediate_size": "16", "model.mtp_num_layers": "1"},
    "deepseek_shaped": {**MOE, "model.num_layers": "8", "model.moe_layer_freq": "[0,0,1,1,1,1,1,1]",
                        "model.multi_latent_attention": "true", "model.q_lora_rank": "16", "model.kv_lora_rank": "8",
                        "model.qk_head_dim": "8", "model.qk_pos_emb_head_dim": "4", "model.v_head_dim": "8",
                        "model.moe_shared_expert_intermediate_size": "16", "model.mtp_num_layers": "1"},
    "mamba_moe_window": {**MOE, **MAMBA, "model.layer_pattern": "M*-*EM*E*-*EE-M*", "model.window_size": "8",
                         "model.window_attn_skip_freq": "2"},
}
LAYOUTS = {
    "single": (1, {}),
    "selective": (1, {"parallel.activation_checkpoint": "selective"}),
    "pp2": (2, {"parallel.pp": "2", "parallel.pp_schedule": "gpipe"}),
    "tp2_sp": (2, {"parallel.tp": "2", "parallel.sequence_parallel": "true"}),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MIXED)
def test_tracing_representative_sublayers_equals_the_full_trace(model, layout):
    """estimate_memory traces one sublayer per class of identical ones (`representative_layers`); the
    reference traces every sublayer of the model (the full fake forward)."""
    world, overrides = LAYOUTS[layout]
    cfg = config(world, **MIXED[model], **overrides)
    fast = estimate_memory(cfg, world)
    assert fast == _estimate_memory(cfg, world, full_trace=True)
    assert all(r["activation_bytes_per_microbatch"] > 0 for r in fast)


def test_representative_layers_trace_a_deepseek_shaped_model_once_per_kind():
    """Two dense layers then MoE ones (DeepSeek-V3's shape, worked out by hand): sublayers 0-3 differ in
    what ran before them, 4 is 2's twin (attention after an MLP, both kinds seen) but runs before 5, the
    first MoE; 6 (attention after MoE) and 7 (an MoE after a seen MoE) are the repeating pair; the last
    (an MoE) need not run: 7 before the final norm is its twin."""
    cfg = config(**MIXED["deepseek_shaped"])
    assert cfg.model.pattern == "*-*-*E*E*E*E*E*E"
    with torch.device("meta"):
        model = GPTModel(cfg.model, BYTE_VOCAB)
    traced, rep = representative_layers(model, range(16))
    assert traced == [0, 1, 2, 3, 4, 5, 6, 7]
    assert rep == {0: 0, 1: 1, 2: 2, 3: 3, 4: 2, 5: 5, 6: 6, 7: 7, **{i: 6 if i % 2 == 0 else 7 for i in range(8, 16)}}
