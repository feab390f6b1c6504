"""Megatron Core torch_dist <-> meshtron, against megatron-core 0.19.2 itself (CPU, local layer spec):
a GPTModel saved by `dist_checkpointing.save` converts to meshtron logits equal to megatron-core's
forward (<= 1e-5 relative); converted back, `dist_checkpointing.load` puts identical tensors into a
fresh GPTModel; a meshtron-born model exported to Megatron gives megatron-core the same logits; bad
input is one line, exit 2, no output."""

from __future__ import annotations

import dataclasses
import enum
import io
import shutil

import pytest
import torch
import yaml

from meshtron.checkpoint import load_checkpoint, read_checkpoint_config
from meshtron.cli import main
from meshtron.config.loader import config_from_dict, config_to_dict
from meshtron.config.schema import RunConfig
from meshtron.models import GPTModel
from meshtron.models.hf.dcp_io import write_model_checkpoint
from meshtron.models.megatron.convert import megatron_to_meshtron, meshtron_to_megatron
from meshtron.models.megatron.dcp_files import load_common_state
from meshtron.models.megatron.names import MegatronError, fuse_qkv, model_config_from_args, split_qkv

pytest.importorskip("megatron.core")  # a test dependency (make test installs it): these never skip in CI

from tests.models.megatron import megatron_harness as mh  # noqa: E402

RTOL = 1e-5


@pytest.fixture(scope="module")
def megatron():
    with mh.cpu_megatron():
        yield


@pytest.fixture(scope="module")
def saved(megatron, tmp_path_factory):
    """{tied: (megatron model, save dir)} built with different seeds, norms moved away from 1."""
    out = {}
    for tied in (False, True):
        torch.manual_seed(10 + tied)
        model = mh.build_gpt(tied)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "layernorm" in name:
                    p.add_(0.1 * torch.randn_like(p))
        root = tmp_path_factory.mktemp(f"megatron-{'tied' if tied else 'untied'}")
        mh.save_megatron(model, root, mh.megatron_args(model, tied))
        out[tied] = (model, root)
    return out


def load_meshtron(checkpoint) -> GPTModel:
    cfg = config_from_dict(yaml.safe_load(read_checkpoint_config(checkpoint)))
    model = GPTModel(cfg.model).eval()
    load_checkpoint(checkpoint, model)
    return model


def relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def check_logits(megatron_model, step_dir):
    ours = load_meshtron(step_dir)
    torch.manual_seed(3)
    tokens = torch.randint(0, 128, (2, 24))
    expected = mh.logits(megatron_model, tokens)
    with torch.no_grad():
        assert relative_diff(ours(tokens), expected) <= RTOL


def test_logits_match_megatron_core_and_round_trip(saved, tmp_path):
    """The fast representative: untied embeddings, both directions through the CLI."""
    model, root = saved[False]
    assert main(["convert", "megatron-to-meshtron", "--megatron-dir", str(root), "--output",
                 str(tmp_path / "ckpt")]) == 0
    cfg = config_from_dict(yaml.safe_load(read_checkpoint_config(tmp_path / "ckpt"))).model
    assert (cfg.num_layers, cfg.num_query_groups, cfg.ffn_hidden_size, cfg.tie_word_embeddings) == (2, 2, 96, False)
    check_logits(model, tmp_path / "ckpt")
    assert main(["convert", "meshtron-to-megatron", "--checkpoint", str(tmp_path / "ckpt"), "--output",
                 str(tmp_path / "back")]) == 0
    torch.manual_seed(99)
    fresh = mh.build_gpt(False)
    assert any(not torch.equal(a, b) for a, b in zip(mh.state_tensors(fresh).values(),
                                                      mh.state_tensors(model).values()))
    common = mh.load_megatron(fresh, tmp_path / "back" / "release")
    assert (tmp_path / "back" / "latest_checkpointed_iteration.txt").read_text() == "release"
    expected, got = mh.state_tensors(model), mh.state_tensors(fresh)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    assert common["args"].num_query_groups == 2 and common["args"].untie_embeddings_and_output_weights


