"""TEAL-GLU, an evaluation baseline: training-free magnitude sparsity on the *inputs* of a dense GLU's
projections (Liu et al., "Training-Free Activation Sparsity in Large Language Models", ICLR 2025;
its section "TEAL": a magnitude threshold on the input of every weight matrix). Part of the
exported runtime (torch and transformers only).

Spec: ``{"kind": "teal", "d_model", "d_ffn", "act", "t_in", "t_mid", "s_in", "s_mid"}``: the two
thresholds, and the sparsities they were calibrated to (``moelab.engine.core.teal``), which set
the cost the layer reports.
"""

from __future__ import annotations

import math
import struct
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from .moelab_kernels import row_major_t
from .moelab_native import ACTIVATIONS, DECODE_TOKENS, library as native_library, teal_decode


#: CPU tokens per call up to which ``TealGLU`` without the native kernels reads only the weight rows its nonzero
#: inputs need with torch's ``skip_rows``: a decode step of one or two sequences. For more tokens each token's rows are
#: read again, where one dense GEMM reads every weight once (the default model's FFN at sparsities 0.5 / 0.5, 2
#: threads: 1.5x the dense FFN's speed for 1 token, 1.5-1.8x for 2, 0.9-1.2x for 4, 0.7x for 8). Where the native
#: kernels are built, a decode step of up to ``moelab_native.DECODE_TOKENS`` tokens runs the whole FFN in one call
#: (``moelab_native.teal_decode``), which reads each needed row once for all of them.
ROW_SKIP_MAX_TOKENS = 2


