"""Hierarchical experts (AF §4.4, Eq. 10): the routed experts of an existing sparse-MoE block
(Mixtral, Qwen2/3-MoE), each restructured into shared + routed sub-experts (a ``MoeFFN`` each).
Part of the exported runtime (torch and transformers only).

Spec: ``{"kind": "hierarchical", "d_model", "num_experts", "experts_per_token", "experts": [MoE
layer spec, ...]}`` (the sparse-MoE block stays, only its ``experts`` module is replaced).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from .moelab_moe import MoeFFN


class HierarchicalExperts(nn.Module):
    """AF §4.4, Eq. 10: the routed experts of an existing sparse-MoE block, each expert
    restructured into shared + routed sub-experts with its own sub-router,
    ``E_i(x) -> E_i^s(x) + sum_j g'_ij E_ij^r(x)``; ``sub_experts[i]`` is a ``MoeFFN``.

    Replaces the fused ``experts`` module of a transformers sparse-MoE block (Mixtral,
    Qwen2-MoE, Qwen3-MoE) with the same call, ``forward(hidden_states [T, d], top_k_index
    [T, k], top_k_weights [T, k]) -> [T, d]``, so the block's top-level router, its top-k
    weights and (Qwen2-MoE) its shared expert and shared_expert_gate keep working untouched:
    every (token, slot) pair routed to expert i runs ``sub_experts[i]`` on that token, scaled by
    the slot's weight, exactly as the replaced module does. Index ``num_experts`` means "no
    expert" (transformers' expert-parallel convention) and adds nothing.

    Spec: ``{"kind": "hierarchical", "d_model", "num_experts", "experts_per_token",
    "experts": [MoeFFN spec, ...]}``; ``experts_per_token`` is the top-level router's k (used by
    ``active_param_count`` only). Every sub-MoE has the same ``top_k``.

    Routing statistics are about sub-experts: ``n_routed`` counts the routed sub-experts of all
    experts (sub-expert j of expert i has the global id ``offsets[i] + j``) and ``top_k`` =
    ``experts_per_token * sub top_k``. ``recorder`` receives ``[batch, seq, top_k]`` global ids,
    slot-major (top-level slot s owns columns ``s*sub_top_k : (s+1)*sub_top_k``), -1 for a "no
    expert" slot. ``[batch, seq]`` is the enclosing block's input shape, remembered by a
    pre-hook ``convert_in_place`` installs; called on its own the module records ``[T, top_k]``.
    """

    def __init__(self, spec: dict):
        super().__init__()
        spec = dict(spec)
        kind = spec.pop("kind", "hierarchical")
        if kind != "hierarchical":
            raise ValueError(f"HierarchicalExperts needs a spec of kind 'hierarchical', got {kind!r}")
        subs = list(spec.pop("experts", None) or [])
        if not subs:
            raise ValueError("a hierarchical spec needs 'experts': one MoE spec per expert of the block")
        self.d_model = int(spec.pop("d_model"))
        self.num_experts = int(spec.pop("num_experts", len(subs)))
        self.experts_per_token = int(spec.pop("experts_per_token"))
        if self.num_experts != len(subs):
            raise ValueError(f"num_experts={self.num_experts} but the spec lists {len(subs)} expert specs")
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token={self.experts_per_token} must be in [1, num_experts={self.num_experts}]"
            )
        self._extra = spec
        self.sub_experts = nn.ModuleList(MoeFFN(s) for s in subs)
        if {m.d_model for m in self.sub_experts} != {self.d_model}:
            raise ValueError(f"every sub-MoE must have d_model={self.d_model}")
        tops = {m.top_k for m in self.sub_experts}
        if len(tops) != 1:  # the recorder's selections must form one rectangular tensor
            raise ValueError(f"every sub-MoE must have the same top_k, got {sorted(tops)}")
        self.sub_top_k = tops.pop()
        counts = [m.n_routed for m in self.sub_experts]
        self.offsets = [sum(counts[:i]) for i in range(len(counts))]
        self.n_routed = sum(counts)
        self.top_k = self.experts_per_token * self.sub_top_k
        self.recorder: Callable[[torch.Tensor], None] | None = None
        self._lead: tuple[int, ...] | None = None

    @property
    def spec(self) -> dict:
        return {"kind": "hierarchical", "d_model": self.d_model, "num_experts": self.num_experts,
                "experts_per_token": self.experts_per_token, **self._extra,
                "experts": [m.spec for m in self.sub_experts]}

    def active_param_count(self) -> int:
        """Per token: ``experts_per_token`` experts, each its shared part, its active sub-experts
        and its sub-router (``MoeFFN.active_param_count``); with unequal experts the largest ones
        (an upper bound). The block's top-level router stays outside this module."""
        per_expert = sorted((m.active_param_count() for m in self.sub_experts), reverse=True)
        return sum(per_expert[: self.experts_per_token])

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, experts_per_token={self.experts_per_token}, "
                f"sub_experts={self.n_routed}, top_k={self.top_k}")

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        T, k = top_k_index.shape
        lead, self._lead = self._lead, None
        out = torch.zeros_like(hidden_states)
        selected = None
        if self.recorder is not None:
            selected = top_k_index.new_full((T, k, self.sub_top_k), -1)
        flat = top_k_index.reshape(-1)
        # (token, slot) pairs grouped by expert (stable: tokens ascending); "no expert" sorts last.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts + 1)[: self.num_experts].tolist()
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            pairs = order[start : start + c]
            start += c
            tok, pos = pairs // k, pairs % k
            sub = self.sub_experts[e]
            xe = hidden_states.index_select(0, tok)
            if selected is None:
                y = sub(xe)
            else:
                got: list[torch.Tensor] = []
                previous, sub.recorder = sub.recorder, got.append
                try:
                    y = sub(xe)
                finally:
                    sub.recorder = previous
                selected[tok, pos] = got[0].to(selected.dtype) + self.offsets[e]
            y = y * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        if selected is not None:
            shape = lead if lead is not None and math.prod(lead) == T else (T,)
            self.recorder(selected.reshape(*shape, k * self.sub_top_k))
        return out


def _remember_lead_shape(block: nn.Module, args: tuple, kwargs: dict) -> None:
    """Pre-hook on a sparse-MoE block: its experts see flattened tokens, the recorder wants
    ``[batch, seq, ...]``."""
    x = args[0] if args else kwargs.get("hidden_states")
    experts = getattr(block, "experts", None)
    if isinstance(experts, HierarchicalExperts) and isinstance(x, torch.Tensor):
        experts._lead = tuple(x.shape[:-1])


def set_experts(block: nn.Module, mod: HierarchicalExperts, i: int) -> None:
    """A hierarchical layer replaces only the ``experts`` of the layer's sparse-MoE block."""
    moe_block = getattr(block, "mlp", None)
    if not isinstance(getattr(moe_block, "experts", None), nn.Module):
        raise ValueError(
            f"layer {i}: a hierarchical layer replaces the experts of a sparse-MoE block (mlp.experts), "
            f"but this layer's MLP is a {type(moe_block).__name__}"
        )
    moe_block.experts = mod
    if not getattr(moe_block, "_moelab_lead_hook", False):
        moe_block.register_forward_pre_hook(_remember_lead_shape, with_kwargs=True)
        moe_block._moelab_lead_hook = True