@pytest.mark.slow  # a second Megatron model and checkpoint (~15 s on the 2-core machine)
def test_tied_embeddings_both_ways(saved, tmp_path):
    model, root = saved[True]
    step_dir = megatron_to_meshtron(root / "iter_0000007", tmp_path / "ckpt")  # the iteration dir works too
    assert "output.weight" not in load_meshtron(step_dir).state_dict()
    check_logits(model, step_dir)
    meshtron_to_megatron(tmp_path / "ckpt", tmp_path / "back")
    torch.manual_seed(98)
    fresh = mh.build_gpt(True)
    mh.load_megatron(fresh, tmp_path / "back" / "release")
    for name, tensor in mh.state_tensors(model).items():
        assert torch.equal(tensor, mh.state_tensors(fresh)[name]), name


@pytest.mark.slow
def test_layernorm_gelu_biases_and_qk_layernorm_both_ways(megatron, tmp_path):
    """The other dense options: LayerNorm (weights and biases), GeLU MLP, linear and q/k/v biases, QK-layernorm."""
    torch.manual_seed(31)
    shape = dict(normalization="LayerNorm", gated_linear_unit=False, activation_func=torch.nn.functional.gelu,
                 add_bias_linear=True, qk_layernorm=True)
    model = mh.build_gpt(False, **shape)
    with torch.no_grad():  # norms and biases away from 1 and 0, so a swapped one would show
        for name, p in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    mh.save_megatron(model, tmp_path / "meg", mh.megatron_args(model, False))
    step_dir = megatron_to_meshtron(tmp_path / "meg", tmp_path / "ckpt")
    cfg = config_from_dict(yaml.safe_load(read_checkpoint_config(step_dir))).model
    assert (cfg.normalization, cfg.activation, cfg.add_bias_linear, cfg.qk_layernorm) == ("LayerNorm", "gelu", True, True)
    check_logits(model, step_dir)
    meshtron_to_megatron(tmp_path / "ckpt", tmp_path / "back")
    torch.manual_seed(32)
    fresh = mh.build_gpt(False, **shape)
    mh.load_megatron(fresh, tmp_path / "back" / "release")
    for name, tensor in mh.state_tensors(model).items():
        assert torch.equal(tensor, mh.state_tensors(fresh)[name]), name


@pytest.mark.slow  # two ranks, each importing megatron-core (~30 s)
def test_tensor_parallel_checkpoint_both_ways(tmp_path):
    """A TP=2 save (linear_qkv, linear_fc1, linear_proj, the embedding and the output layer each split in
    chunks over the ranks) converts to meshtron logits equal to TP=2 megatron-core's; the export, one chunk
    per layer, loads into TP=2 megatron-core again with the same local tensors."""
    from meshtron.testing.multiprocess import run_ranks

    saved = run_ranks("tests.models.megatron.megatron_harness:tp_save", 2, timeout_s=300,
                      save_dir=str(tmp_path / "meg"))
    from meshtron.models.megatron.dcp_files import MegatronCheckpoint

    chunks = MegatronCheckpoint(tmp_path / "meg")._chunks
    assert len(chunks["decoder.layers.self_attention.linear_qkv.weight"]) == 2 * 2  # layers x TP ranks
    assert len(chunks["embedding.word_embeddings.weight"]) == 2
    step_dir = megatron_to_meshtron(tmp_path / "meg", tmp_path / "ckpt")
    with torch.no_grad():
        assert relative_diff(load_meshtron(step_dir)(saved[0]["tokens"]), saved[0]["logits"]) <= RTOL
    meshtron_to_megatron(tmp_path / "ckpt", tmp_path / "back")
    loaded = run_ranks("tests.models.megatron.megatron_harness:tp_load", 2, timeout_s=300,
                       step_dir=str(tmp_path / "back" / "release"))
    for rank in range(2):
        assert loaded[rank].keys() == saved[rank]["state"].keys()
        for name, tensor in saved[rank]["state"].items():
            assert torch.equal(tensor, loaded[rank][name]), (rank, name)


@pytest.mark.slow
def test_per_layer_layout_is_read(saved, tmp_path):
    """megatron's non-homogeneous layout: `decoder.layers.<i>.*` keys instead of tensors stacked over layers."""
    model, _ = saved[False]
    step = mh.save_megatron(model, tmp_path / "meg", mh.megatron_args(model, False), per_layer=True)
    assert (tmp_path / "meg" / "latest_checkpointed_iteration.txt").exists()
    from meshtron.models.megatron.dcp_files import MegatronCheckpoint

    assert "decoder.layers.1.self_attention.linear_qkv.weight" in MegatronCheckpoint(step).sizes
    check_logits(model, megatron_to_meshtron(tmp_path / "meg", tmp_path / "ckpt"))


