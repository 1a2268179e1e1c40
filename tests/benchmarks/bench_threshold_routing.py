"""Per-token numbers of experts (threshold routing) against a fixed top-k, at the same mean number.

Issue 27 asks whether letting each token run as many experts as its router scores call for, at the
same mean cost, generalises better than the fixed per-layer top-k ``--recipe best`` runs. This is
the layer-wise study that decides it before any runtime change: one ``--recipe best`` conversion
(ridge router, budget plan, skipped-expert means), built in process from ``--profile``; every
converted layer is fed the dense model's MLP inputs on the held-out text of each built-in domain,
and its output is compared with the dense FFN's, ``err = Σ‖y − ŷ‖² / Σ‖y‖²`` over the tokens.
ŷ = shared part + the selected experts + the calibration mean of every skipped expert (the
runtime's compensation). Selections, each run at the layer's own top-k ``k`` on average:

- ``topk``: the ``k`` best ridge scores of each token (what the runtime does);
- ``threshold``: every expert whose predicted mass (ridge score) is ≥ ``τ_ℓ``, ``τ_ℓ`` set on the
  profile's calibration tokens so that the mean count there is ``k`` (what a runtime would ship: on
  other text the mean count, and so the cost, drifts; it is reported);
- ``threshold@equal``: the same rule with ``τ_ℓ`` set on the scored text itself, so its mean count is
  exactly ``k`` there: the gain of a per-token count at equal cost, free of the drift;
- ``top_p``: the fewest best experts whose predicted mass reaches ``p_ℓ`` of the token's predicted
  total, ``p_ℓ`` set on the calibration tokens for a mean of ``k`` (a count that follows the shape of
  a token's scores, not their scale).

Writes ``results/bench_threshold_routing.json`` and prints one summary line: the error over the
layers (Σ over layers of the numerators over Σ of the denominators) of each selection per domain,
and the mean count of the calibrated rules against ``k``.

``--perplexity`` also scores both routings end to end on three held-out windows per domain, with each
converted layer's threshold set on the calibration inputs (``ThresholdRouted``), and reports the
count the threshold model actually ran on each text.

    python tests/benchmarks/bench_threshold_routing.py --profile runs/prof64 --sparsity 0.5
    python tests/benchmarks/bench_threshold_routing.py --profile runs/frontier_ldo/profile-without-code --perplexity
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from moelab.settings import get_settings  # noqa: E402
from moelab.engine.core.fitting import collect_inputs, profile_token_windows  # noqa: E402
from moelab.engine.core.slicing import expert_rows, partition_modules  # noqa: E402
from moelab.engine.evaluation.metrics import heldout_windows  # noqa: E402
from moelab.engine.methods import expertweaver, get_method  # noqa: E402
from moelab.engine.models import load_model  # noqa: E402
from moelab.engine.profiling.store import StoredProfile  # noqa: E402

OUT = ROOT / "tests" / "benchmarks" / "results" / "bench_threshold_routing.json"
DOMAINS = ("builtin:code", "builtin:prose", "builtin:literature", "builtin:chat")  # as bench_frontier scores


def expert_outputs(module: Any, x: torch.Tensor) -> torch.Tensor:
    """``[T, E, d]``: each routed expert's output on each token (sum combine: weights of 1)."""
    g, u, dn = (t.float() for t in expert_rows(module))
    h = module.act_fn(torch.einsum("td,emd->tem", x, g)) * torch.einsum("td,emd->tem", x, u)
    return torch.einsum("tem,edm->ted", h, dn)


def count_threshold(scores: torch.Tensor, k: int) -> float:
    """``τ`` such that ``scores ≥ τ`` keeps ``k`` entries per row on average."""
    flat = scores.flatten()
    n = max(1, min(flat.numel(), int(round(k * scores.shape[0]))))
    return float(flat.topk(n).values[-1])


