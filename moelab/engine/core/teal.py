"""TEAL thresholds, calibrated on calibration tokens: an evaluation baseline beside AbsTopK.

TEAL (Liu et al., "Training-Free Activation Sparsity in Large Language Models", ICLR 2025) zeroes the
low-magnitude entries of the input of every weight matrix, so the matching weight columns need not be
read. Here, as a baseline for the FFN only (``runtime.moelab_teal.TealGLU``):

* **Thresholds** (TEAL's section "TEAL": a threshold per matrix input from the empirical distribution
  of its activations). One threshold ``t_in`` on the MLP input ``x`` (gate and up read the same ``x``)
  and one ``t_mid`` on the down projection's input ``h = act(x_s W_gate) * (x_s W_up)``, computed from
  the already-thresholded ``x_s``. Each is the empirical quantile of ``|x|`` (``|h|``) on the calibration
  tokens at the target sparsity ``s_in`` (``s_mid``): the ``n+1``-th smallest magnitude, ``n = round(s·N)``,
  so exactly ``n`` of the ``N`` calibration entries fall below it (ties aside).
* **Cost** (moelab's ``ffn_flops_fraction``): ``(2·(1 − s_in) + (1 − s_mid)) / 3`` of the dense FFN: no
  router; the comparisons are element-wise work, not counted, as a GLU's products are not.
* **Allocation.** ``uniform``: ``s_in = s_mid = 1 − cost`` in every layer. ``greedy`` (TEAL's
  "Block-wise Greedy Optimization", here within each MLP, with the same cost in every layer; TEAL
  also moves sparsity across blocks to a model-wide target, which this baseline does not): from
  ``s_in = s_mid = 0``, repeatedly raise by ``step`` whichever of ``s_in`` / ``s_mid`` raises the
  MLP's relative output error ``‖F_teal(x) − F(x)‖ / ‖F(x)‖`` least per unit of cost saved (a step of
  ``s_in`` saves twice what one of ``s_mid`` does), the last step shortened so the layer costs the
  target exactly. The error is measured on an even subsample of at most ``max_tokens`` calibration
  tokens, with thresholds from that subsample (quantiles of a fixed draw of at most ``QUANTILE_SAMPLE``
  of its magnitudes: within about 0.001 of the exact fraction); the final thresholds are exact
  quantiles over all the calibration tokens.
* Attention stays dense: the baseline compares FFNs at equal FFN cost, as the conversions do.

The sparsities are expectations over tokens: one token may zero more or fewer entries. TEAL's saving
needs a column-skipping kernel at decode (``runtime.moelab_teal.skip_rows`` on CPU) and is small at prefill, where a
batch of tokens reads every column some token needs (TEAL's "Hardware Aware Acceleration").
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from ..models import ModelAdapter, dense_weights
from ..progress import NO_PROGRESS, Progress
from ..runtime.moelab_teal import TealGLU, magnitude_sparsify
from .empty_module import dense_glu_module
from .fitting import CalibrationInputs

STEP = 0.05  # sparsity added per greedy step (TEAL's greedy also advances in fixed increments; 0.05 keeps a 30-layer model under a minute)
MAX_TOKENS = 512  # calibration tokens the greedy's error is measured on (the thresholds: all of them)
QUANTILE_SAMPLE = 1 << 18  # magnitudes the greedy's quantiles are read from (the final thresholds: all)

Allocation = Literal["uniform", "greedy"]


def teal_cost(s_in: float, s_mid: float) -> float:
    """FFN multiply-adds per token over the dense GLU's at input sparsity ``s_in`` and down-input ``s_mid``."""
    return (2 * (1 - s_in) + (1 - s_mid)) / 3


def quantile_threshold(magnitudes: torch.Tensor, s: float) -> float:
    """The threshold below which a fraction ``s`` of ``magnitudes`` (any shape) fall: the ``n+1``-th
    smallest, ``n = round(s·N)`` (a selection, not a sort: O(N)); 0 for ``n = 0``, so no magnitude, on
    these tokens or any other, falls below it; the largest float for ``n = N``."""
    flat = magnitudes.reshape(-1)
    n = int(round(s * flat.numel()))
    if n <= 0:
        return 0.0
    if n >= flat.numel():
        return float(torch.finfo(torch.float32).max)  # finite: a spec is JSON
    return float(flat.kthvalue(n + 1).values)


def sorted_sample(magnitudes: torch.Tensor, limit: int) -> torch.Tensor:
    """``magnitudes`` flattened and sorted, or a fixed random draw of ``limit`` of them (sorted) when
    there are more: the greedy's quantiles, a few hundred per layer, where a full selection each would
    cost as much as the products themselves."""
    flat = magnitudes.reshape(-1)
    if flat.numel() > limit:
        g = torch.Generator().manual_seed(0)
        flat = flat[torch.randint(flat.numel(), (limit,), generator=g).to(flat.device)]
    return flat.sort().values


