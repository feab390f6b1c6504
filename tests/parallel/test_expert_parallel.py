"""Expert parallelism. A MoE sublayer whose experts are split over 2 or 4 ranks (all-to-all and
all-gather dispatchers) gives every rank the outputs, input gradients and parameter gradients that one
process computes for the same tokens with every expert local; dropless runs route every choice,
capacity-limited runs drop the same choices. Whole training runs under EP (alone and with FSDP, TP,
PP) match the single-process run over 3 optimizer steps, and checkpoints reshard across EP sizes.
A forward + backward reads the device once on the host (the dispatcher's split sizes or token counts)."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

# imported here, not in the rank functions: the launcher imports this module once before forking
from meshtron.config.loader import load_config
from meshtron.config.schema import ModelConfig
from meshtron.nn.moe import MoELayer
from meshtron.nn.moe.routing_map import build_routing_map
from meshtron.parallel.plan import estimate_memory
from meshtron.testing.multiprocess import rank_backend, rank_device, rank_device_type, run_ranks
from meshtron.training import Trainer
from tests.nn.test_moe_syncs import count_host_reads

from .test_layouts import BASE as BASE_LAYOUT
from .test_layouts import check_against_reference

HIDDEN, EXPERTS = 16, 8
# name -> ModelConfig overrides of the sublayer
LAYERS = {
    "dropless": dict(),
    "capacity_probs": dict(moe_expert_capacity_factor=0.6),
    "capacity_position": dict(moe_expert_capacity_factor=0.6, moe_token_drop_policy="position"),
    "padding_shared_bias": dict(moe_router_padding_for_quantization=True, moe_router_padding_alignment=4,
                                moe_shared_expert_intermediate_size=8, add_bias_linear=True, moe_router_topk=3),
    "looped": dict(moe_grouped_gemm=False),
}


def layer_cfg(**kw) -> ModelConfig:
    cfg = ModelConfig(**{**dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=32,
                                vocab_size=64, num_moe_experts=EXPERTS, moe_router_topk=2, moe_aux_loss_coeff=0.01), **kw})
    cfg.validate()
    return cfg


def rank_tokens(rank: int, uneven: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(input (batch, seq, hidden), output weights) of one rank: different on every rank."""
    gen = torch.Generator().manual_seed(100 + rank)
    seq = 5 + 3 * rank if uneven else 6
    return torch.randn(2, seq, HIDDEN, generator=gen), torch.randn(2, seq, HIDDEN, generator=gen)


def layer_parity_cases(rank: int, world: int, cases: list[tuple[str, str, bool]]) -> list[dict]:
    """`layer_parity` for each (variant, dispatcher, uneven) in one process group."""
    from meshtron.parallel.dims import backend_options

    dist.init_process_group(rank_backend(), timeout=timedelta(seconds=60))
    mesh = torch.distributed.device_mesh.init_device_mesh(
        rank_device_type(), (world,), mesh_dim_names=("ep",), backend_override={"ep": backend_options(rank_device_type(), 60)})
    return [layer_parity(rank, world, mesh, *case) for case in cases]


def layer_parity(rank: int, world: int, mesh, variant: str, dispatcher: str, uneven: bool) -> dict:
    """Max |EP - one process| of this rank's outputs and gradients, and the routed-row counts."""
    from meshtron.parallel.expert_parallel import apply_ep

    cfg = layer_cfg(**LAYERS[variant])
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.5)
        for p in layer.experts.parameters():
            p.normal_(0.0, 0.2)
    reference = copy.deepcopy(layer)

    # one process: every rank's tokens through the local layer, rank by rank (capacity is per forward)
    ref_out, ref_grad, ref_rows, ref_dropped = [], [], 0, 0
    for r in range(world):
        x, w = rank_tokens(r, uneven)
        x.requires_grad_(True)
        y = reference(x)
        (y * w).sum().backward()
        ref_out.append(y.detach())
        ref_grad.append(x.grad)
        probs, indices, _ = reference.router(x.detach())
        routing = build_routing_map(probs, indices, EXPERTS, reference.capacity_factor, reference.drop_policy,
                                    reference.pad_alignment)
        ref_rows += int(routing.routing_map.sum())
        ref_dropped += int(routing.num_dropped)

    device = rank_device()
    layer.to(device)
    apply_ep(layer, mesh["ep"], dispatcher)
    seen = []
    dispatch = layer.dispatcher.dispatch

    def counting(*args, **kwargs):
        rows, tokens_per_expert, handle = dispatch(*args, **kwargs)
        seen.append(tokens_per_expert.sum())
        return rows, tokens_per_expert, handle

    layer.dispatcher.dispatch = counting
    x, w = (t.to(device) for t in rank_tokens(rank, uneven))
    x.requires_grad_(True)
    with count_host_reads() as reads:
        y = layer(x)
        (y * w).sum().backward()

    errors = {"output": (y.cpu() - ref_out[rank]).abs().max().item(),
              "input_grad": (x.grad.cpu() - ref_grad[rank]).abs().max().item()}
    local = EXPERTS // world
    mine = slice(rank * local, (rank + 1) * local)
    for name, p in layer.experts.named_parameters():
        ref_p = dict(reference.experts.named_parameters())[name]
        assert tuple(p.to_local().shape) == (local, *ref_p.shape[1:])
        errors[f"experts.{name}"] = (p.grad.to_local().cpu() - ref_p.grad[mine]).abs().max().item()
    for name, p in layer.named_parameters():
        if not name.startswith("experts."):
            grad = p.grad.clone()
            dist.all_reduce(grad)  # replicated parameters: each rank holds its own tokens' share
            errors[name] = (grad.cpu() - dict(reference.named_parameters())[name].grad).abs().max().item()
    rows = seen[0].clone()
    dist.all_reduce(rows)
    return {"errors": errors, "rows": int(rows), "ref_rows": ref_rows, "ref_dropped": ref_dropped, "reads": reads,
            "choices": sum(2 * rank_tokens(r, uneven)[0].shape[1] * cfg.moe_router_topk for r in range(world))}