@pytest.mark.slow
def test_meshtron_model_exported_gives_megatron_core_the_same_logits(megatron, tmp_path):
    """A model born in meshtron (GQA 4 heads / 2 groups, RMSNorm, SwiGLU, RoPE base 5e5), exported."""
    run = RunConfig()
    run.model = dataclasses.replace(run.model, num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                    ffn_hidden_size=96, vocab_size=128, make_vocab_size_divisible_by=1,
                                    rotary_base=500000.0, max_position_embeddings=64)
    torch.manual_seed(5)
    ours = GPTModel(run.model).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    state = ours.state_dict()
    write_model_checkpoint(tmp_path / "ckpt", 0, {n: (tuple(t.shape), t.dtype) for n, t in state.items()},
                           state.__getitem__, {"step": 0, "model_only": True},
                           yaml.safe_dump(config_to_dict(run), sort_keys=False))
    meshtron_to_megatron(tmp_path / "ckpt", tmp_path / "meg")
    theirs = mh.build_gpt(False, rotary_base=500000)
    mh.load_megatron(theirs, tmp_path / "meg" / "release")
    tokens = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        assert relative_diff(ours(tokens), mh.logits(theirs, tokens)) <= RTOL


@pytest.mark.slow  # an MoE model saved, converted both ways (~20 s)
@pytest.mark.parametrize("layer_freq, pattern", [(1, "*E*E"), ([0, 1], "*-*E")])
def test_moe_layers_both_ways(megatron, tmp_path, layer_freq, pattern):
    """Router, 4 experts (SequentialMLP, stacked on an expert axis on disk), a shared expert: logits and
    tensors; every layer MoE (tensors stacked over layers) and dense + MoE (keyed per layer)."""
    torch.manual_seed(21)
    model = mh.build_moe_gpt(layer_freq=layer_freq)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.add_(0.1 * torch.randn_like(p))
    mh.save_megatron(model, tmp_path / "meg", mh.moe_args(model))
    step_dir = megatron_to_meshtron(tmp_path / "meg", tmp_path / "ckpt")
    cfg = config_from_dict(yaml.safe_load(read_checkpoint_config(step_dir))).model
    assert (cfg.pattern, cfg.num_moe_experts, cfg.moe_ffn_hidden_size, cfg.moe_shared_expert_intermediate_size) == \
        (pattern, 4, 48, 32)
    check_logits(model, step_dir)
    meshtron_to_megatron(tmp_path / "ckpt", tmp_path / "back")
    torch.manual_seed(22)
    fresh = mh.build_moe_gpt(layer_freq=layer_freq)
    mh.load_megatron(fresh, tmp_path / "back" / "release")
    expected, got = mh.state_tensors(model), mh.state_tensors(fresh)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


@pytest.mark.slow
def test_moe_sigmoid_router_expert_bias_and_shared_expert_gate(megatron, tmp_path):
    """DeepSeek-style routing: sigmoid scores, a per-expert bias for selection, scaled top-k weights; a gated
    shared expert."""
    torch.manual_seed(41)
    options = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                   moe_router_topk_scaling_factor=2.5, moe_shared_expert_gate=True)
    model = mh.build_moe_gpt(**options)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or "gate_weight" in name:
                p.add_(0.5 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.randn_like(b))  # large enough to change which experts are picked
    mh.save_megatron(model, tmp_path / "meg", mh.moe_args(model))
    step_dir = megatron_to_meshtron(tmp_path / "meg", tmp_path / "ckpt")
    cfg = config_from_dict(yaml.safe_load(read_checkpoint_config(step_dir))).model
    assert (cfg.moe_router_score_function, cfg.moe_router_enable_expert_bias, cfg.moe_router_topk_scaling_factor,
            cfg.moe_shared_expert_gate) == ("sigmoid", True, 2.5, True)
    check_logits(model, step_dir)
    meshtron_to_megatron(tmp_path / "ckpt", tmp_path / "back")
    torch.manual_seed(42)
    fresh = mh.build_moe_gpt(**options)
    mh.load_megatron(fresh, tmp_path / "back" / "release")
    for name, tensor in mh.state_tensors(model).items():
        assert torch.equal(tensor, mh.state_tensors(fresh)[name]), name


