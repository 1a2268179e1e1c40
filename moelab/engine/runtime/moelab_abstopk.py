"""AbsTopK-GLU, ExpertWeaver's baseline (EW Eq. 2): per token, only the k neurons with the largest
``|act(x W_gate)|`` of the dense GLU contribute. Part of the exported runtime (torch and
transformers only).

Spec: ``{"kind": "abstopk", "d_model", "d_ffn", "act", "k"}``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from transformers.activations import ACT2FN


class AbsTopKGLU(nn.Module):
    """EW Eq. 2: ``down( AbsTopK(act(x W_gate), k) * x W_up )`` - per token, only the k neurons
    with the largest ``|act(x W_gate)|`` contribute. Parameters keep the dense names."""

    def __init__(self, spec: dict):
        super().__init__()
        spec = dict(spec)
        kind = spec.pop("kind", "abstopk")
        if kind != "abstopk":
            raise ValueError(f"AbsTopKGLU needs a spec of kind 'abstopk', got {kind!r}")
        self.d_model, self.d_ffn = int(spec["d_model"]), int(spec["d_ffn"])
        self.act, self.k = str(spec.get("act", "silu")), int(spec["k"])
        if not 0 <= self.k <= self.d_ffn:
            raise ValueError(f"k={self.k} must be in [0, d_ffn={self.d_ffn}]")
        self._extra = {k: v for k, v in spec.items() if k not in ("d_model", "d_ffn", "act", "k")}
        self.act_fn = ACT2FN[self.act]
        self.gate_proj = nn.Linear(self.d_model, self.d_ffn, bias=False)
        self.up_proj = nn.Linear(self.d_model, self.d_ffn, bias=False)
        self.down_proj = nn.Linear(self.d_ffn, self.d_model, bias=False)
        self.recorder: Callable[[torch.Tensor], None] | None = None

    @property
    def spec(self) -> dict:
        return {"kind": "abstopk", "d_model": self.d_model, "d_ffn": self.d_ffn, "act": self.act,
                "k": self.k, **self._extra}

    def active_param_count(self) -> int:
        """All gate rows are computed to pick the top k; up and down only for those k neurons."""
        return self.d_model * (self.d_ffn + 2 * self.k)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ffn={self.d_ffn}, k={self.k}, act={self.act}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.act_fn(self.gate_proj(x))
        if self.k < self.d_ffn:
            idx = torch.topk(a.abs(), self.k, dim=-1).indices
            if self.recorder is not None:
                self.recorder(idx)
            a = torch.zeros_like(a).scatter(-1, idx, a.gather(-1, idx))
        return self.down_proj(a * self.up_proj(x))
