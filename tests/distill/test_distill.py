"""Distillation end to end: a distilled student ends closer to its teacher than the same student
trained on the labels alone; a Hugging Face teacher gives the HF model's logits; the logged loss is
the weighted sum of the logged terms; every parallel layout (FSDP, DDP, HSDP, TP, CP, PP, EP and their
tested combinations, listed in docs/distillation.md) equals the single process."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from meshtron.config import ConfigError, load_config
from meshtron.data.loader import BatchLoader, fixed_batches
from meshtron.distill import DistillTrainer
from meshtron.models.gpt import GPTModel
from meshtron.nn.context import PackedContext
from meshtron.testing.multiprocess import run_ranks
from meshtron.training import Trainer

# The teacher: wider (48) and deeper (3 layers) than the student of tests/conftest.py's TINY (32, 2).
TEACHER = {"model.num_layers": "3", "model.hidden_size": "48", "model.num_attention_heads": "4",
           "model.num_query_groups": "2", "model.ffn_hidden_size": "96", "model.max_position_embeddings": "64",
           "data.seq_length": "32", "train.micro_batch_size": "4", "train.global_batch_size": "8",
           "train.train_iters": "40", "train.eval_interval": "0", "train.peak_flops": "1e11",
           "logger.progress_bar": "off", "logger.log_interval": "10", "scheduler.warmup_steps": "4",
           "optimizer.lr": "3e-3"}


@pytest.fixture(scope="module")
def teacher_checkpoint(tmp_path_factory):
    """A meshtron checkpoint of a teacher trained for 40 steps on the stdlib corpus."""
    root = tmp_path_factory.mktemp("teacher")
    cfg = load_config(overrides={**TEACHER, "train.run_dir": str(root / "run"),
                                 "checkpoint.save": str(root / "checkpoints")})
    Trainer(cfg).train()
    return str(root / "checkpoints")


def kl_to_teacher(student: torch.nn.Module, teacher: torch.nn.Module, batches, vocab: int) -> float:
    """Mean per-token KL(teacher || student) over the loss tokens of fixed batches."""
    total = count = 0.0
    with torch.no_grad():
        for mb in batches:
            ctx = PackedContext.for_tokens(mb["input_ids"])
            log_q = F.log_softmax(student(mb["input_ids"], ctx)[..., :vocab], -1)
            log_p = F.log_softmax(teacher(mb["input_ids"], PackedContext.for_tokens(mb["input_ids"]))[..., :vocab], -1)
            kl = (log_p.exp() * (log_p - log_q)).sum(-1)
            total += float((kl * mb["loss_mask"]).sum())
            count += float(mb["loss_mask"].sum())
    return total / count


def test_distilled_student_is_closer_to_the_teacher(tiny_config, teacher_checkpoint):
    steps = {"train.train_iters": "20", "optimizer.lr": "3e-3", "checkpoint.save_at_end": "false",
             "train.seed": "7", "train.global_batch_size": "8", "train.micro_batch_size": "4"}
    distilled = DistillTrainer(tiny_config(**steps, **{"teacher.load": teacher_checkpoint}))
    labels = Trainer(tiny_config(**steps))
    for p, q in zip(labels.model.parameters(), distilled.model.parameters()):
        assert torch.equal(p, q)   # the same student at the start (same seed)
    batches = fixed_batches(labels.valid_ds, 4, 4)
    vocab = labels.tokenizer.vocab_size
    kl_start = kl_to_teacher(labels.model, distilled.teacher, batches, vocab)
    distilled.train()
    labels.train()
    kl_distilled = kl_to_teacher(distilled.model, distilled.teacher, batches, vocab)
    kl_labels = kl_to_teacher(labels.model, distilled.teacher, batches, vocab)
    print(f"KL to teacher: start {kl_start:.4f}; after 20 steps distilled {kl_distilled:.4f}, "
          f"labels only {kl_labels:.4f}")
    assert kl_distilled < kl_labels < kl_start


def test_logged_loss_is_the_weighted_sum_of_logged_terms(tiny_config, teacher_checkpoint):
    cfg = tiny_config(**{"teacher.load": teacher_checkpoint, "train.train_iters": "3",
                         "distill.losses": "kl,topk_kl,hidden_cosine,hidden_mse", "distill.weights": "[1, 0.5, 2, 3]",
                         "distill.label_weight": "0.25", "distill.layer_pairs": "0:1,-1:-1", "distill.top_k": "8",
                         "distill.temperature": "2", "checkpoint.save_at_end": "false"})
    trainer = DistillTrainer(cfg)
    maps = list(trainer.model.distill_projections.maps.values())
    assert [tuple(m.weight.shape) for m in maps] == [(48, 32), (48, 32)]   # student 32 -> teacher 48
    assert trainer.layer_pairs == [(0, 1), (3, 5)]
    before = [m.weight.detach().clone() for m in maps]
    history = trainer.train()
    records = [json.loads(line) for line in open(f"{cfg.train.run_dir}/metrics.jsonl")]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 3
    for r, result in zip(train, history):
        assert r["loss"] == pytest.approx(result.loss)
        weighted = (0.25 * r["lm_loss"] + r["distill_kl"] + 0.5 * r["distill_topk_kl"]
                    + 2 * r["distill_hidden_cosine"] + 3 * r["distill_hidden_mse"])
        assert r["loss"] == pytest.approx(weighted, rel=1e-6)
        assert r["distill_hidden_cosine"] == pytest.approx(
            (r["distill_hidden_cosine_pair0"] + r["distill_hidden_cosine_pair1"]) / 2, rel=1e-6)
        assert 0 < r["distill_topk_kl_teacher_mass"] <= 1
    # the projections are trained with the student
    assert all(not torch.equal(m.weight, b) for m, b in zip(maps, before))


def test_hf_teacher_gives_the_hf_models_logits(tiny_config, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(vocab_size=384, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    trainer = DistillTrainer(tiny_config(**{"teacher.load": str(tmp_path / "hf"), "train.train_iters": "1"}))
    assert trainer.teacher_cfg.pattern == "*-*-" and trainer.teacher_cfg.hidden_size == 48
    tokens = torch.randint(0, 262, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = trainer.teacher(tokens, PackedContext.for_tokens(tokens))
        theirs = hf(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert trainer.train()[0].loss > 0


def test_hybrid_moe_teacher_with_its_own_pattern(tiny_config, tmp_path):
    """A Mamba + attention + MoE teacher (pattern 'M*E-', width 48) distilled into the dense student:
    the logged KL of step 1 equals KL(teacher || student) computed here from the two models."""
    teacher_cfg = load_config(overrides={
        **TEACHER, "model.layer_pattern": "M*E-", "model.num_moe_experts": "4", "model.mamba_head_dim": "8",
        "model.mamba_num_groups": "2", "model.mamba_state_dim": "8", "model.mamba_chunk_size": "8",
        "train.train_iters": "2", "train.run_dir": str(tmp_path / "teacher"),
        "checkpoint.save": str(tmp_path / "teacher" / "checkpoints")})
    Trainer(teacher_cfg).train()
    trainer = DistillTrainer(tiny_config(**{"teacher.load": str(tmp_path / "teacher" / "checkpoints"),
                                            "train.train_iters": "1", "checkpoint.save_at_end": "false"}))
    assert trainer.teacher_cfg.pattern == "M*E-" and trainer.teacher_cfg.hidden_size == 48
    student = GPTModel(trainer.cfg.model, trainer.tokenizer.vocab_size)
    student.load_state_dict(trainer.model.state_dict())
    cfg = trainer.cfg.train
    batch = BatchLoader(trainer.train_ds, micro_batch_size=cfg.micro_batch_size, global_batch_size=cfg.global_batch_size,
                        seed=trainer.cfg.data.seed).next_global_batch()
    vocab = trainer.tokenizer.vocab_size
    expected = sum(kl_to_teacher(student, trainer.teacher, [mb], vocab) * float(mb["loss_mask"].sum()) for mb in batch)
    expected /= sum(float(mb["loss_mask"].sum()) for mb in batch)
    result = trainer.train()[0]
    assert result.extra["distill_kl"] == pytest.approx(expected, rel=1e-5)
    assert result.loss == pytest.approx(expected, rel=1e-5)   # kl alone, weight 1, no label term


def test_teacher_config_gives_the_teacher_its_architecture(tiny_config, teacher_checkpoint, tmp_path):
    """teacher.config wins over the config saved with the checkpoint: a YAML describing the teacher's
    weights (3 layers, width 48, pattern '*-*-*-', unlike the student's 2 layers of 32) with another
    RoPE base and norm epsilon (no weight changes) builds that model, and step 1's KL is the KL
    computed here from a model built from the YAML and the student."""
    path = tmp_path / "teacher.yaml"
    path.write_text("model:\n  num_layers: 3\n  hidden_size: 48\n  num_attention_heads: 4\n  num_query_groups: 2\n"
                    "  ffn_hidden_size: 96\n  max_position_embeddings: 64\n  rotary_base: 500.0\n"
                    "  norm_epsilon: 0.01\n")
    trainer = DistillTrainer(tiny_config(**{"teacher.load": teacher_checkpoint, "teacher.config": str(path),
                                            "train.train_iters": "1", "checkpoint.save_at_end": "false"}))
    t = trainer.teacher_cfg
    assert (t.pattern, t.hidden_size, t.rotary_base, t.norm_epsilon) == ("*-*-*-", 48, 500.0, 0.01)
    assert trainer.cfg.model.pattern == "*-*-" and trainer.cfg.model.hidden_size == 32
    vocab = trainer.tokenizer.vocab_size
    teacher = GPTModel(t, vocab)
    teacher.load_state_dict(trainer.teacher.state_dict())
    saved = GPTModel(load_config(overrides=TEACHER).model, vocab)   # the checkpoint's own architecture
    saved.load_state_dict(trainer.teacher.state_dict())
    student = GPTModel(trainer.cfg.model, vocab)
    student.load_state_dict(trainer.model.state_dict())
    cfg = trainer.cfg.train
    batch = BatchLoader(trainer.train_ds, micro_batch_size=cfg.micro_batch_size, global_batch_size=cfg.global_batch_size,
                        seed=trainer.cfg.data.seed).next_global_batch()
    tokens = sum(float(mb["loss_mask"].sum()) for mb in batch)
    expected = sum(kl_to_teacher(student, teacher, [mb], vocab) * float(mb["loss_mask"].sum()) for mb in batch) / tokens
    other = sum(kl_to_teacher(student, saved, [mb], vocab) * float(mb["loss_mask"].sum()) for mb in batch) / tokens
    assert abs(other - expected) > 1e-3   # the YAML's architecture changes the numbers
    assert trainer.train()[0].extra["distill_kl"] == pytest.approx(expected, rel=1e-5)


def test_cli_distill_runs_and_logs_every_term(teacher_checkpoint, tmp_path):
    import yaml

    from meshtron.cli import main
    from tests.conftest import TINY

    config: dict = {}
    for key, value in {**TINY, "train.train_iters": "2", "train.run_dir": str(tmp_path / "run"),
                       "checkpoint.save_at_end": "false"}.items():
        section, field = key.split(".")
        config.setdefault(section, {})[field] = yaml.safe_load(value)
    config["teacher"] = {"load": teacher_checkpoint}
    config["distill"] = {"losses": ["kl", "reverse_kl", "topk_kl", "hidden_mse"], "weights": [1.0, 0.5, 0.25, 2.0],
                         "label_weight": 0.1, "top_k": 8, "layer_pairs": ["-1:-1"]}
    path = tmp_path / "distill.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["distill", "--config", str(path)]) == 0
    train = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        weighted = (0.1 * r["lm_loss"] + r["distill_kl"] + 0.5 * r["distill_reverse_kl"]
                    + 0.25 * r["distill_topk_kl"] + 2 * r["distill_hidden_mse"])
        assert r["loss"] == pytest.approx(weighted, rel=1e-6) and all(r[k] > 0 for k in ("distill_kl",
                                                                                         "distill_reverse_kl"))


def test_distillation_resumes_exactly(tiny_config, teacher_checkpoint, tmp_path):
    """The projections and the optimizer state come back from the checkpoint; the teacher from teacher.load."""
    common = {"teacher.load": teacher_checkpoint, "distill.losses": "kl,hidden_mse", "distill.layer_pairs": "0:2",
              "scheduler.decay_steps": "4"}
    straight = DistillTrainer(tiny_config(**common, **{"train.train_iters": "4",
                                                        "checkpoint.save_at_end": "false"})).train()
    DistillTrainer(tiny_config(**common, **{"train.train_iters": "2", "checkpoint.save": str(tmp_path / "ck")})).train()
    resumed = DistillTrainer(tiny_config(**common, **{"train.train_iters": "4", "checkpoint.load": str(tmp_path / "ck"),
                                                       "checkpoint.save_at_end": "false"})).train()
    assert [r.loss for r in resumed] == [r.loss for r in straight][2:]


def test_cli_distill_without_a_teacher_is_one_line(capsys):
    from meshtron.cli import main

    assert main(["distill", "--train.train_iters", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: teacher.load: distillation needs a teacher") and "\n" not in err


def test_teacher_errors_are_one_line(tiny_config, teacher_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="teacher.load: distillation needs a teacher"):
        DistillTrainer(tiny_config())
    wrong = tmp_path / "teacher.yaml"
    wrong.write_text("model:\n  num_layers: 2\n  hidden_size: 64\n")
    with pytest.raises(ConfigError, match="teacher.load: .*does not match"):
        DistillTrainer(tiny_config(**{"teacher.load": teacher_checkpoint, "teacher.config": str(wrong)}))
    with pytest.raises(ConfigError, match="distill.layer_pairs: teacher sublayer 9 is out of range"):
        DistillTrainer(tiny_config(**{"teacher.load": teacher_checkpoint, "distill.losses": "hidden_mse",
                                      "distill.layer_pairs": "0:9"}))


LAYOUT_BASE = {
    "model.num_layers": "2", "model.hidden_size": "32", "model.num_attention_heads": "4",
    "model.num_query_groups": "2", "model.ffn_hidden_size": "64", "model.max_position_embeddings": "64",
    "data.seq_length": "32", "train.micro_batch_size": "2", "train.global_batch_size": "8",
    "train.train_iters": "3", "train.eval_interval": "0", "train.peak_flops": "1e11",
    "logger.progress_bar": "off", "scheduler.warmup_steps": "1", "checkpoint.save_at_end": "false",
    "distill.losses": "kl,topk_kl,hidden_cosine", "distill.layer_pairs": "1:2,-1:-1", "distill.label_weight": "0.5",
}


def distill_and_report(rank: int, world_size: int, overrides: dict[str, str]) -> dict:
    from meshtron.testing.parity import full_parameters

    trainer = DistillTrainer(load_config(overrides=overrides, world_size=world_size))
    history = trainer.train()
    return {"losses": [r.loss for r in history], "extra": [r.extra for r in history],
            "params": full_parameters(trainer.model), "teacher_pattern": trainer.teacher_cfg.pattern}


# name -> (world size, overrides); student and teacher are both parallelized by the layout
LAYOUTS = {
    "fsdp2": (2, {"parallel.dp_shard": "2"}),
    "tp2_sp": (2, {"parallel.tp": "2"}),
    "tp2": (2, {"parallel.tp": "2", "parallel.sequence_parallel": "false", "parallel.loss_parallel": "false"}),
    "cp2": (2, {"parallel.cp": "2"}),
    "ddp2": (2, {"parallel.dp_replicate": "2"}),
    "fsdp2_tp2": (4, {"parallel.dp_shard": "2", "parallel.tp": "2"}),
    "hsdp_2x2": (4, {"parallel.dp_replicate": "2", "parallel.dp_shard": "2"}),
    "cp2_tp2": (4, {"parallel.cp": "2", "parallel.tp": "2"}),
}


@pytest.mark.parametrize("layout", [pytest.param(k, marks=() if k == "fsdp2" else pytest.mark.slow) for k in LAYOUTS])
def test_distillation_layout_matches_single_process(layout, teacher_checkpoint, tmp_path):
    """kl, topk_kl and hidden_cosine over two projected pairs: every rank's losses and logged terms, and
    the student's and projections' parameters after 3 steps, equal the single process's (1e-5)."""
    world, extra = LAYOUTS[layout]
    overrides = {**LAYOUT_BASE, "teacher.load": teacher_checkpoint}
    ref = distill_and_report(0, 1, {**overrides, "train.run_dir": str(tmp_path / "ref")})
    results = run_ranks("tests.distill.test_distill:distill_and_report", world, timeout_s=400,
                        overrides={**overrides, **extra, "train.run_dir": str(tmp_path / "run"),
                                   "parallel.timeout_s": "90"})
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], abs=1e-5, rel=0)
        for step, ref_extra in zip(r["extra"], ref["extra"]):
            assert step == pytest.approx(ref_extra, abs=1e-5, rel=0)
        assert set(r["params"]) == set(ref["params"])
        for name, value in r["params"].items():
            torch.testing.assert_close(value, ref["params"][name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{"parallel.pp": "2"},
                                   {"parallel.pp": "2", "parallel.pp_schedule": "interleaved_1f1b",
                                    "parallel.pp_virtual_stages": "2", "distill.losses": "kl,reverse_kl"},
                                   {"parallel.pp": "2", "parallel.tp": "2"}],
                         ids=["pp2_1f1b", "pp2_interleaved", "tp2_pp2"])