def test_multi_token_prediction_layers_are_dropped_with_a_note(tmp_path, capsys):
    run = RunConfig()
    run.model = dataclasses.replace(run.model, num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64,
                                    make_vocab_size_divisible_by=1, mtp_num_layers=1)
    state = GPTModel(run.model).state_dict()
    write_model_checkpoint(tmp_path / "ckpt", 0, {n: (tuple(t.shape), t.dtype) for n, t in state.items()},
                           state.__getitem__, {"step": 0, "model_only": True},
                           yaml.safe_dump(config_to_dict(run), sort_keys=False))
    rc, err = run_cli(["convert", "meshtron-to-megatron", "--checkpoint", str(tmp_path / "ckpt"), "--output",
                       str(tmp_path / "meg")], capsys)
    assert rc == 0 and "note: dropped" in err and "multi-token prediction" in err
    from meshtron.models.megatron.dcp_files import MegatronCheckpoint

    assert not any(name.startswith("mtp") for name in MegatronCheckpoint(tmp_path / "meg").sizes)


def test_qkv_layout_matches_megatron_core_split():
    """split_qkv against megatron's own reading of linear_qkv: view (groups, (q_per_group + 2) * head_dim)."""
    cfg = dataclasses.replace(RunConfig().model, hidden_size=8, num_attention_heads=4, num_query_groups=2)
    cfg = dataclasses.replace(cfg, kv_channels=2)
    fused = torch.randn(2 * (2 + 2) * 2, 8)  # rows: 2 groups x (2 query heads + k + v) x head_dim 2
    x = torch.randn(3, 8)
    mixed = (x @ fused.T).view(3, 2, (2 + 2) * 2)  # what SelfAttention.get_query_key_value_tensors does
    q_ref, k_ref, v_ref = torch.split(mixed, [2 * 2, 2, 2], dim=2)
    q, k, v = split_qkv(fused, cfg)
    assert torch.equal((x @ q.T).view(3, 4, 2), q_ref.reshape(3, 4, 2))
    assert torch.equal((x @ k.T).view(3, 2, 2), k_ref.reshape(3, 2, 2))
    assert torch.equal((x @ v.T).view(3, 2, 2), v_ref.reshape(3, 2, 2))
    assert torch.equal(fuse_qkv(q, k, v, cfg), fused)


# ---- bad input -----------------------------------------------------------------------------------

def run_cli(argv, capsys) -> tuple[int, str]:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    return rc, err


def test_non_megatron_and_legacy_directories_are_refused(tmp_path, capsys):
    (tmp_path / "plain").mkdir()
    rc, err = run_cli(["convert", "megatron-to-meshtron", "--megatron-dir", str(tmp_path / "plain"),
                       "--output", str(tmp_path / "out")], capsys)
    assert rc == 2 and len(err.splitlines()) == 1 and "not a Megatron torch_dist checkpoint" in err
    legacy = tmp_path / "legacy" / "iter_0000003" / "mp_rank_00"
    legacy.mkdir(parents=True)
    (legacy / "model_optim_rng.pt").write_bytes(b"\x80\x04not really")
    (tmp_path / "legacy" / "latest_checkpointed_iteration.txt").write_text("3\n")
    rc, err = run_cli(["convert", "megatron-to-meshtron", "--megatron-dir", str(tmp_path / "legacy"),
                       "--output", str(tmp_path / "out")], capsys)
    assert rc == 2 and len(err.splitlines()) == 1 and "torch_dist" in err and "model_optim_rng.pt" in err
    assert not (tmp_path / "out").exists()


def _write_config(path, **model):
    run = RunConfig()
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96)
    run.model = dataclasses.replace(run.model, **{**fields, **model})
    path.write_text(yaml.safe_dump(config_to_dict(run), sort_keys=False))
    return path


