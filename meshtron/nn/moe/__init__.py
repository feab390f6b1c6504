"""Mixture of experts: router, routing map, token dispatcher, grouped experts, the MoE sublayer,
router replay and the training-side hooks (aux-loss scale, statistics, expert-bias updates)."""

from meshtron.nn.moe.balance import end_of_step, moe_layers, set_aux_loss_scale, update_expert_bias
from meshtron.nn.moe.dispatcher import LocalDispatcher, TokenDispatcher
from meshtron.nn.moe.experts import GroupedExperts
from meshtron.nn.moe.layer import MoELayer, attach_aux_loss
from meshtron.nn.moe.replay import (
    ReplayMode,
    RouterReplay,
    clear_replay,
    recorded_routing,
    replays,
    set_replay_mode,
    set_replay_targets,
)
from meshtron.nn.moe.router import ROUTERS, Router, TopKRouter, build_router, register_router

__all__ = ["ROUTERS", "GroupedExperts", "LocalDispatcher", "MoELayer", "ReplayMode", "Router", "RouterReplay",
           "TokenDispatcher", "TopKRouter", "attach_aux_loss", "build_router", "clear_replay", "end_of_step",
           "moe_layers", "recorded_routing", "register_router", "replays", "set_aux_loss_scale", "set_replay_mode",
           "set_replay_targets", "update_expert_bias"]