def test_pipelined_distillation_matches_single_process(extra, teacher_checkpoint, tmp_path):
    """Teacher (6 sublayers) and student (4) each split into the same number of stages; the logits
    losses in the last stage give the single process's losses, logged terms and parameters."""
    overrides = {**LAYOUT_BASE, "teacher.load": teacher_checkpoint, "distill.losses": "kl,topk_kl",
                 "distill.layer_pairs": "", "distill.top_k": "8", "train.eval_interval": "3", "train.eval_iters": "1"}
    overrides.update({k: v for k, v in extra.items() if k.startswith("distill.")})
    ref = distill_and_report(0, 1, {**overrides, "train.run_dir": str(tmp_path / "ref")})
    world = 4 if "parallel.tp" in extra else 2
    results = run_ranks("tests.distill.test_distill:distill_and_report", world, timeout_s=400,
                        overrides={**overrides, **extra, "train.run_dir": str(tmp_path / "run"),
                                   "parallel.timeout_s": "90"})
    assert {"lm_loss", "distill_kl"} <= set(ref["extra"][0])
    assert_ranks_match(results, ref)


# A MoE student (8 experts, top-2, aux loss) under expert parallelism. SGD with momentum: Adam turns the
# ~1e-8 layout noise of near-zero expert gradients into parameter differences of order lr (PLATFORM.md)
MOE_STUDENT = {"model.num_moe_experts": "8", "model.moe_ffn_hidden_size": "32", "model.moe_router_topk": "2",
               "model.moe_aux_loss_coeff": "0.01", "optimizer.type": "sgd", "optimizer.sgd_momentum": "0.9",
               "optimizer.lr": "0.05"}


