"""Matched experts across two conversions (the Routing explorer and the Token routing page)."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from .common import _arr, _layout
from .routing import routing_share


def matched_layer(matching: dict[str, Any] | None, layer: int) -> dict[str, Any] | None:
    """The matching payload's entry of ``layer`` (None: not matched, e.g. skipped or no matching)."""
    return next((m for m in (matching or {}).get("layers") or [] if m["layer"] == layer), None)


def skipped_reason(matching: dict[str, Any] | None, layer: int) -> str | None:
    return next((s["reason"] for s in (matching or {}).get("skipped") or [] if s["layer"] == layer), None)


def matched_label(entry: dict[str, Any], side: str, expert: int) -> str:
    """'B e7 ≙ A e3 (J=0.62)' (``side`` "b"; "a": 'A e3 ≙ B e7 (J=0.62)'), or why it has no match."""
    own, other = side.upper(), "B" if side == "a" else "A"
    e = entry[side][expert]
    if e["match"] is not None:
        return f"{own} e{expert} ≙ {other} e{e['match']} (J={e['jaccard']:.2f})"
    if e["best"] is not None:
        return f"{own} e{expert}, unmatched (most overlap: {other} e{e['best']}, J={e['best_jaccard']:.2f})"
    return f"{own} e{expert}, unmatched (no common neuron with any expert of {other})"


def best_match_text(entry: dict[str, Any], side: str, expert: int) -> str:
    """An expert card's line: its best match in the other conversion and its assigned one."""
    other = "B" if side == "a" else "A"
    e = entry[side][expert]
    best = (f"best match in {other}: e{e['best']} (Jaccard {e['best_jaccard']:.2f} of their neurons)" if e["best"] is not None
            else f"no neuron in common with any expert of {other}")
    assigned = (f"; matched to {other} e{e['match']} (J={e['jaccard']:.2f})" if e["match"] is not None and e["match"] != e["best"]
                else "")
    return best + assigned + f"; layer's mean matched Jaccard {entry['mean_jaccard']:.2f}"


def matched_colour_ids(entry: dict[str, Any]) -> dict[int, int]:
    """B expert -> the colour index it is drawn with: its matched A expert's id (same colour as in A),
    unmatched B experts the indices after A's experts (colours A does not use)."""
    out = {e["expert"]: e["match"] for e in entry["b"] if e["match"] is not None}
    spare = iter(range(entry["n_a"], entry["n_a"] + entry["n_b"]))
    out.update({e["expert"]: next(spare) for e in entry["b"] if e["match"] is None})
    return out


def expert_overlap(entry: dict[str, Any]) -> go.Figure:
    """Jaccard of every (A expert, B expert) pair of one layer, B's columns in A's matched order (the
    matched pairs on the diagonal), each cell labelled with both ids."""
    j = _arr(entry["jaccard"]).reshape(entry["n_a"], entry["n_b"])
    cols = [a["match"] for a in entry["a"] if a["match"] is not None]
    cols += [b["expert"] for b in entry["b"] if b["match"] is None]
    z = j[:, cols] if cols else j
    text = [[f"A e{i} × B e{c}: J={z[i, k]:.2f}" + (" (matched)" if entry["a"][i]["match"] == c else "")
             for k, c in enumerate(cols)] for i in range(entry["n_a"])]
    x = [matched_label(entry, "b", c) for c in cols]
    fig = go.Figure(go.Heatmap(z=z, x=x, y=[f"A e{i}" for i in range(entry["n_a"])], colorscale="Blues", zmin=0, zmax=1,
                               colorbar={"title": "Jaccard"}, text=text, texttemplate="%{z:.2f}", hovertemplate="%{text}<extra></extra>"))
    shared = entry.get("shared_jaccard")
    note = (f"mean matched Jaccard {entry['mean_jaccard']:.2f}; shared experts' Jaccard "
            + ("n/a" if shared is None else f"{shared:.2f}") + f" ({entry['shared_sizes'][0]} vs {entry['shared_sizes'][1]} neurons)")
    return _layout(fig, f"Layer {entry['layer']}: overlap of A's and B's experts (Jaccard of neuron sets)", note,
                   yaxis_autorange="reversed", xaxis_tickangle=-30)


def matching_by_layer(matching: dict[str, Any]) -> go.Figure:
    """Layer × A's expert: the Jaccard of the B expert matched to it (the cell says which); skipped
    layers are blank rows whose hover says why."""
    layers = sorted([m["layer"] for m in matching["layers"]] + [s["layer"] for s in matching["skipped"]])
    width = max([m["n_a"] for m in matching["layers"]] or [1])
    z = np.full((len(layers), width), np.nan)
    text = [[""] * width for _ in layers]
    hover = [[skipped_reason(matching, layer) or "" for _ in range(width)] for layer in layers]
    for m in matching["layers"]:
        li = layers.index(m["layer"])
        for e in m["a"]:
            z[li, e["expert"]] = e["jaccard"] if e["jaccard"] is not None else np.nan
            text[li][e["expert"]] = f"B e{e['match']}" if e["match"] is not None else "–"
            hover[li][e["expert"]] = f"layer {m['layer']}: {matched_label(m, 'a', e['expert'])}; {best_match_text(m, 'a', e['expert'])}"
    fig = go.Figure(go.Heatmap(z=z, x=list(range(width)), y=layers, colorscale="Blues", zmin=0, zmax=1, colorbar={"title": "Jaccard"},
                               text=text, texttemplate="%{text}", customdata=hover, hovertemplate="%{customdata}<extra></extra>",
                               hoverongaps=True))
    note = f"A = {matching['a']}, B = {matching['b']}; cell: B's expert matched to A's (same neurons ⇒ J = 1)"
    return _layout(fig, "Experts matched across conversions", note, xaxis_title="expert of A", yaxis_title="layer")


def routing_at_matched_ids(heat: dict[str, Any], matching: dict[str, Any], set_index: int = 0) -> go.Figure:
    """Conversion B's layer × expert token share with every B expert drawn in the column of the A
    expert it is matched to; B's unmatched experts follow A's columns. Hover names both ids."""
    share = routing_share(heat)[set_index]
    entries = {m["layer"]: m for m in matching["layers"]}
    width = max([m["n_a"] + sum(b["match"] is None for b in m["b"]) for m in entries.values()] or [heat["n_experts"]])
    z = np.full((len(heat["layers"]), width), np.nan)
    hover = [[""] * width for _ in heat["layers"]]
    for li, layer in enumerate(heat["layers"]):
        entry = entries.get(layer)
        if entry is None:
            hover[li] = [f"layer {layer}: {skipped_reason(matching, layer) or 'not matched'}"] * width
            continue
        for b, col in matched_colour_ids(entry).items():  # the column: A's matched id, or a spare one after A's
            if b < share.shape[1]:
                z[li, col] = share[li, b]
                hover[li][col] = f"layer {layer}: {matched_label(entry, 'b', b)}: share {share[li, b]:.4f}"
    fig = go.Figure(go.Heatmap(z=z, x=list(range(width)), y=heat["layers"], colorscale="Viridis", zmin=0, colorbar={"title": "share"},
                               customdata=hover, hovertemplate="%{customdata}<extra></extra>", hoverongaps=True))
    note = "B's experts at the ids of A's experts they are matched to (columns beyond A's: B's unmatched experts)"
    return _layout(fig, f"Conversion B on {heat['sets'][set_index]}, at A's expert ids", note, xaxis_title="expert (A's ids)",
                   yaxis_title="layer")