def top_p_masks(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted order and each rank's cumulative share of the token's positive predicted mass, ``[T, E]``."""
    pos = scores.clamp_min(0)
    order = pos.argsort(dim=1, descending=True)
    share = pos.gather(1, order).cumsum(1) / pos.sum(1, keepdim=True).clamp_min(1e-12)
    return order, share


def top_p_select(scores: torch.Tensor, p: float) -> torch.Tensor:
    """Mask ``[T, E]``: the fewest best experts whose share of the predicted mass reaches ``p``."""
    order, share = top_p_masks(scores)
    before = torch.cat([torch.zeros_like(share[:, :1]), share[:, :-1]], 1)  # share before each rank
    keep_sorted = before < p
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


def top_p_for_count(scores: torch.Tensor, k: int) -> float:
    """``p`` whose top-p selection keeps ``k`` experts per token on average (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if top_p_select(scores, mid).sum(1).float().mean() < k:
            lo = mid
        else:
            hi = mid
    return hi


def layer_study(module: Any, dense_mlp: Any, calib_x: torch.Tensor, texts: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One layer: the calibrated thresholds, then each selection's error terms on each text."""
    k, E = module.top_k, module.n_routed
    with torch.no_grad():
        calib_scores = module.router(calib_x)[0].float()
        tau, p = count_threshold(calib_scores, k), top_p_for_count(calib_scores, k)
        mu = module.skip_mean.float() if module.compensated else torch.zeros(E, module.d_model)
        out: dict[str, Any] = {"top_k": k, "n_routed": E, "tau": tau, "p": p}
        for name, x in texts.items():
            y = dense_mlp(x).float()
            base = module._shared(x).float()
            contrib = expert_outputs(module, x) - mu  # selecting e adds its output and removes its mean
            base = base + mu.sum(0)
            scores = module.router(x)[0].float()
            masks = {"topk": torch.zeros_like(scores, dtype=torch.bool).scatter(1, scores.topk(k, dim=1).indices, True),
                     "threshold": scores >= tau,
                     "threshold@equal": scores >= count_threshold(scores, k),
                     "top_p": top_p_select(scores, p)}
            den = float(y.pow(2).sum())
            row = {"denominator": den}
            for sel, mask in masks.items():
                yhat = base + torch.einsum("te,ted->td", mask.float(), contrib)
                row[sel] = {"numerator": float((y - yhat).pow(2).sum()), "mean_count": float(mask.sum(1).float().mean())}
            out[name] = row
    return out


def open_profile_and_model(path: Path) -> tuple[Any, Any]:
    """The stored profile at ``path`` and its model, in float32."""
    profile = StoredProfile.open(path)
    return profile, load_model(profile.manifest["model"]["source"], data_dir=get_settings().data_dir, dtype="float32")


def study_routed_layers(adapter: Any, profile: Any, params: Any, calib_tokens: int, windows: int,
                        study: Any) -> tuple[dict[int, Any], Any, dict[int, Any]]:
    """One ``params`` conversion built in process from ``profile``; ``study(module, dense_mlp, calib_x,
    {domain: x})`` on every layer that drops experts, fed the dense model's MLP inputs on ``calib_tokens``
    of the profile's text and ``windows`` held-out windows of each domain. Returns the modules, the
    calibration inputs and the studies by layer."""
    data_dir = get_settings().data_dir
    _, _, modules, _ = partition_modules(adapter, profile, params, expertweaver.plan_for(profile, params),
                                         expertweaver.layer_builder(profile, params), data_dir=data_dir)
    calib = collect_inputs(adapter, profile_token_windows(adapter, profile, calib_tokens, data_dir))
    held = {dom: collect_inputs(adapter, heldout_windows(adapter.tokenizer, data_dir, n_windows=windows, source=dom))
            for dom in DOMAINS}
    layers = {}
    for lay in adapter.layers:
        m = modules.get(lay.index)
        if m is None or m.n_routed == 0 or m.top_k in (0, m.n_routed):
            continue  # nothing to choose, nothing dropped
        layers[lay.index] = study(m, lay.mlp, calib.mlp_inputs[lay.index],
                                  {dom: h.mlp_inputs[lay.index] for dom, h in held.items()})
    return modules, calib, layers


SELECTIONS = ("topk", "threshold", "threshold@equal", "top_p")


def summarize(layers: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    """Per domain and selection: ``error``, the geometric mean over layers of each layer's relative error
    (a sum over layers would let the few layers with massive outputs decide), and ``count_over_k``, the
    selections over the top-k slots summed over layers."""
    import math

    out: dict[str, Any] = {}
    for dom in DOMAINS:
        rel = {s: [r[dom][s]["numerator"] / r[dom]["denominator"] for r in layers.values()] for s in SELECTIONS}
        out[dom] = {s: {"error": math.exp(sum(math.log(max(v, 1e-30)) for v in rel[s]) / len(rel[s])),
                        "count_over_k": sum(r[dom][s]["mean_count"] for r in layers.values())
                        / sum(r["top_k"] for r in layers.values())} for s in SELECTIONS}
    return out


class ThresholdRouted(torch.nn.Module):
    """A converted layer run with threshold routing (``scores ≥ tau``) instead of its top-k: the experts
    of each token over the threshold (their weights 1, the sum combine), the rest compensated by their
    calibration means; counts the selections in ``counts`` (selected, top-k slots) to report the cost."""

    def __init__(self, module: Any, tau: float, counts: list[int]) -> None:
        super().__init__()
        self.m, self.tau, self.counts = module, tau, counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.m
        xt = x.reshape(-1, m.d_model)
        y = m._shared(xt)
        scores = m.router(xt)[0]
        over = scores >= self.tau
        self.counts[0] += int(over.sum())
        self.counts[1] += xt.shape[0] * m.top_k
        widest = int(over.sum(1).max())
        mu = m.skip_mean.sum(0) if m.compensated else 0
        if widest:
            top = scores.topk(widest, dim=1).indices
            keep = over.gather(1, top).to(xt.dtype)  # a token with fewer experts pads with weight-0 slots
            y = y + m.experts(xt, top, keep, None)
            if m.compensated:
                mu = mu - (m.skip_mean[top] * keep[..., None]).sum(1)
        return (y + mu).reshape(x.shape)


def perplexities(adapter: Any, modules: dict[int, Any], calib: Any, windows: dict[str, torch.Tensor]) -> dict[str, Any]:
    """End to end, per domain: perplexity over dense of the top-k model and of the threshold-routed one
    (``tau`` per layer set on the calibration inputs for a mean count of the layer's top-k), and the
    threshold model's measured count over top-k on that text (its cost drifts where top-k's cannot)."""
    from moelab.engine.evaluation.metrics import evaluate_variants

    counts = [0, 0]
    routed = {}
    for i, m in modules.items():
        if m.n_routed == 0 or m.top_k in (0, m.n_routed):
            routed[i] = m
            continue
        with torch.no_grad():
            tau = count_threshold(m.router(calib.mlp_inputs[i][:4096])[0].float(), m.top_k)
        routed[i] = ThresholdRouted(m, tau, counts)
    out = {}
    for dom, w in windows.items():
        counts[:] = [0, 0]
        r = evaluate_variants(adapter, {"dense": None, "topk": modules, "threshold": routed}, w, reconstruction=False)
        out[dom] = {"topk": r["topk"]["perplexity_ratio"], "threshold": r["threshold"]["perplexity_ratio"],
                    "threshold_count_over_k": counts[0] / max(1, counts[1])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", type=Path, default=ROOT / "runs" / "p1")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--n-experts", type=int, default=None)
    ap.add_argument("--windows", type=int, default=4, help="held-out windows of 256 tokens per domain")
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--perplexity", action="store_true", help="also score both routings end to end (3 windows per domain)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    t0 = time.perf_counter()
    data_dir = get_settings().data_dir
    profile, adapter = open_profile_and_model(args.profile)
    # whole experts: what this study models
    params = replace(get_method("expertweaver").recipe("best", sparsity=args.sparsity), down_keep=1.0)
    if args.n_experts:
        params = replace(params, n_experts=args.n_experts)
    modules, calib, layers = study_routed_layers(adapter, profile, params, args.calib_tokens, args.windows, layer_study)
    summary = summarize(layers)
    if args.perplexity:
        ppl_windows = {dom: heldout_windows(adapter.tokenizer, data_dir, seq_len=256, n_windows=3, source=dom) for dom in DOMAINS}
        end_to_end = perplexities(adapter, modules, calib, ppl_windows)
    report = {"profile": str(args.profile), "calibration": profile.manifest["calibration"].get("source"),
              "params": params.to_dict(), "windows": args.windows, "calib_tokens": args.calib_tokens,
              "summary": summary, "perplexity": end_to_end if args.perplexity else None, "layers": layers, "seconds": time.perf_counter() - t0}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(args.out)
    print("bench_threshold_routing: FFN error (geomean over layers; count / k) per domain: " + "; ".join(
        f"{dom.split(':')[1]} " + ", ".join(f"{s} {v['error']:.3f} ({v['count_over_k']:.2f})" for s, v in row.items())
        for dom, row in summary.items()))


if __name__ == "__main__":
    main()
