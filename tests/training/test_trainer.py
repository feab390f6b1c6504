"""Trainer: bitwise-exact resume, gradient accumulation equals one big batch, non-finite steps
skipped and counted, and the run stopped after N in a row."""

from __future__ import annotations

import json

import pytest
import torch

from meshtron.training import Trainer, TrainingError


def losses(history):
    return [r.loss for r in history]


def test_exact_resume_is_bitwise(tiny_config, tmp_path):
    # dropout on, so the RNG state must be restored too; 2 micro-batches per step
    common = {"model.hidden_dropout": "0.1", "model.attention_dropout": "0.1", "train.train_iters": "6",
              "scheduler.decay_steps": "6"}
    straight = Trainer(tiny_config(**{**common, "checkpoint.save_at_end": "false"})).train()

    first = tiny_config(**{**common, "train.train_iters": "3", "checkpoint.save": str(tmp_path / "ck")})
    Trainer(first).train()
    resumed_cfg = tiny_config(**{**common, "checkpoint.load": str(tmp_path / "ck"),
                                           "checkpoint.save": str(tmp_path / "ck2")})
    trainer = Trainer(resumed_cfg)
    assert trainer.step == 3 and trainer.loader.consumed_samples == 12
    resumed = trainer.train()
    assert [r.step for r in resumed] == [4, 5, 6]
    assert losses(resumed) == losses(straight)[3:]  # bitwise: Python floats compared exactly
    assert [r.grad_norm for r in resumed] == [r.grad_norm for r in straight][3:]


def test_resume_also_with_async_save(tiny_config, tmp_path):
    common = {"train.train_iters": "4", "scheduler.decay_steps": "4"}
    straight = Trainer(tiny_config(**{**common, "checkpoint.save_at_end": "false"})).train()
    Trainer(tiny_config(**{**common, "train.train_iters": "2", "checkpoint.async_save": "true",
                                     "checkpoint.save": str(tmp_path / "ck")})).train()
    resumed = Trainer(tiny_config(**{**common, "checkpoint.load": str(tmp_path / "ck")})).train()
    assert losses(resumed) == losses(straight)[2:]


def test_accumulation_equals_one_big_batch(tiny_config):
    # SGD, so parameters after a step compare tightly (Adam amplifies ~1e-8 noise on tiny grads)
    opts = {"optimizer.type": "sgd", "train.train_iters": "1", "checkpoint.save_at_end": "false",
            "optimizer.clip_grad": "0"}
    acc = Trainer(tiny_config(**{**opts, "train.micro_batch_size": "1", "train.global_batch_size": "4"}))
    big = Trainer(tiny_config(**{**opts, "train.micro_batch_size": "4", "train.global_batch_size": "4"}))
    ra, rb = acc.train()[0], big.train()[0]
    assert abs(ra.loss - rb.loss) < 1e-6 and abs(ra.grad_norm - rb.grad_norm) < 1e-6
    for pa, pb in zip(acc.model.parameters(), big.model.parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-7, rtol=0)


def test_loss_falls_and_metrics_file_written(tiny_config):
    cfg = tiny_config(**{"train.train_iters": "30", "optimizer.lr": "3e-3", "train.eval_interval": "10",
                         "checkpoint.save_at_end": "false"})
    history = Trainer(cfg).train()
    assert sum(losses(history)[-5:]) / 5 < losses(history)[0] - 1.0  # from ~ln(384)=5.95
    records = [json.loads(line) for line in open(f"{cfg.train.run_dir}/metrics.jsonl")]
    train = [r for r in records if r["kind"] == "train"]
    valid = [r for r in records if r["kind"] == "valid"]
    assert [r["step"] for r in train] == list(range(1, 31))
    assert [r["step"] for r in valid] == [10, 20, 30]
    assert all(abs(v["ppl"] - 2.718281828459045 ** v["loss"]) < 1e-6 * v["ppl"] for v in valid)
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_ms"} <= set(train[0])
    assert train[0]["loss"] == history[0].loss


def test_nonfinite_step_skipped_and_counted(tiny_config):
    cfg = tiny_config(**{"train.train_iters": "5", "train.debug_nonfinite_steps": "[2, 4]",
                         "checkpoint.save_at_end": "false"})
    trainer = Trainer(cfg)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    snapshots = {}
    orig_step = trainer.train_step

    def spy(batch):
        result = orig_step(batch)
        snapshots[result.step] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        return result

    trainer.train_step = spy
    history = trainer.train()
    assert [r.skipped for r in history] == [False, True, False, True, False]
    assert trainer.num_skipped == 2
    # a skipped step leaves every parameter exactly as it was
    for name in before:
        assert torch.equal(snapshots[2][name], snapshots[1][name])
        assert not torch.equal(snapshots[1][name], before[name]) or "norm" in name
    skipped = [json.loads(x) for x in open(f"{cfg.train.run_dir}/metrics.jsonl") if '"skipped"' in x]
    assert [r["step"] for r in skipped if r["kind"] == "skipped"] == [2, 4]


def test_stops_after_n_nonfinite_in_a_row(tiny_config):
    cfg = tiny_config(**{"train.train_iters": "10", "train.debug_nonfinite_steps": "[3, 4, 5]",
                         "train.max_nonfinite_steps": "3", "checkpoint.save_at_end": "false"})
    trainer = Trainer(cfg)
    with pytest.raises(TrainingError, match="stopped at step 5: 3 consecutive steps had a non-finite"):
        trainer.train()
    assert trainer.step == 5
    # two in a row, then a good step, resets the count
    ok = Trainer(tiny_config(**{"train.train_iters": "6", "train.debug_nonfinite_steps": "[2, 3, 5, 6]",
                                "train.max_nonfinite_steps": "3", "checkpoint.save_at_end": "false"}))
    assert sum(r.skipped for r in ok.train()) == 4


def test_cli_stops_with_one_line_and_exit_1(tiny_config, capsys):
    from meshtron.cli import main

    cfg = tiny_config()
    code = main(["train", "--model.num_layers", "1", "--model.hidden_size", "16", "--data.seq_length", "16",
                 "--train.train_iters", "3", "--train.micro_batch_size", "1", "--train.global_batch_size", "1",
                 "--train.debug_nonfinite_steps", "[1,2]", "--train.max_nonfinite_steps", "2",
                 "--train.peak_flops", "1e11", "--train.run_dir", cfg.train.run_dir, "--logger.progress_bar", "off"])
    assert code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2 consecutive steps had a non-finite" in err