# world -> cases (variant, dispatcher, uneven tokens per rank); each world is one process group
LAYER_CASES = {
    2: [("dropless", "alltoall", False), ("dropless", "allgather", False), ("padding_shared_bias", "alltoall", False)],
    4: [("capacity_probs", "alltoall", True), ("capacity_position", "allgather", True),
        ("padding_shared_bias", "allgather", True), ("looped", "alltoall", True), ("dropless", "alltoall", True)],
}


@pytest.mark.parametrize("world", sorted(LAYER_CASES))
def test_moe_layer_under_ep_matches_one_process(world):
    cases = LAYER_CASES[world]
    results = run_ranks("tests.parallel.test_expert_parallel:layer_parity_cases", world, timeout_s=180, cases=cases)
    for i, (variant, dispatcher, uneven) in enumerate(cases):
        case = f"{variant}/{dispatcher}/ep{world}{'/uneven' if uneven else ''}"
        for rank_results in results:
            for name, err in rank_results[i]["errors"].items():
                assert err <= 1e-5, (case, name, err)
        r = results[0][i]
        # host reads per forward + backward: the dispatcher's one (split sizes / largest token count),
        # and the looped experts' counts
        assert len(r["reads"]) == 1 + (variant == "looped"), (case, r["reads"])
        # the experts of all ranks together processed exactly the rows of the reference routing maps
        assert r["rows"] == r["ref_rows"], case
        if variant == "dropless":
            assert r["ref_dropped"] == 0 and r["rows"] == r["choices"], case
        elif variant.startswith("capacity"):
            assert r["ref_dropped"] > 0 and r["rows"] == r["choices"] - r["ref_dropped"], case


# ---- whole training runs: EP layouts against one process --------------------------------------------

# SGD with momentum: Adam turns the ~1e-8 layout noise of near-zero expert gradients into parameter
# differences of order lr (measured 7e-4 under EP2 x FSDP2 with Adam; < 1e-6 with SGD), see PLATFORM.md
MOE = {**BASE_LAYOUT, "model.num_moe_experts": "8", "model.moe_ffn_hidden_size": "32", "model.moe_router_topk": "2",
       "train.global_batch_size": "16", "model.moe_aux_loss_coeff": "0.01",
       "optimizer.type": "sgd", "optimizer.sgd_momentum": "0.9", "optimizer.lr": "0.05"}
CAPACITY = {"model.moe_expert_capacity_factor": "0.5"}
ADAM = {"optimizer.type": "adam", "optimizer.lr": "1e-3"}

