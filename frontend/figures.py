"""Plotly figures as pure functions of the API's chart JSON (no I/O, no Dash).

Each builder takes the dict an endpoint returned (or plain arrays) and returns a
``go.Figure``; :func:`table` turns the same payload into rows for the CSV download. Heatmaps
are plain ``go.Heatmap`` (never heatmapgl): the API already tiles big maps, and the figure's
title carries its ``note`` when it did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go

TEMPLATE = "plotly_white"


def _arr(values: Any) -> np.ndarray:
    """JSON lists with ``None`` for NaN → float array."""
    return np.array(values, dtype=float) if values is not None else np.array([], dtype=float)


def _layout(fig: go.Figure, title: str, note: str | None = None, **kw: Any) -> go.Figure:
    text = title if not note else f"{title}<br><sup>{note}</sup>"
    fig.update_layout(title={"text": text}, template=TEMPLATE, margin={"l": 60, "r": 20, "t": 70, "b": 50}, **kw)
    for axis in ("xaxis", "yaxis"):  # layer and expert axes are integers
        if str(kw.get(f"{axis}_title", "")).split(" ")[0] in ("layer", "expert"):
            fig.update_layout({axis: {"dtick": 1}})
    return fig


def message_figure(text: str) -> go.Figure:
    """An empty figure that says why it is empty (errors are shown in words)."""
    fig = go.Figure()
    fig.add_annotation(text=text, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False, font={"size": 14})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, "")


# --------------------------------------------------------------------------- CV (EW Eq. 3, Fig. 2)


def cv_histogram(data: dict[str, Any], layer: int) -> go.Figure:
    """Histogram of one layer's neuron CV on the server's shared bins; overflow said in the title."""
    edges = _arr(data["edges"])
    counts = np.asarray(data["counts"][layer])
    centers = (edges[:-1] + edges[1:]) / 2
    fig = go.Figure(go.Bar(x=centers, y=counts, width=np.diff(edges), name=f"layer {layer}", marker_line_width=0))
    extra = data["overflow"][layer]
    note = f"{data['n_neurons'][layer]} neurons; {extra} above {data['clipped_at']:.3g} not shown"
    return _layout(fig, f"Neuron CV, layer {layer}", note, xaxis_title="CV across tasks", yaxis_title="neurons", bargap=0)


def cv_by_layer(summary: dict[str, Any]) -> go.Figure:
    """EW Fig. 2: CV by layer as boxes from the server's quantiles (5/25/50/75/95 %) and the mean."""
    q = _arr(summary["values"])
    layers = summary["layers"]
    quantiles = list(summary["quantiles"])
    col = {v: i for i, v in enumerate(quantiles)}
    fig = go.Figure(go.Box(
        x=layers, q1=q[:, col[0.25]], median=q[:, col[0.5]], q3=q[:, col[0.75]],
        lowerfence=q[:, col[0.05]], upperfence=q[:, col[0.95]], mean=_arr(summary["mean"]), name="CV",
        boxpoints=False,
    ))
    if summary.get("tau") is not None:
        fig.add_hline(y=summary["tau"], line_dash="dash", line_color="firebrick", annotation_text=f"τ = {summary['tau']:g}")
    return _layout(fig, "Neuron CV by layer (EW Fig. 2)", "whiskers: 5 % and 95 % quantiles", xaxis_title="layer", yaxis_title="CV")


def specialisation_ratio(summary: dict[str, Any]) -> go.Figure:
    """r_ℓ (EW Eq. 4) per layer for the summary's τ."""
    r = summary.get("specialisation_ratio") or []
    fig = go.Figure(go.Scatter(x=summary["layers"], y=r, mode="lines+markers", name="r_ℓ"))
    return _layout(fig, f"Specialisation ratio r_ℓ (τ = {summary.get('tau')})", None, xaxis_title="layer", yaxis_title="share CV > τ", yaxis_range=[0, 1])


# --------------------------------------------------------------------------- neuron × task (EW Fig. 1)