@pytest.mark.parametrize("extra", [pytest.param({"parallel.ep": "2"}, marks=pytest.mark.slow),
                                   pytest.param({"parallel.ep": "2", "parallel.tp": "2"}, marks=pytest.mark.slow),
                                   pytest.param({"parallel.ep": "2", "parallel.pp": "2"}, marks=pytest.mark.slow),
                                   pytest.param({"parallel.ep": "2", "parallel.tp": "2",
                                                 "parallel.expert_tensor_parallel": "true"}, marks=pytest.mark.slow),
                                   pytest.param({"parallel.ep": "2", "parallel.dp_replicate": "2",
                                                 "parallel.dp_shard": "2"}, marks=pytest.mark.slow)],
                         ids=["ep2_fsdp2", "ep2_tp2", "ep2_pp2", "ep2_tp2_etp", "ep2_hsdp"])
def test_moe_student_under_expert_parallelism_matches_single_process(extra, teacher_checkpoint, tmp_path):
    """EP2 (the experts split over the 2 dp_shard ranks, FSDP on the rest; on 4 ranks also TP+SP, expert
    tensor parallelism, PP or HSDP):
    a MoE student distilled from the dense teacher with kl, topk_kl and hidden_cosine (pair 1:2 projects the
    output of a MoE sublayer) gives the single process's losses, logged terms (moe_aux_loss included) and
    parameters (experts gathered from their ep ranks)."""
    overrides = {**LAYOUT_BASE, **MOE_STUDENT, "teacher.load": teacher_checkpoint}
    ref = distill_and_report(0, 1, {**overrides, "train.run_dir": str(tmp_path / "ref")})
    world = 4 if {"parallel.tp", "parallel.pp", "parallel.dp_replicate"} & set(extra) else 2
    results = run_ranks("tests.distill.test_distill:distill_and_report", world, timeout_s=400,
                        overrides={**overrides, **extra, "train.run_dir": str(tmp_path / "run"),
                                   "parallel.timeout_s": "90"})
    assert {"distill_kl", "distill_hidden_cosine_pair0", "moe_aux_loss"} <= set(ref["extra"][0])
    if "parallel.pp" in extra:   # the trainer's rule: each stage logs the MoE statistics of its own layers
        for r in [ref, *results]:
            r["extra"] = [{k: v for k, v in step.items() if not k.startswith("moe_")} for step in r["extra"]]
    merged = assert_ranks_match(results, ref)
    assert any(".experts." in name for name in merged)


