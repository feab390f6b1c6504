"""MoE router replay in RL: the engine records, per request and position, the experts it chose; the
trainer's packed forward replays them. After the selection-only expert bias changes (so the trainer,
routing on its own, picks other experts for many tokens), the replayed trainer log probs still equal
the engine's within 1e-5, while without replay they do not."""

from __future__ import annotations

import torch

from meshtron.inference.config import EngineConfig
from meshtron.inference.request import SamplingParams
from meshtron.nn.context import PackedContext
from meshtron.nn.moe.replay import ReplayMode, recorded_routing, replays, set_replay_mode
from meshtron.rl.grpo import forward_log_probs
from meshtron.rl.inference import EngineBackend
from meshtron.rl.packing import TrainSequence, micro_batches, pack_sequences
from tests.inference.helpers import tiny_model
from tests.rl.helpers import TOKENIZER

PAD = TOKENIZER.pad_id


def trainer_log_probs(model, gens, replay: bool):
    seqs = [TrainSequence(g.prompt_token_ids + g.token_ids, len(g.prompt_token_ids), 1.0 + i,
                          routing=g.routing if replay else None) for i, g in enumerate(gens)]
    rows = pack_sequences(seqs, 64, PAD)
    assert len(rows) < len(gens)  # several sequences share a row
    out = {}
    with torch.no_grad():
        for mb in micro_batches(rows, 2):
            logp = forward_log_probs(model, mb, 1.0)[0]
            for r in range(logp.shape[0]):
                w = mb["weights"][r]
                for weight in sorted(set(w[w > 0].tolist())):
                    out[int(round(weight - 1.0))] = logp[r][w == weight]
    return [out[i] for i in range(len(gens))]


def own_routing(model, gen) -> dict[str, torch.Tensor]:
    """The experts the trainer picks by itself for a sequence's input positions."""
    ids = torch.tensor([gen.prompt_token_ids + gen.token_ids[:-1]])
    set_replay_mode(model, ReplayMode.RECORD)
    try:
        with torch.no_grad():
            model(ids, PackedContext.for_tokens(ids, torch.zeros_like(ids), torch.arange(ids.shape[1])[None]))
        return {k: v[0] for k, v in recorded_routing(model).items()}
    finally:
        set_replay_mode(model, None)
        for r in replays(model).values():
            r.recorded = []


def test_replayed_training_routes_as_the_engine():
    model = tiny_model("moe", seed=3)
    backend = EngineBackend(model, TOKENIZER, EngineConfig(block_size=4, num_blocks=256, max_num_batched_tokens=16),
                            record_routing=True)
    prompts = [list(range(10 + i, 10 + i + n)) for i, n in enumerate([3, 7, 12, 5, 9, 1])]
    params = [SamplingParams(max_tokens=6 + i, temperature=1.0, seed=i, ignore_eos=True) for i in range(6)]
    gens = backend.generate(prompts, params)  # a 16-token budget: prompts are prefilled in chunks
    names = list(replays(model))
    assert len(names) >= 1
    for g in gens:
        n = len(g.prompt_token_ids) + len(g.token_ids) - 1
        assert set(g.routing) == set(names) and all(t.shape == (n, 2) for t in g.routing.values())
    # with unchanged weights the trainer picks the engine's experts by itself
    for g in gens:
        assert all((own_routing(model, g)[k].numpy() == g.routing[k]).all() for k in names)
    engine = [torch.tensor(g.log_probs) for g in gens]
    assert max(float((a - b).abs().max()) for a, b in zip(engine, trainer_log_probs(model, gens, True))) <= 1e-5

    # the selection-only bias moves: routing on its own the trainer now disagrees with the engine
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "expert_bias", None) is not None:
                module.expert_bias.copy_(torch.randn_like(module.expert_bias) * 0.5)
    differing = sum(int((own_routing(model, g)[k].sort(-1).values.numpy() != torch.from_numpy(g.routing[k])
                                                                               .sort(-1).values.numpy()).any(-1).sum())
                    for g in gens for k in names)
    assert differing > 10, differing
    replayed = trainer_log_probs(model, gens, True)
    assert max(float((a - b).abs().max()) for a, b in zip(engine, replayed)) <= 1e-5
    free = trainer_log_probs(model, gens, False)
    assert max(float((a - b).abs().max()) for a, b in zip(engine, free)) > 1e-3


def test_grpo_step_on_a_moe_model_replays_the_engine_routing(tmp_path):
    """The loop wires it: rl.router_replay records in the engine and the first (on-policy) update's
    trainer log probs equal the rollout's (logprob_gap ~ 0), also after the bias moved."""
    import tests.rl.helpers  # noqa: F401  (the 'digits' environment)
    from meshtron.rl.trainer import GRPOTrainer
    from tests.rl.test_grpo import rl_config

    moe = {"model.num_moe_experts": 4, "model.moe_router_topk": 2, "model.moe_router_enable_expert_bias": "true",
           "model.moe_router_score_function": "sigmoid", "model.init_method_std": 0.2, "train.train_iters": 2}
    trainer = GRPOTrainer(rl_config(tmp_path, **moe))
    assert trainer.backend.recorder is not None
    history = trainer.train()
    assert all(h["logprob_gap"] < 1e-5 for h in history), [h["logprob_gap"] for h in history]
    off = GRPOTrainer(rl_config(tmp_path / "off", **moe, **{"rl.router_replay": "false"}))
    assert off.backend.recorder is None