def activation_heatmap(tiles: dict[str, Any]) -> go.Figure:
    """EW Fig. 1a: rows (tasks) × neurons (in the server's order), tiles when aggregated."""
    z = _arr(tiles["values"])
    x = tiles["column_first_neuron"]
    fig = go.Figure(go.Heatmap(
        z=z, y=tiles["rows"], x=list(range(len(x))), customdata=np.tile(np.asarray(x), (z.shape[0], 1)) if z.size else None,
        colorscale="RdBu", zmid=0, colorbar={"title": "mean act."},
        hovertemplate="row %{y}<br>column %{x} (first neuron %{customdata})<br>value %{z:.4f}<extra></extra>",
    ))
    note = ("aggregated server-side: " + tiles["note"]) if tiles.get("aggregated") else tiles.get("note")
    return _layout(fig, f"Neuron × task activations, layer {tiles['layer']} (order: {tiles['neuron_order']})", note,
                   xaxis_title="neuron column", yaxis_title="task")


def neuron_profile(tiles: dict[str, Any], column: int) -> go.Figure:
    """One neuron column's value on every row (clicked on the heatmap)."""
    z = _arr(tiles["values"])
    first = tiles["column_first_neuron"][column]
    label = f"neuron {first}" if tiles.get("neurons_per_column", 1) == 1 else f"neurons from {first} ({tiles['neurons_per_column']} averaged)"
    fig = go.Figure(go.Bar(x=tiles["rows"], y=z[:, column]))
    return _layout(fig, f"Per-task profile: {label}", None, xaxis_title="task", yaxis_title="mean activation")


def task_similarity(data: dict[str, Any]) -> go.Figure:
    """EW Fig. 1b: task × task cosine similarity of activation patterns."""
    fig = go.Figure(go.Heatmap(z=_arr(data["matrix"]), x=data["labels"], y=data["labels"], colorscale="Viridis",
                               colorbar={"title": "cosine"}))
    centered = "centred per neuron" if data.get("centered") else "raw"
    note = f"{centered}; {data['note']}" if data.get("note") != "full resolution" else centered
    return _layout(fig, "Task × task activation similarity (EW Fig. 1b)", note)


def value_histogram(values: Sequence[float], title: str, xaxis: str, bins: int = 40) -> go.Figure:
    """Histogram of any per-neuron statistic (activation rate, CM Fig. 2; h-values)."""
    v = _arr(list(values))
    v = v[np.isfinite(v)]
    if v.size == 0:
        return message_figure(f"{title}: no finite value")
    counts, edges = np.histogram(v, bins=bins)
    centers = (edges[:-1] + edges[1:]) / 2
    fig = go.Figure(go.Bar(x=centers, y=counts, width=np.diff(edges), marker_line_width=0))
    return _layout(fig, title, f"{v.size} neurons, {bins} bins", xaxis_title=xaxis, yaxis_title="neurons", bargap=0)


def binned_histogram(edges: Sequence[float], counts: Sequence[int], title: str, xaxis: str, yaxis: str, note: str | None = None) -> go.Figure:
    """A histogram whose bins the server chose (edges + counts)."""
    e = _arr(list(edges))
    centers = (e[:-1] + e[1:]) / 2
    fig = go.Figure(go.Bar(x=centers, y=list(counts), width=np.diff(e), marker_line_width=0))
    return _layout(fig, title, note, xaxis_title=xaxis, yaxis_title=yaxis, bargap=0)


def activation_rate_histogram(stats: dict[str, Any]) -> go.Figure:
    """CM Fig. 2: how often each neuron is among a token's ATopK markers (CM Eq. 4)."""
    return binned_histogram(stats["rate_edges"], stats["rate_counts"], f"Activation rate, layer {stats['layer']} (CM Fig. 2)",
                            "share of tokens with the neuron in the ATopK set", "neurons",
                            f"{stats['n_neurons']} neurons, mean rate {stats['rate_mean']:.3g}")


def h_value_histogram(stats: dict[str, Any]) -> go.Figure:
    """Token-level gate activations h of the layer, with what fell outside the stored range."""
    return binned_histogram(stats["h_edges"], stats["h_counts"], f"h values, layer {stats['layer']}", "h = act(x·W_gate) ⊙ x·W_up",
                            "token × neuron values", f"{stats['h_below']} below and {stats['h_above']} above the range not shown")


# --------------------------------------------------------------------------- layer similarity (D2 Fig. 3)