def magnitude_sparsify(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """TEAL's sparsification function: ``x`` with every entry of ``|x| < threshold`` zeroed (threshold 0: ``x`` itself).

    In float32 and float64 one ``hardshrink`` pass, which zeroes ``|x| <= λ``, with ``λ`` the largest value of ``x``'s
    dtype below the threshold (the threshold rounded to that dtype first, as a comparison with it rounds it): the same
    entries zeroed as ``abs``, ``<`` and ``masked_fill`` would, where those three passes took 17x as long on a
    512-token prefill's ``[512, 1536]`` FFN activations (4.2 against 0.25 ms, 2 threads, beside a 14 ms GEMM)."""
    if threshold <= 0:
        return x
    below = _float_below(threshold, x.dtype)
    return F.hardshrink(x, below) if below is not None else x.masked_fill(x.abs() < threshold, 0.0)


def _float_below(threshold: float, dtype: torch.dtype) -> float | None:
    """The largest ``dtype`` value below ``threshold`` rounded to ``dtype`` (float32, float64; finite), else None."""
    if dtype == torch.float64:
        return math.nextafter(threshold, 0.0) if math.isfinite(threshold) else None
    if dtype != torch.float32:
        return None
    try:
        bits = struct.unpack("<I", struct.pack("<f", threshold))[0]  # rounds to nearest, as torch's cast does
    except OverflowError:
        return None
    if not 0 < bits < 0x7F800000:  # rounded to 0 (nothing is below it), inf or nan
        return None
    return struct.unpack("<f", struct.pack("<I", bits - 1))[0]


def skip_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` reading only the weight rows of ``x``'s nonzero entries (TEAL's column-skipping GEMV:
    "Hardware Aware Acceleration"): one ``embedding_bag`` over ``weight``'s ``[in, out]`` storage (``row_major_t``),
    each token's bag its nonzero inputs weighted by their values. ``x [T, in]`` -> ``[T, out]``."""
    nz = x != 0
    idx = nz.nonzero()  # one host read: how many rows each token needs
    counts = nz.sum(1)
    # embedding_bag spreads its bags over the threads: each token's rows in one bag per thread, summed after (one
    # bag of 288 rows of 1,536: 167 µs; two: 94 µs, as fast as a dense GEMV over those rows)
    parts = max(1, torch.get_num_threads())
    starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)[:-1]])
    offsets = (starts.unsqueeze(1) + counts.unsqueeze(1) * torch.arange(parts) // parts).reshape(-1)
    rows = weight.t()  # a view: [in, out] rows in the decode layout
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = F.embedding_bag(idx[:, 1], rows, offsets, mode="sum", per_sample_weights=x[nz].to(rows.dtype))
    return out.view(x.shape[0], parts, -1).sum(1).to(x.dtype)


class TealGLU(nn.Module):
    """``down( s_mid( act(x_s W_gate) * x_s W_up ) )`` with ``x_s = s_in(x)``, where ``s_t`` zeroes the
    entries whose magnitude is below the threshold ``t``. One threshold serves gate and up: both
    read the same ``x``. A zeroed input entry means the matching weight *column* need not be read,
    which only a column-skipping kernel turns into saved time (TEAL's "Hardware Aware Acceleration"):
    on CPU, a decode step reads only the rows it needs from weights in the decode layout: up to ``DECODE_TOKENS``
    tokens in one native call (``_native_call``), else up to ``ROW_SKIP_MAX_TOKENS`` through torch
    (``_row_product``); otherwise the products are computed densely with the zeros in (the same values).
    Parameters keep the dense names."""

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

    def active_param_count(self) -> int:
        """The weight columns a token reads at the calibrated sparsities: ``(1 − s_in)`` of gate's and
        up's, ``(1 − s_mid)`` of down's (an expectation over tokens: the count per token varies)."""
        return int(round(self.d_model * self.d_ffn * (2 * (1 - self.s_in) + (1 - self.s_mid))))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_ffn={self.d_ffn}, act={self.act}, s_in={self.s_in:.3f}, "
                f"s_mid={self.s_mid:.3f}")

    def use_decode_layout(self) -> None:
        """Every weight with ``[in, out]`` storage (``row_major_t``) so ``skip_rows`` copies none; the values and the
        checkpoint keys stay (``realign_parameters`` calls this after a load)."""
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            lin.weight.data = row_major_t(lin.weight.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xt = x.reshape(-1, self.d_model)
        if (call := self._native_call(xt)) is not None:
            return call(xt).reshape(*lead, self.d_model)
        xs = magnitude_sparsify(xt, self.t_in)
        if self._row_product(xt):
            h = self.act_fn(skip_rows(xs, self.gate_proj.weight)) * skip_rows(xs, self.up_proj.weight)
            y = skip_rows(magnitude_sparsify(h, self.t_mid), self.down_proj.weight)
        else:
            h = self.act_fn(self.gate_proj(xs)) * self.up_proj(xs)
            y = self.down_proj(magnitude_sparsify(h, self.t_mid))
        return y.reshape(*lead, self.d_model)

    def _decode_step(self, x: torch.Tensor) -> bool:
        """Whether ``x [T, in]`` is a CPU decode step without a gradient on weights in the decode layout."""
        w = self.gate_proj.weight
        return (x.device.type == "cpu" and x.shape[0] > 0 and w.stride() == (1, w.shape[0])
                and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))

    def _native_call(self, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The whole FFN in one native call (``moelab_native.teal_decode``) for a decode step of up to
        ``DECODE_TOKENS`` float32 tokens where the kernels are built, the activation is theirs and both thresholds
        have a float32 value below them (one that rounds to 0 or infinity takes torch's path); else None."""
        if (x.shape[0] > DECODE_TOKENS or x.dtype != torch.float32 or self.act not in ACTIVATIONS
                or not self._decode_step(x) or native_library() is None):
            return None
        weights = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        if any(w.dtype != torch.float32 or not w.t().is_contiguous() for w in weights):
            return None
        below_in, below_mid = (_kernel_threshold(t) for t in (self.t_in, self.t_mid))
        if below_in is None or below_mid is None:
            return None
        rows = [w.t() for w in weights]
        return lambda xt: teal_decode(xt, below_in, below_mid, *rows, self.act)

    def _row_product(self, x: torch.Tensor) -> bool:
        """Whether torch's row-skipping ``skip_rows`` computes the products (a decode step of up to
        ``ROW_SKIP_MAX_TOKENS`` tokens, weights in the decode layout); else the dense products, the same values,
        zeros multiplied."""
        return x.shape[0] <= ROW_SKIP_MAX_TOKENS and self._decode_step(x)


def _kernel_threshold(threshold: float) -> float | None:
    """What the native kernel compares ``|x| <=`` with to zero the entries ``magnitude_sparsify`` zeroes in float32:
    -1 for a threshold of 0 (nothing zeroed), else the largest float32 below it; None where there is none."""
    return -1.0 if threshold <= 0 else _float_below(threshold, torch.float32)