def sorted_quantile(sorted_magnitudes: torch.Tensor, s: float) -> float:
    """``quantile_threshold`` read off ascending magnitudes."""
    n = int(round(s * len(sorted_magnitudes)))
    if n <= 0:
        return 0.0
    if n >= len(sorted_magnitudes):
        return float(torch.finfo(torch.float32).max)
    return float(sorted_magnitudes[n])


class _MlpProbe:
    """One dense GLU on calibration inputs ``x`` ``[T, d]``: the TEAL output error at any
    ``(s_in, s_mid)``, with thresholds from ``x`` itself (quantiles of at most ``QUANTILE_SAMPLE``
    magnitudes). The hidden state of the last few ``s_in`` is kept: the greedy asks for the same
    ``s_in`` with several ``s_mid``."""

    def __init__(self, x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor, act: str):
        from transformers.activations import ACT2FN

        self.x, self.gate_w, self.up_w, self.down_w = x, gate_w, up_w, down_w
        self.act_fn = ACT2FN[act]
        self.x_sorted = sorted_sample(x.abs(), QUANTILE_SAMPLE)
        self.y = self.glu(x) @ down_w.T
        self.y_norm = float(self.y.norm().clamp_min(torch.finfo(torch.float32).tiny))
        self._hidden: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}

    def glu(self, x: torch.Tensor) -> torch.Tensor:
        return self.act_fn(x @ self.gate_w.T) * (x @ self.up_w.T)

    def hidden(self, s_in: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, sorted sample of |h|)`` at input sparsity ``s_in``."""
        key = round(s_in, 12)
        if key not in self._hidden:
            if len(self._hidden) >= 3:  # the current s_in and its candidate are all the greedy reuses
                del self._hidden[next(iter(self._hidden))]
            h = self.glu(magnitude_sparsify(self.x, sorted_quantile(self.x_sorted, s_in)))
            self._hidden[key] = (h, sorted_sample(h.abs(), QUANTILE_SAMPLE))
        return self._hidden[key]

    def error(self, s_in: float, s_mid: float) -> float:
        """``‖F_teal(x) − F(x)‖ / ‖F(x)‖`` over all tokens of ``x``."""
        h, h_sorted = self.hidden(s_in)
        y = magnitude_sparsify(h, sorted_quantile(h_sorted, s_mid)) @ self.down_w.T
        return float((y - self.y).norm()) / self.y_norm


def greedy_sparsities(probe: _MlpProbe, cost: float, step: float = STEP) -> tuple[float, float]:
    """``(s_in, s_mid)`` of TEAL's greedy within one MLP (module docstring) at ``teal_cost == cost``."""
    s_in = s_mid = 0.0
    err = 0.0  # no sparsity: the dense output
    while (left := teal_cost(s_in, s_mid) - cost) > 1e-12:
        best: tuple[float, str, float, float] | None = None
        # the most of each a step may add: ``step``, what is left of the cost (s_in saves 2/3 per unit, s_mid 1/3), 1
        for which, d, per_unit in (("in", min(step, 1.5 * left, 1 - s_in), 2 / 3),
                                   ("mid", min(step, 3 * left, 1 - s_mid), 1 / 3)):
            if d <= 0:
                continue
            e = probe.error(s_in + d, s_mid) if which == "in" else probe.error(s_in, s_mid + d)
            rate = (e - err) / (d * per_unit)  # error added per unit of cost saved
            if best is None or rate < best[0]:
                best = (rate, which, d, e)
        if best is None:  # both at 1: nothing left to zero (cost 0)
            break
        _, which, d, err = best
        if which == "in":
            s_in += d
        else:
            s_mid += d
    return min(s_in, 1.0), min(s_mid, 1.0)


@torch.no_grad()
def teal_from_dense(gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor, act: str, t_in: float,
                    t_mid: float, s_in: float, s_mid: float, **extra: Any) -> TealGLU:
    """A ``TealGLU`` over the dense GLU's weights (copied as they are, then in its decode layout) with these
    thresholds and the sparsities they were calibrated at."""
    d_ffn, d_model = gate_w.shape
    spec = {"kind": "teal", "d_model": int(d_model), "d_ffn": int(d_ffn), "act": act, "t_in": float(t_in),
            "t_mid": float(t_mid), "s_in": float(s_in), "s_mid": float(s_mid), **extra}
    mod = dense_glu_module(TealGLU, spec, gate_w, up_w, down_w)
    mod.use_decode_layout()
    return mod