def blocks(first: int, last: int) -> str:
    """'block 4' or 'blocks 4–8'."""
    return f"block {first}" if first == last else f"blocks {first}–{last}"


def fusion_outline(data: dict[str, Any]) -> tuple[int, int] | None:
    """The (l*, l*+n*) block a Dense2MoE conversion fuses, as the API's ``fusion`` says (the engine's
    ``choose_fusion``; never recomputed here), or None when the conversion would be refused."""
    f = data.get("fusion")
    return (int(f["layer"]), int(f["layer"]) + int(f["n_fused"])) if f else None


def layer_similarity(data: dict[str, Any], which: str = "S_L") -> go.Figure:
    """D2 Fig. 3: S_L or S_M heatmap, with the block l* … l*+n* a Dense2MoE conversion fuses outlined
    (the compared cell [l*, l*+n*] marked): exactly the API's ``fusion``."""
    z = _arr(data[which])
    layers = data["layers"]
    fig = go.Figure(go.Heatmap(z=z, x=layers, y=layers, colorscale="Blues", zmin=min(0.0, np.nanmin(z)) if z.size else 0, zmax=1,
                               colorbar={"title": "cosine"}))
    block = fusion_outline(data)
    note = None
    if block is not None:
        lo, hi = block
        fig.add_shape(type="rect", x0=lo - 0.5, x1=hi + 0.5, y0=lo - 0.5, y1=hi + 0.5, name="fusion",
                      line={"color": "firebrick", "width": 2})
        fig.add_shape(type="rect", x0=hi - 0.5, x1=hi + 0.5, y0=lo - 0.5, y1=lo + 0.5, name="fusion-pair",
                      line={"color": "firebrick", "width": 3, "dash": "dot"})
        f = data["fusion"]
        value = f["s_layer"] if which == "S_L" else f["s_mlp"]
        test = f"< δ = {f['delta']:g}" if f.get("rank") is not None else "(l*, n* given: no δ test)"
        note = (f"fused: l* = {lo}, n* = {hi - lo} ({blocks(lo + 1, hi)} pruned); {which}[{lo}, {hi}] = {value:.4f}, "
                f"MLP-input distance {1 - f['s_mlp']:.4f} {test}")
    elif data.get("fusion_error"):
        note = "no fusion outlined: a conversion with these parameters is refused"
    name = "decoder outputs S_L (D2 Eq. 4)" if which == "S_L" else "MLP inputs S_M (D2 Eq. 5)"
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, f"Layer similarity of {name}", note, xaxis_title="layer", yaxis_title="layer")


# --------------------------------------------------------------------------- allocation (EW Fig. 7)


def allocation_plan(preview: dict[str, Any]) -> go.Figure:
    """EW Fig. 7: neurons per layer split into shared / routed-active / routed-idle, with r_ℓ on a 2nd axis."""
    rows = preview["layers"]
    layers = [r["layer"] for r in rows]
    shared = np.array([r["d_shared"] for r in rows])
    routed_active = np.array([r["top_k"] * r["d_expert"] for r in rows])
    d_ffn = np.array([r["d_ffn"] for r in rows])
    idle = d_ffn - shared - routed_active
    fig = go.Figure()
    fig.add_bar(x=layers, y=shared / d_ffn, name="shared (always on)", marker_color="#1f77b4")
    fig.add_bar(x=layers, y=routed_active / d_ffn, name="routed, active per token", marker_color="#ff7f0e")
    fig.add_bar(x=layers, y=idle / d_ffn, name="routed, idle per token", marker_color="#d3d3d3")
    r = [row.get("r") for row in rows]
    if any(v is not None and np.isfinite(v) for v in r):
        fig.add_scatter(x=layers, y=r, name="r_ℓ (EW Eq. 4)", mode="lines+markers", yaxis="y2", line={"color": "black"})
    clamped = [row["layer"] for row in rows if row.get("clamped")]
    static = [row["layer"] for row in rows if row.get("static")]
    s = preview.get("summary", {})
    note = f"active {s.get('active_fraction', float('nan')):.1%} of FFN neurons"
    if clamped:
        note += f"; CLAMPED layers {clamped} (Eq. 6 asked for more shared experts than the active budget)"
    if static:
        note += f"; STATIC layers {static} (no routed expert runs: a fixed prune)"
    fig.update_layout(barmode="stack", yaxis={"title": "share of d_ffn", "range": [0, 1]},
                      yaxis2={"title": "r_ℓ", "overlaying": "y", "side": "right", "range": [0, 1]},
                      legend={"orientation": "h", "y": -0.2})
    return _layout(fig, "Per-layer shared / routed plan (EW Fig. 7)", note, xaxis_title="layer")


