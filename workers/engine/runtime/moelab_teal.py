"""TEAL-GLU, an evaluation baseline: training-free magnitude sparsity on the *inputs* of a dense GLU's
projections (Liu et al., "Training-Free Activation Sparsity in Large Language Models", ICLR 2025;
its section "TEAL": a magnitude threshold on the input of every weight matrix). Part of the
exported runtime (torch and transformers only).

Spec: ``{"kind": "teal", "d_model", "d_ffn", "act", "t_in", "t_mid", "s_in", "s_mid"}``: the two
thresholds, and the sparsities they were calibrated to (``workers.engine.core.teal``), which set
the cost the layer reports.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from transformers.activations import ACT2FN


def magnitude_sparsify(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """TEAL's sparsification function: ``x`` with every entry of ``|x| < threshold`` zeroed (threshold 0: ``x`` itself)."""
    return x.masked_fill(x.abs() < threshold, 0.0) if threshold > 0 else x


class TealGLU(nn.Module):
    """``down( s_mid( act(x_s W_gate) * x_s W_up ) )`` with ``x_s = s_in(x)``, where ``s_t`` zeroes the
    entries whose magnitude is below the threshold ``t``. One threshold serves gate and up: both
    read the same ``x``. A zeroed input entry means the matching weight *column* need not be read,
    which only a column-skipping kernel turns into saved time (TEAL's "Hardware Aware
    Acceleration"); here the products are
    computed densely with the zeros in, exactly what such a kernel computes. Parameters keep the
    dense names."""

    def __init__(self, spec: dict):
        super().__init__()
        spec = dict(spec)
        kind = spec.pop("kind", "teal")
        if kind != "teal":
            raise ValueError(f"TealGLU needs a spec of kind 'teal', got {kind!r}")
        self.d_model, self.d_ffn = int(spec["d_model"]), int(spec["d_ffn"])
        self.act = str(spec.get("act", "silu"))
        self.t_in, self.t_mid = float(spec["t_in"]), float(spec["t_mid"])
        self.s_in, self.s_mid = float(spec["s_in"]), float(spec["s_mid"])
        for name in ("s_in", "s_mid"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1]")
        if self.t_in < 0 or self.t_mid < 0:
            raise ValueError("thresholds must be non-negative")
        known = ("d_model", "d_ffn", "act", "t_in", "t_mid", "s_in", "s_mid")
        self._extra = {k: v for k, v in spec.items() if k not in known}
        self.act_fn = ACT2FN[self.act]
        self.gate_proj = nn.Linear(self.d_model, self.d_ffn, bias=False)
        self.up_proj = nn.Linear(self.d_model, self.d_ffn, bias=False)
        self.down_proj = nn.Linear(self.d_ffn, self.d_model, bias=False)
        # set by MoelabForCausalLM.set_recorder like every replaced MLP's; TEAL routes nothing to record
        self.recorder: Callable[[torch.Tensor], None] | None = None

    @property
    def spec(self) -> dict:
        return {"kind": "teal", "d_model": self.d_model, "d_ffn": self.d_ffn, "act": self.act, "t_in": self.t_in,
                "t_mid": self.t_mid, "s_in": self.s_in, "s_mid": self.s_mid, **self._extra}

    @classmethod
    @torch.no_grad()
    def from_dense(cls, gate_w, up_w, down_w, act: str, t_in: float, t_mid: float, s_in: float, s_mid: float,
                   **extra: Any) -> "TealGLU":
        d_ffn, d_model = gate_w.shape
        with torch.device("meta"):
            mod = cls({"kind": "teal", "d_model": int(d_model), "d_ffn": int(d_ffn), "act": act, "t_in": float(t_in),
                       "t_mid": float(t_mid), "s_in": float(s_in), "s_mid": float(s_mid), **extra})
        mod.to_empty(device=gate_w.device)
        mod.to(gate_w.dtype)
        mod.gate_proj.weight.copy_(gate_w)
        mod.up_proj.weight.copy_(up_w)
        mod.down_proj.weight.copy_(down_w)
        return mod

    def active_param_count(self) -> int:
        """The weight columns a token reads at the calibrated sparsities: ``(1 − s_in)`` of gate's and
        up's, ``(1 − s_mid)`` of down's (an expectation over tokens: the count per token varies)."""
        return int(round(self.d_model * self.d_ffn * (2 * (1 - self.s_in) + (1 - self.s_mid))))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_ffn={self.d_ffn}, act={self.act}, s_in={self.s_in:.3f}, "
                f"s_mid={self.s_mid:.3f}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = magnitude_sparsify(x, self.t_in)
        h = self.act_fn(self.gate_proj(xs)) * self.up_proj(xs)
        return self.down_proj(magnitude_sparsify(h, self.t_mid))