@pytest.mark.slow
def test_moe_teacher_under_expert_parallelism_matches_single_process(tmp_path):
    """EP2 x FSDP2 with a MoE teacher (pattern '*E*E*E', 4 experts, split over ep like the student's 8):
    the teacher's expert-parallel forward gives the single process's losses, logged terms and parameters."""
    teacher = load_config(overrides={**TEACHER, "model.num_moe_experts": "4", "model.moe_ffn_hidden_size": "32",
                                     "train.train_iters": "2", "train.run_dir": str(tmp_path / "teacher"),
                                     "checkpoint.save": str(tmp_path / "teacher" / "checkpoints")})
    Trainer(teacher).train()
    overrides = {**LAYOUT_BASE, **MOE_STUDENT, "teacher.load": str(tmp_path / "teacher" / "checkpoints")}
    ref = distill_and_report(0, 1, {**overrides, "train.run_dir": str(tmp_path / "ref")})
    results = run_ranks("tests.distill.test_distill:distill_and_report", 2, timeout_s=400,
                        overrides={**overrides, "parallel.ep": "2", "train.run_dir": str(tmp_path / "run"),
                                   "parallel.timeout_s": "90"})
    assert all(r["teacher_pattern"] == "*E*E*E" for r in [ref, *results])
    assert_ranks_match(results, ref)


