"""The JSON of two profiles compared and of a neuron search, from opened profiles (numpy; no torch).

The numbers come from the engine (``moelab.engine.profiling.compare`` / ``search``); this module
chooses what goes into a payload of modest size: one layer's scatter (sampled beyond
``max_points`` neurons, keeping every specific one), the per-layer shares, and the top neurons of
each side with a few of their top-token snippets from each profile.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moelab.store.jsonsafe import jsonable

from . import charts


def scatter(lay: Any, threshold: float, max_points: int) -> dict[str, Any]:
    """One layer's (mean_A, mean_B, d) per neuron; beyond ``max_points`` neurons, the specific ones
    (largest |d| first) and a seeded uniform sample of the others, in neuron order."""
    n = len(lay.d)
    if n <= max_points:
        pick, sampled = np.arange(n), False
        note = f"all {n} neurons of layer {lay.layer}"
    else:
        strength = np.abs(lay.d)
        specific = np.flatnonzero(strength >= threshold)
        specific = specific[np.argsort(-strength[specific], kind="stable")][:max_points]
        rest = np.setdiff1d(np.arange(n), specific)
        fill = np.random.default_rng(0).choice(rest, size=min(rest.size, max_points - specific.size), replace=False)
        pick, sampled = np.sort(np.concatenate([specific, fill])), True
        note = (f"{pick.size} of {n} neurons of layer {lay.layer}: all {specific.size} drawn specific ones "
                f"(|d| ≥ {threshold:g}) and a seeded sample of the rest")
    return {"layer": lay.layer, "neurons": pick.tolist(), "mean_a": jsonable(lay.mean_a[pick].tolist()),
            "mean_b": jsonable(lay.mean_b[pick].tolist()), "specificity": jsonable(lay.d[pick].tolist()),
            "sampled": sampled, "note": note}


class Snippets:
    """A neuron's top-token snippets from one profile, reading each layer's top tokens once per payload."""

    def __init__(self, profile: Any, count: int) -> None:
        self.profile, self.count = profile, count
        self._layers: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def of(self, layer: int, neuron: int) -> list[dict[str, Any]]:
        if self.count <= 0 or not self.profile.has_top_tokens:
            return []
        if layer not in self._layers:
            self._layers[layer] = self.profile.top_tokens(layer)
        values, tokens = self._layers[layer]
        return charts.top_token_snippets(values[neuron][: self.count], tokens[neuron][: self.count],
                                         self.profile.tokens, self.profile.samples)


def _specific(row: dict[str, Any], a: Snippets, b: Snippets) -> dict[str, Any]:
    out = jsonable({k: v for k, v in row.items() if k != "d"})
    out["specificity"] = jsonable(row["d"])
    out["top_a"], out["top_b"] = a.of(row["layer"], row["neuron"]), b.of(row["layer"], row["neuron"])
    return out


def comparison_payload(ids: tuple[str, str], profiles: tuple[Any, Any], comparison: Any, layer: int | None,
                       threshold: float, fdr: float, top: int, snippets: int, max_points: int) -> dict[str, Any]:
    """The fields of ``schemas.ProfileComparison`` (``layer`` None: the layer with the largest share of specific neurons)."""
    shown = comparison.busiest_layer(threshold, fdr) if layer is None else layer
    shares = comparison.shares(threshold, fdr)
    a, b = (Snippets(p, snippets) for p in profiles)
    manifest = profiles[0].manifest
    keeps = [p.has_top_tokens for p in profiles]
    large, kept = (sum(s[f"n_large_{x}"] for s in shares for x in "ab"), sum(s[f"n_specific_{x}"] for s in shares for x in "ab"))
    note = (f"{comparison.n_samples[0]} samples of A against {comparison.n_samples[1]} of B; a neuron is specific when "
            f"|d| ≥ {threshold:g} and its Welch test survives Benjamini–Hochberg at q ≤ {fdr:g} ({kept} of the {large} "
            "neurons with that gap)")
    if snippets and not all(keeps):
        note += "; " + " and ".join(n for n, k in zip("AB", keeps, strict=True) if not k) + " keep no top tokens (re-profile to see snippets)"
    return {
        "a": ids[0], "b": ids[1], "model": (manifest.get("model") or {}).get("source"), "n_layers": len(comparison.layers),
        "d_ffn": comparison.d_ffn, "n_samples_a": comparison.n_samples[0], "n_samples_b": comparison.n_samples[1],
        "threshold": threshold, "fdr": fdr, "score": comparison.score, "layer": shown,
        "scatter": scatter(comparison.layers[shown], threshold, max_points), "layers": shares,
        "top_a": [_specific(r, a, b) for r in comparison.top(top, "a")],
        "top_b": [_specific(r, a, b) for r in comparison.top(top, "b")],
        "note": note,
    }


def search_note(total: int, shown: int, offset: int, sort: str, descending: bool, vs: str | None) -> str:
    """One line saying what the page holds."""
    line = f"{total} neuron{'s match' if total != 1 else ' matches'}; {shown} shown from {offset}, by {sort} {'descending' if descending else 'ascending'}"
    if vs:
        line += f"; specificity is d against profile {vs} (> 0: more active on this profile's text)"
    return line