# name -> (world, overrides); dp_shard fills in the rest of the world size
EP_LAYOUTS = {
    "ep2": (2, {"parallel.ep": "2", **ADAM}),  # Adam steps over expert DTensors on their own mesh
    "ep2_fsdp2_capacity": (4, {"parallel.ep": "2", **CAPACITY}),
    "ep4": (4, {"parallel.ep": "4"}),
    "ep2_allgather": (2, {"parallel.ep": "2", "parallel.ep_dispatcher": "allgather", **CAPACITY}),
    "ep2_fsdp2": (4, {"parallel.ep": "2"}),
    "ep2_tp2_shared": (4, {"parallel.ep": "2", "parallel.tp": "2", "model.moe_shared_expert_intermediate_size": "32",
                           "model.moe_shared_expert_gate": "true"}),
    "ep2_tp2_no_sp": (4, {"parallel.ep": "2", "parallel.tp": "2", "parallel.sequence_parallel": "false",
                          "parallel.loss_parallel": "false"}),
    "ep2_tp2_etp": (4, {"parallel.ep": "2", "parallel.tp": "2", "parallel.expert_tensor_parallel": "true",
                        **CAPACITY}),
    "tp2_etp_fsdp2": (4, {"parallel.tp": "2", "parallel.expert_tensor_parallel": "true",
                          "model.moe_shared_expert_intermediate_size": "32"}),
    "ep2_pp2": (4, {"parallel.ep": "2", "parallel.pp": "2"}),
    # 3 experts per ep rank over 2 data ranks: FSDP splits the expert slices along dim 1
    "ep2_fsdp2_dim1": (4, {"parallel.ep": "2", "model.num_moe_experts": "6"}),
    "ep2_hsdp": (4, {"parallel.ep": "2", "parallel.dp_replicate": "2", "parallel.dp_shard": "2"}),
    "ep4_fsdp2": (8, {"parallel.ep": "4"}),
    "ep4_tp2": (8, {"parallel.ep": "4", "parallel.tp": "2"}),
    "ep4_pp2": (8, {"parallel.ep": "4", "parallel.pp": "2"}),
}
EP_DEFAULT = {"ep2", "ep2_fsdp2_capacity"}


def train_recording(rank: int, world: int, overrides: dict[str, str]) -> dict:
    """Train, and report (besides losses and parameters) every MoE forward's routing map after
    capacity dropping, keyed by (step, global micro-batch index, layer), and the logged MoE metrics."""
    from meshtron.config.loader import load_config
    from meshtron.nn.moe.balance import moe_layers
    from meshtron.parallel.plan import local_tensor
    from meshtron.testing.parity import full_parameters
    from meshtron.training import Trainer

    trainer = Trainer(load_config(overrides=overrides, world_size=world))
    dp_rank = trainer.mesh["dp"].get_local_rank() if trainer.mesh is not None else 0
    per_rank = trainer.loader.num_micro_batches
    maps: dict[tuple[int, int, str], torch.Tensor] = {}
    for name, layer in moe_layers(trainer.model_parts):
        counter = [0]

        def recording(tokens, probs, routing_map, dispatch=layer.dispatcher.dispatch, name=name, counter=counter):
            if torch.is_grad_enabled():
                step, j = divmod(counter[0], per_rank)
                maps[(step, dp_rank * per_rank + j, name)] = routing_map.detach().to("cpu", copy=True)
                counter[0] += 1
            return dispatch(tokens, probs, routing_map)

        layer.dispatcher.dispatch = recording
    history = trainer.train()
    mesh = trainer.mesh
    # the rank that holds the largest shards (FSDP pads dim 0; DTensor gives rank 0 the larger chunk)
    first = mesh is None or all(c == 0 for name, c in zip(mesh.root.mesh_dim_names, mesh.root.get_coordinate())
                                if name != "pp")
    return {"losses": [r.loss for r in history], "params": full_parameters(trainer.model), "maps": maps,
            "moe": [{k: v for k, v in r.extra.items() if k.startswith("moe_")} for r in history],
            "pp_rank": mesh["pp"].get_local_rank() if mesh is not None else 0, "holds_largest": first,
            "local_numel": sum(local_tensor(p).numel() for p in trainer.model.parameters())}


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    """Single-process results by MoE model options, computed on first use."""
    cache = {}

    def get(model_extra: dict[str, str]) -> dict:
        key = tuple(sorted(model_extra.items()))
        if key not in cache:
            overrides = {**MOE, **model_extra, "train.run_dir": str(tmp_path_factory.mktemp("ref"))}
            cache[key] = train_recording(0, 1, overrides)
        return cache[key]

    return get


@pytest.mark.parametrize("layout", [pytest.param(k, marks=() if k in EP_DEFAULT else pytest.mark.slow)
                                    for k in EP_LAYOUTS])