def assert_ranks_match(results: list[dict], ref: dict) -> dict:
    """Every rank's losses and logged terms equal the single process's, and the parameters the ranks
    hold together are the single process's (within 1e-5); returns the merged parameters."""
    merged: dict = {}
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], abs=1e-5, rel=0)
        for step, ref_extra in zip(r["extra"], ref["extra"]):
            assert set(step) == set(ref_extra) and step == pytest.approx(ref_extra, abs=1e-5, rel=0)
        merged.update(r["params"])
    assert set(merged) == set(ref["params"])
    for name, value in merged.items():
        torch.testing.assert_close(value, ref["params"][name], atol=1e-5, rtol=0, msg=name)
    return merged


def test_teacher_stage_ranges():
    from meshtron.distill.pipeline import teacher_stage_ranges

    assert teacher_stage_ranges(6, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    assert teacher_stage_ranges(6, 2) == [range(0, 3), range(3, 6)]
    with pytest.raises(ConfigError, match="teacher: its 3 sublayers do not fill the 4 pipeline stages"):
        teacher_stage_ranges(3, 4)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{"parallel.pp": "2"},
                                   {"parallel.pp": "2", "parallel.pp_schedule": "interleaved_1f1b",
                                    "parallel.pp_virtual_stages": "2", "distill.layer_pairs": "1:4,2:2"},
                                   {"parallel.pp": "2", "parallel.pp_schedule": "zero_bubble",
                                    "parallel.pp_virtual_stages": "2", "model.tie_word_embeddings": "false"},
                                   {"parallel.pp": "2", "parallel.dp_shard": "2"},
                                   {"parallel.pp": "2", "parallel.cp": "2"}],
                         ids=["pp2_1f1b", "pp2_interleaved", "pp2_zero_bubble", "pp2_fsdp2", "cp2_pp2"])
