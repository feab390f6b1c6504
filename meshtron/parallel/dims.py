"""ParallelDims: the degrees of every parallelism, validated against the world size, and the one
DeviceMesh built from them.

Mesh axes, outermost first: pp, dp_replicate, dp_shard, cp, tp (tp innermost, so tensor-parallel
peers are neighbours: the same node on a GPU cluster). Flattened axes used by name:
    dp          = dp_replicate x dp_shard   (data loading: ranks that see different samples)
    dp_shard_cp = dp_shard x cp             (FSDP shards parameters over these)
    dp_cp       = dp_replicate x dp_shard x cp  (loss and token counts are summed over these)
Expert parallelism borrows its ranks from dp_shard x cp (as in torchtitan): with ep > 1, dp_shard is
built from two axes, dp_shard_mod_ep (outer) x dp_shard_in_ep (inner, ep / cp ranks), and
    ep          = dp_shard_in_ep x cp       (routed experts are split over these; tokens move by all-to-all)
    expert FSDP = dp_shard_mod_ep           (each expert shard is FSDP-sharded over the rest of dp_shard x cp;
                                             with dp_replicate: the 2-D (dp_replicate, dp_shard_mod_ep))
so ep must be a multiple of cp and divide dp_shard x cp.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshtron.compat import flatten_mesh, nccl_options
from meshtron.config.fields import ConfigError
from meshtron.config.schema import ParallelConfig

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EP_AXES = ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        others = cfg.dp_replicate * cfg.cp * cfg.tp * cfg.pp
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"parallel: dp_replicate*cp*tp*pp = {others} does not divide the world size {world_size}; "
                    "change the degrees or the number of processes")
            dp_shard = world_size // others
        dims = cls(cfg.dp_replicate, dp_shard, cfg.cp, cfg.tp, cfg.pp, cfg.ep, world_size)
        dims.validate()
        return dims

    def validate(self) -> None:
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.world_size:
            raise ConfigError(
                f"parallel: dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * cp({self.cp}) * "
                f"tp({self.tp}) * pp({self.pp}) = {product} but the world size is {self.world_size}; "
                "make the product equal the number of processes (dp_shard: -1 fills in the rest)")
        if self.ep > 1 and ((self.dp_shard * self.cp) % self.ep or self.ep % self.cp):
            raise ConfigError(f"parallel.ep: {self.ep} must divide dp_shard*cp = {self.dp_shard * self.cp} and be a "
                              f"multiple of cp = {self.cp} (expert parallelism borrows the dp_shard x cp ranks)")

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_in_ep(self) -> int:
        return self.ep // self.cp if self.ep > 1 else 1

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.dp_shard // self.dp_shard_in_ep

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1 or self.dp_replicate > 1

    def build_mesh(self, device_type: str, timeout_s: float) -> NamedMesh:
        """One mesh with every axis (size-1 axes included) and the flattened axes named above."""
        if self.ep > 1:
            axes, shard = EP_AXES, ("dp_shard_mod_ep", "dp_shard_in_ep")
            shape = (self.pp, self.dp_replicate, self.dp_shard_mod_ep, self.dp_shard_in_ep, self.cp, self.tp)
        else:
            axes, shard = AXES, ("dp_shard",)
            shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        override = {name: backend_options(device_type, timeout_s) for name in axes}
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=axes, backend_override=override)
        flat_opts = backend_options(device_type, timeout_s)

        def flatten(name: str, *names: str) -> DeviceMesh:
            return flatten_mesh(mesh[names], name, backend_override=flat_opts)

        flat = {
            "dp": flatten("dp", "dp_replicate", *shard),
            "dp_shard_cp": flatten("dp_shard_cp", *shard, "cp"),
            "dp_cp": flatten("dp_cp", "dp_replicate", *shard, "cp"),
        }
        if self.ep > 1:
            flat["dp_shard"] = flatten("dp_shard", *shard)
            flat["ep"] = flatten("ep", "dp_shard_in_ep", "cp")
        return NamedMesh(mesh, flat)


class NamedMesh:
    """The root DeviceMesh plus its flattened axes, looked up by name: mesh["tp"], mesh["dp_cp"],
    mesh["dp_replicate", "dp_shard_cp"] (a 2-D mesh for HSDP)."""

    def __init__(self, root: DeviceMesh, flat: dict[str, DeviceMesh]):
        self.root, self.flat = root, flat

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(names, str):
            return self.flat[names] if names in self.flat else self.root[names]
        with warnings.catch_warnings():
            # a 2-D slice mixing a root axis and a flattened one (HSDP); PyTorch plans another API for it
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return self.root[names]


def backend_options(device_type: str, timeout_s: float):
    """(backend, options) with an explicit timeout: sub-groups ignore init_process_group's timeout."""
    timeout = timedelta(seconds=timeout_s)
    if device_type == "cuda":
        return "nccl", nccl_options(timeout)
    return "gloo", dist.ProcessGroupGloo.Options("gloo", timeout)