# --------------------------------------------------------------------------- routing (EW Fig. 8, MI Figs. 3–4)


def routing_share(heat: dict[str, Any]) -> np.ndarray:
    return _arr(heat["share"]).reshape(len(heat["sets"]), len(heat["layers"]), heat["n_experts"])


def routing_heatmap(heat: dict[str, Any], set_index: int, zmax: float | None = None) -> go.Figure:
    """Layer × expert token share on one set."""
    share = routing_share(heat)[set_index]
    fig = go.Figure(go.Heatmap(z=share, x=list(range(heat["n_experts"])), y=heat["layers"], colorscale="Viridis", zmin=0,
                               zmax=zmax, colorbar={"title": "share"}))
    return _layout(fig, f"Routing on {heat['sets'][set_index]}", "share of each layer's routed selections per expert",
                   xaxis_title="expert", yaxis_title="layer")


def routing_difference(heat: dict[str, Any], a: int, b: int) -> go.Figure:
    share = routing_share(heat)
    diff = share[a] - share[b]
    m = float(np.nanmax(np.abs(diff))) if np.isfinite(diff).any() else 1.0
    fig = go.Figure(go.Heatmap(z=diff, x=list(range(heat["n_experts"])), y=heat["layers"], colorscale="RdBu", zmid=0,
                               zmin=-m, zmax=m, colorbar={"title": "Δ share"}))
    return _layout(fig, f"Difference: {heat['sets'][a]} − {heat['sets'][b]}", None, xaxis_title="expert", yaxis_title="layer")