def test_pipelined_hidden_state_losses_match_single_process(extra, teacher_checkpoint, tmp_path):
    """PP2: student sublayers 0-1 | 2-3, teacher 0-2 | 3-5. Pair 1:4 has its student sublayer on stage 0
    and its teacher sublayer on stage 1, pair -1:2 the other way round, so each teacher hidden state
    crosses the pipeline (interleaved, stages 0,2 | 1,3: pairs 1:4 and 2:2 both cross ranks; ZB-V,
    stages 0,3 | 1,2: 1:4 stays on rank 1, -1:2 crosses); the losses (hidden terms on their stages, kl on
    the last), logged terms, student parameters and both width projections equal the single process's."""
    overrides = {**LAYOUT_BASE, "teacher.load": teacher_checkpoint, "distill.losses": "kl,hidden_mse,hidden_cosine",
                 "distill.layer_pairs": "1:4,-1:2", "train.eval_interval": "3", "train.eval_iters": "1"}
    overrides.update({k: v for k, v in extra.items() if not k.startswith("parallel.")})
    ref = distill_and_report(0, 1, {**overrides, "train.run_dir": str(tmp_path / "ref")})
    world = 4 if {"parallel.dp_shard", "parallel.cp"} & set(extra) else 2
    results = run_ranks("tests.distill.test_distill:distill_and_report", world, timeout_s=400,
                        overrides={**overrides, **extra, "train.run_dir": str(tmp_path / "run"),
                                   "parallel.timeout_s": "90"})
    assert {"distill_hidden_mse_pair0", "distill_hidden_cosine_pair1", "distill_kl"} <= set(ref["extra"][0])
    merged = assert_ranks_match(results, ref)
    assert {"distill_projections.maps.0.weight", "distill_projections.maps.1.weight"} <= set(merged)


def test_pipelined_pairs_on_two_stages_of_one_rank_are_refused(tmp_path):
    from meshtron.distill.pipeline import check_pair_stages
    from tests.conftest import TINY

    cfg = load_config(overrides={**TINY, "train.run_dir": str(tmp_path), "parallel.pp": "2",
                                 "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual_stages": "2"},
                      world_size=2)
    check_pair_stages(cfg, [(1, 4), (2, 2)])   # stages 1 and 2: ranks 1 and 0
    with pytest.raises(ConfigError, match="distill.layer_pairs: student sublayers 1 and 3 lie in pipeline stages 1 "
                                          "and 3, both on pp rank 1"):
        check_pair_stages(cfg, [(1, 4), (3, 2)])