def test_ep_training_matches_single_process(layout, moe_reference, tmp_path):
    world, extra = EP_LAYOUTS[layout]
    overrides = {**MOE, **extra, "train.run_dir": str(tmp_path / "run"), "parallel.timeout_s": "60"}
    results = run_ranks("tests.parallel.test_expert_parallel:train_recording", world, timeout_s=300,
                        overrides=overrides)
    ref = moe_reference({k: v for k, v in extra.items() if k.startswith(("model.", "optimizer."))})
    check_against_reference(results, (ref["losses"], ref["params"]))
    # `meshtron plan` counts the parameters each rank really holds
    plans = estimate_memory(load_config(overrides=overrides, world_size=world), world)
    largest = [r for r in results if r["holds_largest"]]
    assert len(largest) == len(plans)
    for r in largest:
        assert r["local_numel"] == plans[r["pp_rank"]]["num_params"]
    if "parallel.pp" not in extra:  # under a pipeline each stage logs the MoE metrics of its own layers
        for r in results:
            for got, want in zip(r["moe"], ref["moe"]):
                assert got.keys() == want.keys()
                for key in ("moe_dropped_frac", "moe_aux_loss"):
                    assert got.get(key) == pytest.approx(want.get(key), abs=1e-6), key
    dropped = [m["moe_dropped_frac"] for m in ref["moe"]]
    if "model.moe_expert_capacity_factor" in extra:
        assert min(dropped) > 0.05  # the capacity really limits
    else:
        assert max(dropped) == 0.0  # dropless: every choice routed
    if "parallel.pp" in extra:
        return  # pipeline schedules interleave micro-batches: compared through losses and dropped fractions
    maps = {}
    for r in results:
        maps.update(r["maps"])
    assert maps.keys() == ref["maps"].keys()
    for key, routing_map in maps.items():
        assert torch.equal(routing_map, ref["maps"][key]), key  # the same choices kept and dropped


# ---- checkpoints: save under EP2, load under EP4 and without EP ---------------------------------------

CKPT = {**MOE, **CAPACITY, "train.train_iters": "6", "scheduler.decay_steps": "6", "parallel.timeout_s": "60"}


@pytest.fixture(scope="module")
def saved_ep2(tmp_path_factory):
    """(uninterrupted single-process losses, checkpoint of step 3 saved under EP2)."""
    root = tmp_path_factory.mktemp("ep_ckpt")
    ref = Trainer(load_config(overrides={**CKPT, "train.run_dir": str(root / "ref")}, world_size=1)).train()
    overrides = {**CKPT, "parallel.ep": "2", "train.train_iters": "3", "checkpoint.save_at_end": "true",
                 "train.run_dir": str(root / "save"), "checkpoint.save": str(root / "ck")}
    run_ranks("meshtron.testing.parity:train_and_report", 2, timeout_s=240, overrides=overrides)
    return [r.loss for r in ref], root / "ck"


@pytest.mark.parametrize("world, extra", [
    pytest.param(4, {"parallel.ep": "4"}, id="ep4"),
    pytest.param(1, {}, id="one_process", marks=pytest.mark.slow),
    pytest.param(4, {"parallel.ep": "2", "parallel.tp": "2"}, id="ep2_tp2", marks=pytest.mark.slow),
])
def test_checkpoint_from_ep2_resumes_under(world, extra, saved_ep2, tmp_path):
    ref_losses, ck = saved_ep2
    overrides = {**CKPT, **extra, "checkpoint.load": str(ck), "train.run_dir": str(tmp_path / "run")}
    if world == 1:
        losses = [r.loss for r in Trainer(load_config(overrides=overrides, world_size=1)).train()]
    else:
        losses = run_ranks("meshtron.testing.parity:train_and_report", world, timeout_s=240,
                           overrides=overrides)[0]["losses"]
    assert losses == pytest.approx(ref_losses[3:], abs=1e-6, rel=0)


# ---- layout errors: one line naming the field --------------------------------------------------------

@pytest.mark.parametrize("world, extra, message", [
    (4, {"parallel.ep": "3"}, "parallel.ep: 3 must divide dp_shard*cp = 4"),
    (4, {"parallel.ep": "2", "parallel.cp": "4", "parallel.dp_shard": "1"}, "be a multiple of cp = 4"),
    (4, {"parallel.ep": "4", "model.num_moe_experts": "6"}, "parallel.ep: 4 must divide model.num_moe_experts=6"),
    (2, {"parallel.ep": "2", "parallel.ep_dispatcher": "ring"}, "parallel.ep_dispatcher"),
    (2, {"parallel.tp": "2", "parallel.expert_tensor_parallel": "true", "model.add_bias_linear": "true"},
     "parallel.expert_tensor_parallel: expert biases"),
    (2, {"parallel.tp": "2", "parallel.expert_tensor_parallel": "true", "model.moe_ffn_hidden_size": "33"},
     "parallel.expert_tensor_parallel: tp=2 must divide the expert width 33"),
])
def test_ep_layout_errors_name_the_field(world, extra, message):
    from meshtron.config.fields import ConfigError

    with pytest.raises((ConfigError, ValueError), match=message.replace("*", r"\*")):
        estimate_memory(load_config(overrides={**MOE, **extra}, world_size=world), world)