def js_divergence(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Jensen–Shannon divergence (bits) row by row; NaN rows (static layers) stay NaN."""
    p = np.asarray(p, dtype=float)
    q = np.asarray(q, dtype=float)
    bad = ~(np.isfinite(p).all(axis=-1) & np.isfinite(q).all(axis=-1))
    p = np.nan_to_num(p)
    q = np.nan_to_num(q)
    p = p / np.where(p.sum(-1, keepdims=True) > 0, p.sum(-1, keepdims=True), 1)
    q = q / np.where(q.sum(-1, keepdims=True) > 0, q.sum(-1, keepdims=True), 1)
    m = (p + q) / 2

    def kl(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(x > 0, x * np.log2(x / np.where(y > 0, y, 1)), 0.0)
        return t.sum(-1)

    out = 0.5 * kl(p, m) + 0.5 * kl(q, m)
    return np.where(bad, np.nan, out)


def routing_js_line(heat: dict[str, Any], a: int, b: int) -> go.Figure:
    share = routing_share(heat)
    js = js_divergence(share[a], share[b])
    fig = go.Figure(go.Scatter(x=heat["layers"], y=js, mode="lines+markers", name="JS divergence"))
    return _layout(fig, f"Jensen–Shannon divergence per layer: {heat['sets'][a]} vs {heat['sets'][b]}", "bits; 0 = same routing, 1 = disjoint",
                   xaxis_title="layer", yaxis_title="JS (bits)", yaxis_range=[0, 1])


def load_cv_by_layer(heat: dict[str, Any]) -> go.Figure:
    """MI Fig. 3: load CV (MI Eq. 7) per layer, one line per set."""
    cv = _arr(heat["load_cv"]).reshape(len(heat["sets"]), len(heat["layers"]))
    fig = go.Figure([go.Scatter(x=heat["layers"], y=cv[i], mode="lines+markers", name=name) for i, name in enumerate(heat["sets"])])
    return _layout(fig, "Expert load CV by layer (MI Fig. 3)", "0 = perfectly balanced", xaxis_title="layer", yaxis_title="load CV")


def compare_perplexity(rows: list[dict[str, Any]]) -> go.Figure:
    """Perplexity per conversion and variant (dense, converted, baselines); rows: {conversion, variant, perplexity}."""
    variants = sorted({r["variant"] for r in rows})
    fig = go.Figure([go.Bar(name=v, x=[r["conversion"] for r in rows if r["variant"] == v],
                            y=[r["perplexity"] for r in rows if r["variant"] == v]) for v in variants])
    fig.update_layout(barmode="group")
    return _layout(fig, "Perplexity: dense vs converted vs baselines", None, yaxis_title="perplexity")


def quality_vs_cost(points: list[dict[str, Any]]) -> go.Figure:
    """Perplexity over dense against FFN cost, one series per held-out text (ratios are only
    comparable on the same text); points: {label, text, ffn_flops_fraction, perplexity_ratio}."""
    points = [p for p in points if p.get("ffn_flops_fraction") is not None and p.get("perplexity_ratio") is not None]
    if not points:
        return message_figure("no evaluated conversion with a recorded ffn_flops_fraction")
    texts = sorted({p["text"] for p in points})
    traces = []
    for t in texts:
        pts = sorted((p for p in points if p["text"] == t), key=lambda p: p["ffn_flops_fraction"])
        traces.append(go.Scatter(
            x=[p["ffn_flops_fraction"] for p in pts], y=[p["perplexity_ratio"] for p in pts], mode="markers+text",
            text=[p["label"] for p in pts], textposition="top center", name=t,
            hovertemplate="%{text}<br>cost %{x:.3f} of dense FFN<br>%{y:.2f}× dense perplexity<extra>" + t + "</extra>"))
    fig = go.Figure(traces)
    fig.add_hline(y=1, line_dash="dot", line_color="gray")
    return _layout(fig, "Quality vs cost", "lower-left is better; compare points measured on the same text only",
                   xaxis_title="ffn_flops_fraction (FFN multiply-adds per token, router included, / dense)",
                   yaxis_title="perplexity / dense", yaxis_type="log")


def reconstruction_error(report: dict[str, Any]) -> go.Figure:
    """Per-layer FFN reconstruction error of each variant, from an evaluation report (``evaluation.json``)."""
    traces = []
    for name, result in (report.get("results") or {}).items():
        err = result.get("reconstruction_error")
        if isinstance(err, dict):
            err = [err[k] for k in sorted(err, key=int)]
        if err:
            traces.append(go.Scatter(x=list(range(len(err))), y=err, mode="lines+markers", name=name))
    if not traces:
        return message_figure("this evaluation has no per-layer reconstruction error")
    return _layout(go.Figure(traces), "Per-layer FFN reconstruction error", "relative error of the MoE FFN output vs the dense FFN",
                   xaxis_title="layer", yaxis_title="error")


def compare_active(plans: dict[str, list[dict[str, Any]]]) -> go.Figure:
    """Active fraction per layer of several conversions' plans."""
    fig = go.Figure([go.Scatter(x=[r["layer"] for r in rows], y=[r.get("active_fraction") for r in rows], mode="lines+markers", name=name)
                     for name, rows in plans.items()])
    return _layout(fig, "Active share of FFN neurons per layer", None, xaxis_title="layer", yaxis_title="active fraction")


# --------------------------------------------------------------------------- recovery fine-tuning


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) else "?"


def finetune_summary_text(log: dict[str, Any]) -> str | None:
    """'perplexity 41.25 → 18.30 (dense 12.00)' once the trainer measured it; None before."""
    before, after, dense = log.get("perplexity_before"), log.get("perplexity_after"), log.get("dense_perplexity")
    if before is None and after is None:
        return None
    text = f"perplexity {_fmt(before)} → {_fmt(after) if after is not None else '…'}"
    return text + (f" (dense {_fmt(dense)})" if dense is not None else "")


