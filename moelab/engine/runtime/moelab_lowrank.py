"""MIDAS's low-rank MoE layer (MI §3.2, Alg. 1): low-rank factorised copies of the dense GLU, one
per calibration set, behind a softmax top-k gating network. Part of the exported runtime (torch and
transformers only).

Spec: ``{"kind": "lowrank_moe", "d_model", "d_ffn", "act", "n_experts", "rank", "top_k"}``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

_LOWRANK_KEYS = {"kind", "d_model", "d_ffn", "act", "n_experts", "rank", "top_k"}


class LowRankMoeFFN(nn.Module):
    """MIDAS (MI §3.2, Alg. 1): ``n_experts`` low-rank copies of one dense GLU, each factorised
    on its own calibration set, behind a new softmax top-k gating network G.

    Expert e: ``down_b[e] down_a[e] ( act(gate_b[e] gate_a[e] x) * up_b[e] up_a[e] x )``.
    Factors are stacked ``nn.Parameter`` tensors named as in LoRA (A maps in, B maps out):
    ``gate_a``/``up_a`` ``[E, r, d_model]``, ``gate_b``/``up_b`` ``[E, d_ffn, r]``,
    ``down_a`` ``[E, r, d_ffn]``, ``down_b`` ``[E, d_model, r]``. ``router`` is G, an
    ``nn.Linear(d_model, E, bias=False)``.

    Combine: ``p = softmax(G x)`` over all E experts, the ``top_k`` largest are kept and
    renormalised to sum to 1 (Mixtral / LLaMA-MoE gating), so the output is a convex
    combination of the selected experts: with a fresh G it is roughly an average of low-rank
    approximations of the same FFN, and G stays trainable through the weights.

    Spec: ``{"kind": "lowrank_moe", "d_model", "d_ffn", "act", "n_experts", "rank", "top_k"}``.
    ``recorder``: optional callable receiving the selected expert ids ``[..., top_k]``.
    """

    def __init__(self, spec: dict):
        super().__init__()
        spec = dict(spec)
        kind = spec.pop("kind", "lowrank_moe")
        if kind != "lowrank_moe":
            raise ValueError(f"LowRankMoeFFN needs a spec of kind 'lowrank_moe', got {kind!r}")
        self.d_model, self.d_ffn = int(spec["d_model"]), int(spec["d_ffn"])
        self.act = str(spec.get("act", "silu"))
        self.n_experts, self.rank, self.top_k = int(spec["n_experts"]), int(spec["rank"]), int(spec["top_k"])
        E, r, d, f = self.n_experts, self.rank, self.d_model, self.d_ffn
        if min(d, f, E, r) < 1:
            raise ValueError(f"d_model, d_ffn, n_experts and rank must be ≥ 1 in spec {spec}")
        if not 1 <= self.top_k <= E:
            raise ValueError(f"top_k={self.top_k} must be within 1 … n_experts={E}")
        self._extra = {k: v for k, v in spec.items() if k not in _LOWRANK_KEYS}
        self.act_fn = ACT2FN[self.act]
        self.router = nn.Linear(d, E, bias=False)
        self.gate_a = nn.Parameter(torch.empty(E, r, d))
        self.gate_b = nn.Parameter(torch.empty(E, f, r))
        self.up_a = nn.Parameter(torch.empty(E, r, d))
        self.up_b = nn.Parameter(torch.empty(E, f, r))
        self.down_a = nn.Parameter(torch.empty(E, r, f))
        self.down_b = nn.Parameter(torch.empty(E, d, r))
        self.recorder: Callable[[torch.Tensor], None] | None = None
        self.reset_parameters()

    @property
    def n_routed(self) -> int:
        """Every expert is routed (no shared expert): the same count as ``n_experts``."""
        return self.n_experts

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Random init (a fresh model only; converted and loaded models overwrite it)."""
        for p in self.parameters():
            if p.device.type != "meta":
                nn.init.normal_(p, 0.0, std)

    @property
    def spec(self) -> dict:
        return {
            "kind": "lowrank_moe", "d_model": self.d_model, "d_ffn": self.d_ffn, "act": self.act,
            "n_experts": self.n_experts, "rank": self.rank, "top_k": self.top_k, **self._extra,
        }

    def active_param_count(self) -> int:
        """Gating network plus ``top_k`` experts of three rank-r factor pairs each."""
        return self.n_experts * self.d_model + self.top_k * 3 * self.rank * (self.d_model + self.d_ffn)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_ffn={self.d_ffn}, n_experts={self.n_experts}, rank={self.rank}, "
                f"top_k={self.top_k}, act={self.act}")

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` alone on ``x [..., d_model]`` (MI Eq. 2's E_e as a GLU)."""
        g = F.linear(F.linear(x, self.gate_a[e]), self.gate_b[e])
        u = F.linear(F.linear(x, self.up_a[e]), self.up_b[e])
        return F.linear(F.linear(self.act_fn(g) * u, self.down_a[e]), self.down_b[e])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xt = x.reshape(-1, self.d_model)
        T, E = xt.shape[0], self.n_experts
        probs = torch.softmax(self.router(xt).float(), dim=-1)
        weight, top = probs.topk(self.top_k, dim=-1)
        weight = (weight / weight.sum(dim=-1, keepdim=True)).to(x.dtype)
        if self.recorder is not None:
            self.recorder(top.reshape(*lead, self.top_k))
        y = xt.new_zeros(T, self.d_model)
        # Group (token, expert) pairs by expert: the nonzeros of the [E, T] selection mask in
        # row-major order, so each expert runs once on all of its tokens.
        mask_t = torch.zeros(T, E, dtype=torch.bool, device=x.device).scatter_(1, top, True).t()
        tok = mask_t.nonzero()[:, 1]
        w_sorted = torch.zeros(T, E, dtype=x.dtype, device=x.device).scatter(1, top, weight).t()[mask_t]
        s = 0
        for e, c in enumerate(mask_t.sum(dim=1).tolist()):
            if c == 0:
                continue
            te = tok[s : s + c]
            y.index_add_(0, te, self.expert(e, xt.index_select(0, te)) * w_sorted[s : s + c, None])
            s += c
        return y.reshape(*lead, self.d_model)
