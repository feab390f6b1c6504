"""Slow per-token references for the MoE tests: plain Python loops over tokens and experts, in float64."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F


def route_token(logits: torch.Tensor, cfg, expert_bias=None) -> tuple[list[int], list[float]]:
    """One token's logits (E,) float64 -> (chosen experts, their weights), as the router docs say."""
    E, k = len(logits), cfg.moe_router_topk
    bias = [0.0] * E if expert_bias is None else [float(b) for b in expert_bias]
    logits = logits.detach()
    if cfg.moe_router_score_function == "softmax":
        soft = torch.softmax(logits, 0)
        base = soft if cfg.moe_router_pre_softmax else logits
    else:
        base = torch.sigmoid(logits)
    select = [float(base[e]) + bias[e] for e in range(E)]
    candidates = list(range(E))
    if cfg.moe_router_num_groups:
        G, per = cfg.moe_router_num_groups, E // cfg.moe_router_num_groups
        group_score = []
        for g in range(G):
            members = sorted((select[e] for e in range(g * per, (g + 1) * per)), reverse=True)
            group_score.append(sum(members[: k // cfg.moe_router_group_topk]))
        groups = sorted(range(G), key=lambda g: -group_score[g])[: cfg.moe_router_group_topk]
        candidates = [e for e in range(E) if e // per in groups]
    chosen = sorted(candidates, key=lambda e: -select[e])[:k]
    if cfg.moe_router_score_function == "softmax":
        if cfg.moe_router_pre_softmax:
            weights = [float(soft[e]) for e in chosen]
        else:
            exps = [math.exp(float(logits[e])) for e in chosen]
            weights = [v / sum(exps) for v in exps]
    else:
        weights = [float(base[e]) for e in chosen]
        if k > 1:
            weights = [w / sum(weights) for w in weights]
    scale = cfg.moe_router_topk_scaling_factor or 1.0
    return chosen, [w * scale for w in weights]


def normalised_scores(logits: torch.Tensor, cfg) -> list[float]:
    if cfg.moe_router_score_function == "softmax":
        return torch.softmax(logits, 0).tolist()
    s = torch.sigmoid(logits)
    return (s / s.sum()).tolist()


def balancing_loss(logits: torch.Tensor, cfg, seq_len: int) -> float:
    """coeff * E * sum_i f_i P_i over the batch, or per sequence and averaged (DeepSeek-V3 eq. 17-18 /
    20-21): f_i counts the tokens whose k largest normalised scores s' include expert i (plain top-k,
    no expert bias, no group limit), P_i is the mean of s'_i."""
    T, E = logits.shape
    k = cfg.moe_router_topk
    scores = [normalised_scores(logits[t], cfg) for t in range(T)]
    top = [sorted(range(E), key=lambda e: -scores[t][e])[:k] for t in range(T)]
    groups = [range(T)] if cfg.moe_router_load_balancing_type == "aux_loss" else \
        [range(s, s + seq_len) for s in range(0, T, seq_len)]
    total = 0.0
    for g in groups:
        for i in range(E):
            f = sum(1 for t in g if i in top[t]) / (len(g) * k)
            p = sum(scores[t][i] for t in g) / len(g)
            total += E * f * p
    return cfg.moe_aux_loss_coeff * total / len(groups)


def z_loss(logits: torch.Tensor, coeff: float) -> float:
    return coeff * sum(float(torch.logsumexp(row, 0)) ** 2 for row in logits) / logits.shape[0]


def expert_mlp(layer, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e of a MoELayer on one token, in float64."""
    ex = layer.experts
    w = lambda p: None if p is None else p[e].double()  # noqa: E731
    up = F.linear(x, w(ex.w_up), w(ex.b_up))
    if ex.w_gate is None:
        h = ex.act(up)
    else:
        gate = F.linear(x, w(ex.w_gate), w(ex.b_gate))
        if ex.clamp_value is not None:
            gate, up = gate.clamp(max=ex.clamp_value), up.clamp(-ex.clamp_value, ex.clamp_value)
        h = ex.act(gate) * (up + ex.linear_offset)
    return F.linear(h, w(ex.w_down), w(ex.b_down))


def kept_choices(chosen: list[list[int]], weights: list[list[float]], E: int, capacity, policy: str):
    """{(token, expert)} kept under the capacity (None: all)."""
    pairs = {(t, e) for t, es in enumerate(chosen) for e in es}
    if capacity is None:
        return pairs
    kept = set()
    for e in range(E):
        users = [t for t in range(len(chosen)) if e in chosen[t]]
        if policy == "probs":
            users.sort(key=lambda t: -weights[t][chosen[t].index(e)])
        kept.update((t, e) for t in users[:capacity])
    return kept


def moe_layer_reference(layer, x: torch.Tensor, cfg) -> torch.Tensor:
    """MoELayer output by loops: route each token, apply the capacity, sum weighted expert outputs."""
    B, S, d = x.shape
    tokens = x.reshape(-1, d).double()
    router = layer.router
    bias = None if router.bias is None else router.bias.detach().double()
    logits = F.linear(tokens, router.weight.double(), bias)
    routed = [route_token(row, cfg, router.expert_bias) for row in logits]
    chosen, weights = [r[0] for r in routed], [r[1] for r in routed]
    E = cfg.num_moe_experts
    capacity = None
    if cfg.moe_expert_capacity_factor is not None:
        capacity = math.ceil(len(chosen) * cfg.moe_router_topk / E * cfg.moe_expert_capacity_factor)
    kept = kept_choices(chosen, weights, E, capacity, cfg.moe_token_drop_policy)
    out = torch.zeros_like(tokens)
    shared_mlp = None if layer.shared_experts is None else copy.deepcopy(layer.shared_experts).double()
    shared_gate = None if layer.shared_expert_gate is None else copy.deepcopy(layer.shared_expert_gate).double()
    for t in range(len(chosen)):
        for e, w in zip(chosen[t], weights[t]):
            if (t, e) in kept:
                out[t] += w * expert_mlp(layer, e, tokens[t])
        if shared_mlp is not None:
            sh = shared_mlp(tokens[t])
            if shared_gate is not None:
                sh = torch.sigmoid(shared_gate(tokens[t])) * sh
            out[t] += sh
    return out.reshape(B, S, d)