@pytest.mark.parametrize("model, message", [
    ({"ffn_hidden_size": 80}, "'decoder.layers.mlp.linear_fc1.weight' has shape [192, 64] per layer, the config implies [160, 64]"),
    ({"qk_layernorm": True}, "tensor 'decoder.layers.self_attention.q_layernorm.weight' is missing"),
    ({"tie_word_embeddings": True}, "tensor 'output_layer.weight' has no place in the converted model"),
    ({"num_layers": 3}, "stacks 2 layers, the config has 3"),
])
def test_checkpoint_contradicting_the_config_is_refused(saved, tmp_path, capsys, model, message):
    _, root = saved[False]
    config = _write_config(tmp_path / "model.yaml", **model)
    out = tmp_path / "out"
    rc, err = run_cli(["convert", "megatron-to-meshtron", "--megatron-dir", str(root), "--output", str(out),
                       "--config", str(config)], capsys)
    assert rc == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_unsupported_layer_types_in_args_are_refused(saved, tmp_path, capsys):
    model, _ = saved[False]
    args = vars(mh.megatron_args(model, False))
    with pytest.raises(MegatronError, match="moe_layer_freq = \\[0, 1, 1\\]: give an integer >= 1 or a 0/1 list"):
        model_config_from_args({**args, "num_experts": 8, "moe_layer_freq": [0, 1, 1]}, 128)
    with pytest.raises(MegatronError, match="multi_latent_attention = True"):
        model_config_from_args({**args, "multi_latent_attention": True}, 128)
    with pytest.raises(MegatronError, match="learned_absolute"):
        model_config_from_args({**args, "position_embedding_type": "learned_absolute"}, 128)
    # and through the files: a dense checkpoint whose args say MoE has no router tensor; nothing is written
    root = tmp_path / "moe"
    mh.save_megatron(model, root, argparse_namespace({**args, "num_experts": 8, "moe_ffn_hidden_size": 48}))
    rc, err = run_cli(["convert", "megatron-to-meshtron", "--megatron-dir", str(root), "--output",
                       str(tmp_path / "out")], capsys)
    assert rc == 2 and len(err.splitlines()) == 1 and not (tmp_path / "out").exists()
    assert "tensor 'decoder.layers.mlp.router.weight' is missing" in err, err


class WriterEnum(enum.Enum):  # stands for Megatron's AttnBackend: a class meshtron never imports
    two = 2


def test_legacy_common_pt_is_read_when_present(saved, tmp_path, capsys):
    """Older megatron-core keeps the common state in common.pt beside the DCP files; it wins when present."""
    model, root = saved[False]
    shutil.copytree(root, tmp_path / "meg")
    args = {**vars(mh.megatron_args(model, False)), "multi_latent_attention": True}
    torch.save({"args": argparse_namespace(args), "checkpoint_version": 3.0, "iteration": 7},
               tmp_path / "meg" / "iter_0000007" / "common.pt")
    rc, err = run_cli(["convert", "megatron-to-meshtron", "--megatron-dir", str(tmp_path / "meg"), "--output",
                       str(tmp_path / "out")], capsys)
    assert rc == 2 and "args.multi_latent_attention = True" in err and not (tmp_path / "out").exists()


def argparse_namespace(d):
    import argparse

    return argparse.Namespace(**d)


def test_common_state_never_runs_code(tmp_path):
    """A common state naming os.system is read with an inert stand-in (no call), or refused."""
    class Boom:
        def __reduce__(self):
            import os
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    buffer = io.BytesIO()
    torch.save([{"args": None, "x": Boom()}], buffer)
    with pytest.raises(MegatronError, match="--config MODEL.yaml"):  # torch's loader refuses os.system outright
        load_common_state(buffer.getvalue(), "test")
    assert not (tmp_path / "ran").exists()
    # a class of the writer's that meshtron does not import becomes an inert stand-in
    buffer = io.BytesIO()
    torch.save([{"args": argparse_namespace({"num_layers": 3, "backend": WriterEnum(2)})}], buffer)
    state = load_common_state(buffer.getvalue(), "test")
    assert state["args"].num_layers == 3 and type(state["args"].backend).__name__ == "_Opaque"
    assert state["args"].backend.args == (2,)
    with pytest.raises(MegatronError, match="--config MODEL.yaml"):
        load_common_state(b"garbage", "test")


def test_meshtron_to_megatron_refuses_what_megatron_gpt_cannot_hold(tmp_path, capsys):
    run = RunConfig()
    run.model = dataclasses.replace(run.model, num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64,
                                    make_vocab_size_divisible_by=1, softmax_type="learnable")
    state = GPTModel(run.model).state_dict()
    write_model_checkpoint(tmp_path / "ckpt", 0, {n: (tuple(t.shape), t.dtype) for n, t in state.items()},
                           state.__getitem__, {"step": 0, "model_only": True},
                           yaml.safe_dump(config_to_dict(run), sort_keys=False))
    rc, err = run_cli(["convert", "meshtron-to-megatron", "--checkpoint", str(tmp_path / "ckpt"), "--output",
                       str(tmp_path / "meg")], capsys)
    assert rc == 2 and "model.softmax_type" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "meg").exists() and not list(tmp_path.glob(".meg*"))
    shutil.rmtree(tmp_path / "ckpt")