def calibrate_layer(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor, act: str,
                    cost: float, allocation: Allocation = "greedy", step: float = STEP,
                    max_tokens: int = MAX_TOKENS) -> TealGLU:
    """One MLP's ``TealGLU`` at ``cost`` (0…1) from its calibration inputs ``x`` ``[T, d]`` (module
    docstring). The module records ``calibration_error``: its relative output error on the subsample the
    greedy measured."""
    if not 0.0 <= cost <= 1.0:
        raise ValueError(f"cost {cost} must be in [0, 1]")
    if allocation not in ("uniform", "greedy"):
        raise ValueError(f"unknown TEAL allocation {allocation!r} (uniform or greedy)")
    if step <= 0:
        raise ValueError("the greedy step must be positive")
    x = x.to(device=gate_w.device, dtype=torch.float32)
    w = tuple(t.float() for t in (gate_w, up_w, down_w))
    every = max(1, math.ceil(len(x) / max_tokens))  # an even subsample: calibration text runs in windows
    probe = _MlpProbe(x[::every], *w, act)
    if allocation == "uniform":
        s_in = s_mid = 1.0 - cost
    else:
        s_in, s_mid = greedy_sparsities(probe, cost, step)
    # the final thresholds: exact quantiles over every calibration token
    t_in = quantile_threshold(x.abs(), s_in)
    t_mid = quantile_threshold(probe.glu(magnitude_sparsify(x, t_in)).abs(), s_mid)
    module = teal_from_dense(gate_w, up_w, down_w, act, t_in, t_mid, s_in, s_mid)
    with torch.no_grad():
        module.calibration_error = float((module(probe.x.to(gate_w.dtype)).float() - probe.y).norm()) / probe.y_norm
    return module


def teal_modules(adapter: ModelAdapter, inputs: CalibrationInputs, cost: float, allocation: Allocation = "greedy",
                 step: float = STEP, max_tokens: int = MAX_TOKENS, progress: Progress = NO_PROGRESS,
                 ) -> dict[int, TealGLU]:
    """Every layer's ``TealGLU`` at FFN cost ``cost`` (clamped to 0…1: a conversion's cost may exceed the
    dense FFN's only by its router), calibrated on ``inputs`` (``fitting.collect_inputs``). Each module's
    spec holds its ``s_in`` / ``s_mid``; ``calibration_error`` its relative output error (``teal_layers``)."""
    cost = min(1.0, max(0.0, float(cost)))
    out: dict[int, TealGLU] = {}
    for n, lay in enumerate(adapter.layers):
        out[lay.index] = calibrate_layer(inputs.mlp_inputs[lay.index], *dense_weights(adapter, lay.index),
                                         adapter.activation, cost, allocation, step, max_tokens)
        progress.update("teal: thresholds", n + 1, len(adapter.layers))
    return out


def teal_layers(modules: dict[int, TealGLU]) -> dict[str, list[float]]:
    """Per layer (in layer order) the calibrated ``s_in``, ``s_mid`` and calibration error, for a report."""
    order = sorted(modules)
    return {"layers": order, "s_in": [modules[i].s_in for i in order], "s_mid": [modules[i].s_mid for i in order],
            "calibration_error": [getattr(modules[i], "calibration_error", float("nan")) for i in order]}


def teal_flops_fraction(modules: dict[int, TealGLU], dense_ffn_macs: int) -> float:
    """The TEAL variant's ``ffn_flops_fraction``: its layers' multiply-adds over the dense FFN's (layers
    it does not replace count as dense)."""
    replaced = sum(3 * m.d_model * m.d_ffn for m in modules.values())
    return (sum(m.active_param_count() for m in modules.values()) + dense_ffn_macs - replaced) / dense_ffn_macs


def teal_thresholds(modules: dict[int, TealGLU]) -> dict[str, dict[str, float]]:
    """What rebuilds ``modules`` from the dense weights (``teal_from_thresholds``): per layer its
    thresholds, sparsities and calibration error."""
    return {str(i): {"t_in": m.t_in, "t_mid": m.t_mid, "s_in": m.s_in, "s_mid": m.s_mid,
                     "calibration_error": getattr(m, "calibration_error", float("nan"))} for i, m in modules.items()}


def teal_from_thresholds(adapter: ModelAdapter, layers: dict[str, dict[str, float]]) -> dict[int, TealGLU]:
    """The ``TealGLU`` modules ``teal_thresholds`` described, on ``adapter``'s dense weights: no calibration."""
    out: dict[int, TealGLU] = {}
    for key, t in layers.items():
        i = int(key)
        out[i] = teal_from_dense(*dense_weights(adapter, i), adapter.activation, t["t_in"], t["t_mid"], t["s_in"], t["s_mid"])
        out[i].calibration_error = t.get("calibration_error", float("nan"))
    return out