def finetune_loss(log: dict[str, Any]) -> go.Figure:
    """Training curve of a fine-tune (the ``/finetunes/{id}/log`` payload): total loss
    L_NTP + λ·L_LB (EW Eq. 12) and next-token loss on the left axis, the load-balancing loss
    L_LB on the right one (its scale differs by orders of magnitude); a dashed line where a
    re-run resumed from a checkpoint."""
    steps = log.get("steps") or []
    if not steps:
        state = log.get("state") or "queued"
        return message_figure(f"no training step logged yet (job {state})")
    x = [s["step"] for s in steps]
    traces = [go.Scatter(x=x, y=[s.get("loss") for s in steps], mode="lines+markers", name="loss (total)")]
    if any(s.get("ntp_loss") is not None and s.get("ntp_loss") != s.get("loss") for s in steps):
        traces.append(go.Scatter(x=x, y=[s.get("ntp_loss") for s in steps], mode="lines", name="next-token loss", line={"dash": "dot"}))
    if any(s.get("aux_loss") is not None for s in steps):
        traces.append(go.Scatter(x=x, y=[s.get("aux_loss") for s in steps], mode="lines", name="aux loss L_LB", yaxis="y2"))
    notes = [f"{log.get('n_steps', len(steps))}/{log.get('total_steps', '?')} steps"]
    if log.get("aggregated"):
        notes.append("points are bucket means of consecutive steps (aggregated server-side)")
    if summary := finetune_summary_text(log):
        notes.append(summary)
    fig = _layout(go.Figure(traces), f"Fine-tuning loss ({log.get('mode') or '?'})", "; ".join(notes),
                  xaxis_title="step", yaxis_title="loss", legend={"orientation": "h", "y": -0.2})
    fig.update_layout(yaxis2={"title": "aux loss", "overlaying": "y", "side": "right", "showgrid": False})
    for at in log.get("resumed_at") or []:  # where a re-run continued from a checkpoint
        fig.add_vline(x=at, line_dash="dash", line_color="gray", annotation_text=f"resumed at {at}")
    return fig


# --------------------------------------------------------------------------- CSV rows of each figure's data


def table(kind: str, data: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
    """Long-format rows (for CSV) of a chart payload."""
    if kind == "cv-histogram":
        edges = data["edges"]
        return [{"layer": layer, "bin_lo": edges[i], "bin_hi": edges[i + 1], "count": c}
                for layer, counts in zip(data["layers"], data["counts"], strict=True) for i, c in enumerate(counts)]
    if kind == "cv-summary":
        return [{"layer": layer, **{f"q{q:g}": v for q, v in zip(data["quantiles"], vals, strict=True)}, "mean": m,
                 "r": (data.get("specialisation_ratio") or [None] * len(data["layers"]))[i]}
                for i, (layer, vals, m) in enumerate(zip(data["layers"], data["values"], data["mean"], strict=True))]
    if kind == "activations":
        return [{"row": r, "column": j, "first_neuron": data["column_first_neuron"][j], "value": v}
                for r, vals in zip(data["rows"], data["values"], strict=True) for j, v in enumerate(vals)]
    if kind == "task-similarity":
        return [{"task_a": a, "task_b": b, "cosine": v} for a, vals in zip(data["labels"], data["matrix"], strict=True)
                for b, v in zip(data["labels"], vals, strict=True)]
    if kind == "layer-similarity":
        n = len(data["layers"])
        return [{"layer_a": i, "layer_b": j, "S_L": data["S_L"][i][j], "S_M": data["S_M"][i][j]} for i in range(n) for j in range(n)]
    if kind == "rates":
        e = data["rate_edges"]
        return [{"layer": data["layer"], "rate_lo": e[i], "rate_hi": e[i + 1], "neurons": c} for i, c in enumerate(data["rate_counts"])]
    if kind == "h-values":
        e = data["h_edges"]
        return [{"layer": data["layer"], "h_lo": e[i], "h_hi": e[i + 1], "count": c} for i, c in enumerate(data["h_counts"])]
    if kind == "allocation":
        return [dict(r) for r in data["layers"]]
    if kind == "routing":
        out = []
        for s, name in enumerate(data["sets"]):
            for li, layer in enumerate(data["layers"]):
                for e, v in enumerate(data["share"][s][li]):
                    out.append({"set": name, "layer": layer, "expert": e, "share": v, "load_cv": data["load_cv"][s][li]})
        return out
    if kind == "finetune-log":
        return [{k: st.get(k) for k in ("step", "loss", "ntp_loss", "aux_loss", "lr", "tokens", "elapsed_s")} for st in data["steps"]]
    raise ValueError(f"no table for {kind!r}")


def csv_text(rows: list[dict[str, Any]]) -> str:
    import csv
    import io

    if not rows:
        return ""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()
