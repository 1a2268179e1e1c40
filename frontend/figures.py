"""Plotly figures as pure functions of the API's chart JSON (no I/O, no Dash).

Each builder takes the dict an endpoint returned (or plain arrays) and returns a
``go.Figure``; :func:`table` turns the same payload into rows for the CSV download. Heatmaps
are plain ``go.Heatmap`` (never heatmapgl): the API already tiles big maps, and the figure's
title carries its ``note`` when it did.
"""

from __future__ import annotations

import math

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
    top = 70 + 14 * max(0, text.count("<br>") - 1)  # room above the plot for each further note line
    fig.update_layout(title={"text": text}, template=TEMPLATE, margin={"l": 60, "r": 20, "t": top, "b": 50}, **kw)
    for axis in ("xaxis", "yaxis"):  # layer and expert axes are integers
        if str(kw.get(f"{axis}_title", "")).split(" ")[0] in ("layer", "expert"):
            fig.update_layout({axis: {"dtick": 1}})
    return fig


def without_note(fig: go.Figure) -> tuple[go.Figure, str]:
    """A copy of ``fig`` titled by its title alone, and the note its title carried (``_layout``'s
    ``<br><sup>…</sup>`` lines) as plain text: a page that shows the note as HTML under the card
    title, where it wraps to the card's width (a plotly title never wraps: a long note is cut)."""
    out = go.Figure(fig)
    text = (out.layout.title.text or "") if out.layout.title else ""
    if "<br><sup>" not in text:
        return out, ""
    title, note = text.split("<br><sup>", 1)
    note = note.replace("</sup>", "").replace("<sup>", "").replace("<br>", "; ")
    margin = out.layout.margin
    out.update_layout(title={"text": title}, margin={"t": 50 if title else 30, "l": margin.l, "r": margin.r, "b": margin.b})
    return out, note


#: characters per line of a message figure: a long message wraps instead of running past the figure's edges
MESSAGE_LINE_CHARS = 70


def message_figure(text: str) -> go.Figure:
    """An empty figure that says why it is empty (errors are shown in words), wrapped to the figure's width."""
    fig = go.Figure()
    wrapped = "<br>".join(line for para in str(text).split("\n") for line in wrap_words(para, MESSAGE_LINE_CHARS))
    fig.add_annotation(text=wrapped, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False, font={"size": 14})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, "")


# --------------------------------------------------------------------------- CV (EW Eq. 3, Fig. 2)


#: Counts of per-neuron statistics span decades (most neurons in a few bins, a long tail), so
#: histogram counts are drawn on a log axis: on a linear one everything sits in one bin.
LOG_COUNTS = {"yaxis_type": "log"}

#: What the rows of a profile's activation map are, by the profile's ``cv_basis`` (EW Eq. 3's
#: "tasks"; a set without two tasks is profiled per sample): (singular, plural).
BASIS_NAMES = {"task": ("task", "tasks"), "domain": ("domain", "domains"), "sample": ("sample", "samples")}


def basis_names(basis: str | None) -> tuple[str, str]:
    """('task', 'tasks') for a task-grouped profile, ('sample', 'samples') for a per-sample one …;
    unknown or missing basis: the neutral ('group', 'groups')."""
    return BASIS_NAMES.get(basis or "", ("group", "groups"))


def _count_bars(centers: np.ndarray, counts: Sequence[int], widths: np.ndarray, xaxis: str, name: str | None = None,
                unit: str = "neurons") -> go.Bar:
    """Histogram bars whose hover gives the bin and the exact count (the log axis hides small ones' size)."""
    lo, hi = centers - widths / 2, centers + widths / 2
    return go.Bar(x=centers, y=list(counts), width=widths, name=name, marker_line_width=0, customdata=np.stack([lo, hi], axis=-1),
                  hovertemplate=xaxis + " %{customdata[0]:.3g} … %{customdata[1]:.3g}<br>%{y} " + unit + "<extra></extra>")


def _log_ticks(lo: float, hi: float) -> tuple[list[float], list[str]]:
    """Tick positions (log10) and labels 1-2-5 per decade within ``[lo, hi]``."""
    vals = [m * 10.0**e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1) for m in (1, 2, 5)]
    vals = [v for v in vals if lo <= v <= hi] or [lo, hi]
    return [math.log10(v) for v in vals], [f"{v:g}" for v in vals]


def cv_histogram(data: dict[str, Any], layer: int, tau: float | None = None, basis: str | None = None) -> go.Figure:
    """Histogram of one layer's neuron CV on the server's shared bins (log counts), τ (EW Eq. 4) drawn
    when given; overflow (and, on log bins, CVs ≤ 0) said in the title.

    Log-spaced bins (``scale == "log"``) are drawn as equal-width bars on a log10 axis labelled in
    CV units: plotly's own log axis would draw each bar's width in linear units, misplacing wide
    bins."""
    edges = _arr(data["edges"])
    counts = np.asarray(data["counts"][layer])
    log = data.get("scale") == "log"
    pos = np.log10(edges) if log else edges
    centers = (pos[:-1] + pos[1:]) / 2
    bar = _count_bars(centers, counts, np.diff(pos), "CV", f"layer {layer}")
    bar.customdata = np.stack([edges[:-1], edges[1:]], axis=-1)  # hover in CV units on either axis
    fig = go.Figure(bar)
    extra = data["overflow"][layer]
    note = f"{data['n_neurons'][layer]} neurons; {extra} above {data['clipped_at']:.3g} not shown"
    below = (data.get("underflow") or [0] * (layer + 1))[layer]
    if below:
        note += f"; {below} with CV ≤ 0 not shown"
    note += "; counts on a log axis" + ("; CV on a log axis" if log else "")
    if tau is not None:
        fig.add_vline(x=math.log10(tau) if log and tau > 0 else tau, line_dash="dash", line_color="firebrick",
                      annotation_text=f"τ = {tau:g}")
        note += "; right of τ: specialised neurons (r_ℓ, EW Eq. 4)"
    axis: dict[str, Any] = {}
    if log:
        ticks, labels = _log_ticks(float(edges[0]), float(edges[-1]))
        axis = {"xaxis_tickvals": ticks, "xaxis_ticktext": labels}
    return _layout(fig, f"Neuron CV, layer {layer}", note, xaxis_title=f"CV across {basis_names(basis)[1]}" + (" (log)" if log else ""),
                   yaxis_title="neurons (log)", bargap=0, **LOG_COUNTS, **axis)


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


def activation_heatmap(tiles: dict[str, Any], basis: str | None = None) -> go.Figure:
    """EW Fig. 1a: rows (tasks, domains or samples: the profile's ``basis``) × neurons (in the server's
    order), tiles when aggregated."""
    z = _arr(tiles["values"])
    x = tiles["column_first_neuron"]
    one, many = basis_names(basis)
    fig = go.Figure(go.Heatmap(
        z=z, y=tiles["rows"], x=list(range(len(x))), customdata=np.tile(np.asarray(x), (z.shape[0], 1)) if z.size else None,
        colorscale="RdBu", zmid=0, colorbar={"title": "mean act."},
        hovertemplate=one + " %{y}<br>column %{x} (first neuron %{customdata})<br>value %{z:.4f}<extra></extra>",
    ))
    note = ("aggregated server-side: " + tiles["note"]) if tiles.get("aggregated") else tiles.get("note")
    return _layout(fig, f"Neuron × {one} activations, layer {tiles['layer']} ({len(tiles['rows'])} {many}; order: {tiles['neuron_order']})",
                   note, xaxis_title="neuron column", yaxis_title=one)


def neuron_profile(tiles: dict[str, Any], column: int, basis: str | None = None) -> go.Figure:
    """One neuron column's value on every row (clicked on the heatmap)."""
    z = _arr(tiles["values"])
    first = tiles["column_first_neuron"][column]
    label = f"neuron {first}" if tiles.get("neurons_per_column", 1) == 1 else f"neurons from {first} ({tiles['neurons_per_column']} averaged)"
    return _group_bars(tiles["rows"], z[:, column], label, basis)


def _group_bars(rows: Sequence[str], values: np.ndarray, label: str, basis: str | None) -> go.Figure:
    one = basis_names(basis)[0]
    fig = go.Figure(go.Bar(x=list(rows), y=values))
    return _layout(fig, f"Per-{one} profile: {label}", None, xaxis_title=one, yaxis_title="mean activation")


def neuron_card_profile(card: dict[str, Any]) -> go.Figure:
    """A neuron card's mean gate activation per group (EW §3.1 ā_{j,t}: the neuron × task map's column)."""
    return _group_bars(card["groups"], _arr(card["group_means"]), f"layer {card['layer']} · neuron {card['neuron']}", card.get("cv_basis"))


def task_similarity(data: dict[str, Any], basis: str | None = None) -> go.Figure:
    """EW Fig. 1b: cosine similarity of the activation patterns of the profile's groups, titled by
    what they are (a single-topic set is profiled per sample: a sample × sample matrix, not tasks)."""
    one, many = basis_names(basis)
    fig = go.Figure(go.Heatmap(z=_arr(data["matrix"]), x=data["labels"], y=data["labels"], colorscale="Viridis",
                               colorbar={"title": "cosine"},
                               hovertemplate=f"{one} %{{y}} vs {one} %{{x}}<br>cosine %{{z:.3f}}<extra></extra>"))
    centered = "centred per neuron" if data.get("centered") else "raw"
    note = f"{len(data['labels'])} {many}; {centered}"
    if data.get("note") and data.get("note") != "full resolution":
        note += f"; {data['note']}"
    if basis == "sample":
        note += "; the set has fewer than 2 tasks, so the CV is taken across samples"
    return _layout(fig, f"{one.capitalize()} × {one} activation similarity (EW Fig. 1b)", note)


def value_histogram(values: Sequence[float], title: str, xaxis: str, bins: int = 40) -> go.Figure:
    """Histogram of any per-neuron statistic (activation rate, CM Fig. 2; h-values)."""
    v = _arr(list(values))
    v = v[np.isfinite(v)]
    if v.size == 0:
        return message_figure(f"{title}: no finite value")
    counts, edges = np.histogram(v, bins=bins)
    centers = (edges[:-1] + edges[1:]) / 2
    fig = go.Figure(_count_bars(centers, counts, np.diff(edges), xaxis.split(" ")[0]))
    return _layout(fig, title, f"{v.size} neurons, {bins} bins", xaxis_title=xaxis, yaxis_title="neurons (log)", bargap=0, **LOG_COUNTS)


def binned_histogram(edges: Sequence[float], counts: Sequence[int], title: str, xaxis: str, yaxis: str, note: str | None = None) -> go.Figure:
    """A histogram whose bins the server chose (edges + counts)."""
    e = _arr(list(edges))
    centers = (e[:-1] + e[1:]) / 2
    fig = go.Figure(_count_bars(centers, counts, np.diff(e), xaxis.split(" ")[0], unit=yaxis))
    return _layout(fig, title, note, xaxis_title=xaxis, yaxis_title=f"{yaxis} (log)", bargap=0, **LOG_COUNTS)


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
    title = "Per-layer shared / routed plan (EW Fig. 7)"
    if budget_plan(preview):
        title = "Starting plan of the budget plan: per-layer top-k is fitted at conversion"
        note += f"; the conversion keeps {budget_cap(preview)}"
    elif (preview.get("params") or {}).get("plan") == "leading":
        title = "Starting plan of the leading plan: leading dense layers and one top-k are fitted at conversion"
        note += f"; the conversion keeps {budget_cap(preview)}"
    fig.update_layout(barmode="stack", yaxis={"title": "share of d_ffn", "range": [0, 1]},
                      yaxis2={"title": "r_ℓ", "overlaying": "y", "side": "right", "range": [0, 1]},
                      legend={"orientation": "h", "y": -0.2})
    return _layout(fig, title, note, xaxis_title="layer")


def budget_plan(preview: dict[str, Any]) -> bool:
    """Whether a preview is of a ``plan="budget"`` conversion: its per-layer top-k is chosen at
    conversion time from calibration error (``core.fitting``), which a numpy preview cannot show."""
    return (preview.get("params") or {}).get("plan") == "budget"


def budget_cap(preview: dict[str, Any]) -> str:
    """The budget plan's cap on the FFN cost in words (``core.fitting``): ExpertWeaver's
    ``flops_budget`` 1 − sparsity, else (CMoE) the paper plan's own cost."""
    params, summary = preview.get("params") or {}, preview.get("summary") or {}
    if isinstance(params.get("sparsity"), (int, float)):
        return f"ffn_flops_fraction ≤ {1 - params['sparsity']:.3g} (1 − sparsity)"
    cost = summary.get("ffn_flops_fraction")
    return f"ffn_flops_fraction ≤ {cost:.3f} (the paper plan's cost)" if isinstance(cost, (int, float)) else "the paper plan's cost"


# --------------------------------------------------------------------------- routing (EW Fig. 8, MI Figs. 3–4)


def routing_share(heat: dict[str, Any]) -> np.ndarray:
    return _arr(heat["share"]).reshape(len(heat["sets"]), len(heat["layers"]), heat["n_experts"])


def routed_experts(heat: dict[str, Any], set_index: int = 0) -> np.ndarray:
    """Routed experts of each layer: the payload pads every layer to the widest one's expert count
    with ``None`` (EW's layer-adaptive α gives layers different counts); a static layer has none."""
    counts = _arr(heat["counts"]).reshape(len(heat["sets"]), len(heat["layers"]), heat["n_experts"])[set_index]
    return np.isfinite(counts).sum(axis=-1)


#: Why a heatmap cell is blank, said in its hover text and under the title.
BLANK_NOTE = "blank cells: padding beyond a layer's own routed experts (layers have different counts) or a static layer"


def _blank_note(heat: dict[str, Any]) -> str | None:
    """BLANK_NOTE when the payload has blank cells (a narrower or static layer), else nothing to explain."""
    return BLANK_NOTE if (routed_experts(heat) < heat["n_experts"]).any() else None


def _pair(heat: dict[str, Any], a: int, b: int) -> str:
    """'A = code · 4 windows × 64 tokens …<br>B = …': set names are long, one line each."""
    return f"A = {heat['sets'][a]}<br>B = {heat['sets'][b]}"


def _cell_text(heat: dict[str, Any], z: np.ndarray, set_index: int, what: str) -> list[list[str]]:
    """Hover text of every cell, the blank ones saying why they are blank."""
    n = routed_experts(heat, set_index)
    out = []
    for li, layer in enumerate(heat["layers"]):
        row = []
        for e in range(heat["n_experts"]):
            if n[li] == 0:
                row.append(f"layer {layer}: static, no routed expert")
            elif e >= n[li]:
                row.append(f"layer {layer} has {n[li]} routed experts: no expert {e} (padding)")
            elif not np.isfinite(z[li, e]):
                row.append(f"layer {layer}, expert {e}: no routed token")
            else:
                row.append(f"layer {layer}, expert {e}: {what} {z[li, e]:.4f}")
        out.append(row)
    return out


def routing_heatmap(heat: dict[str, Any], set_index: int, zmax: float | None = None) -> go.Figure:
    """Layer × expert token share on one set; blank (padding / static) cells explained on hover."""
    share = routing_share(heat)[set_index]
    fig = go.Figure(go.Heatmap(z=share, x=list(range(heat["n_experts"])), y=heat["layers"], colorscale="Viridis", zmin=0,
                               zmax=zmax, colorbar={"title": "share"}, text=_cell_text(heat, share, set_index, "share"),
                               hovertemplate="%{text}<extra></extra>", hoverongaps=True))
    note = "share of each layer's routed selections per expert" + (f"<br>{blank}" if (blank := _blank_note(heat)) else "")
    return _layout(fig, f"Routing on {heat['sets'][set_index]}", note, xaxis_title="expert", yaxis_title="layer")


def routing_difference(heat: dict[str, Any], a: int, b: int) -> go.Figure:
    share = routing_share(heat)
    diff = share[a] - share[b]
    m = float(np.nanmax(np.abs(diff))) if np.isfinite(diff).any() else 1.0
    fig = go.Figure(go.Heatmap(z=diff, x=list(range(heat["n_experts"])), y=heat["layers"], colorscale="RdBu", zmid=0,
                               zmin=-m, zmax=m, colorbar={"title": "Δ share"}, text=_cell_text(heat, diff, a, "Δ share"),
                               hovertemplate="%{text}<extra></extra>", hoverongaps=True))
    note = _pair(heat, a, b) + (f"<br>{blank}" if (blank := _blank_note(heat)) else "")
    return _layout(fig, "Difference of token shares: A − B", note, xaxis_title="expert", yaxis_title="layer")


def js_divergence(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Jensen–Shannon divergence (bits) row by row over the experts both rows have (finite cells):
    a layer's padding cells (``None`` beyond its own routed experts) are not experts, so they
    neither count nor blank the row; only a row with no expert at all (static layer) stays NaN."""
    p = np.asarray(p, dtype=float)
    q = np.asarray(q, dtype=float)
    own = np.isfinite(p) & np.isfinite(q)
    bad = ~own.any(axis=-1)
    p = np.where(own, p, 0.0)
    q = np.where(own, q, 0.0)
    p = p / np.where(p.sum(-1, keepdims=True) > 0, p.sum(-1, keepdims=True), 1)
    q = q / np.where(q.sum(-1, keepdims=True) > 0, q.sum(-1, keepdims=True), 1)
    m = (p + q) / 2

    def kl(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(x > 0, x * np.log2(x / np.where(y > 0, y, 1)), 0.0)
        return t.sum(-1)

    out = 0.5 * kl(p, m) + 0.5 * kl(q, m)
    return np.where(bad, np.nan, out)


def layer_gaps(layers: list[int], values: Any) -> tuple[list[int], list[float | None]]:
    """Every layer from the first to the last, with None where ``layers`` has none (a dense or pruned layer the
    payload leaves out) or the value is not finite: a line breaks there instead of joining its neighbours."""
    by_layer = {int(layer): float(v) for layer, v in zip(layers, np.asarray(values, dtype=float).tolist(), strict=True)
                if v is not None and np.isfinite(v)}
    xs = list(range(min(layers), max(layers) + 1)) if layers else []
    return xs, [by_layer.get(x) for x in xs]


def _missing_note(layers: list[int]) -> str:
    missing = sorted(set(range(min(layers), max(layers) + 1)) - set(layers)) if layers else []
    return f"; layers {missing} have no routed experts here (dense or pruned): the lines break there" if missing else ""


def routing_js_line(heat: dict[str, Any], a: int, b: int) -> go.Figure:
    share = routing_share(heat)
    js = js_divergence(share[a], share[b])
    n = routed_experts(heat, a)
    xs, y = layer_gaps(heat["layers"], js)  # lists: null gaps in the browser, not an encoded array
    experts = dict(zip(heat["layers"], n.tolist(), strict=True))
    fig = go.Figure(go.Scatter(x=xs, y=y, mode="lines+markers", name="JS divergence", customdata=[experts.get(x, 0) for x in xs],
                               hovertemplate="layer %{x}: JS %{y:.4f} bits over its %{customdata} routed experts<extra></extra>"))
    note = _pair(heat, a, b) + "<br>bits over each layer's own routed experts; 0 = same routing, 1 = disjoint"
    if (static := [layer for layer, k in zip(heat["layers"], n, strict=True) if k == 0]):
        note += f"; static layers {static} have no routed expert (no value)"
    note += _missing_note(heat["layers"])
    return _layout(fig, "Jensen–Shannon divergence per layer, A vs B", note, xaxis_title="layer", yaxis_title="JS (bits)", yaxis_range=[0, 1])


def load_cv_by_layer(heat: dict[str, Any]) -> go.Figure:
    """MI Fig. 3: load CV (MI Eq. 7) per layer, one line per set, broken at layers without routed experts."""
    cv = _arr(heat["load_cv"]).reshape(len(heat["sets"]), len(heat["layers"]))
    lines = [(name, *layer_gaps(heat["layers"], cv[i])) for i, name in enumerate(heat["sets"])]
    fig = go.Figure([go.Scatter(x=xs, y=y, mode="lines+markers", name=name) for name, xs, y in lines])
    return _layout(fig, "Expert load CV by layer (MI Fig. 3)", "0 = perfectly balanced" + _missing_note(heat["layers"]),
                   xaxis_title="layer", yaxis_title="load CV")


# --------------------------------------------------------------------------- experts matched across conversions

#: Expert ids of two conversions are unrelated labels: B's experts are shown at the ids of A's experts
#: they share most neurons with (``GET /conversions/{a}/matching/{b}``, one Jaccard-maximising assignment).


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


def heldout_of(evaluation: dict[str, Any]) -> dict[str, Any]:
    """What an evaluation measured on: ``{source, label, windows, seq_len}``. The summary's ``heldout``
    (what the worker actually read, fewer windows when the text ran short) wins over the request."""
    params = evaluation.get("params") or {}
    held = (evaluation.get("summary") or {}).get("heldout") or {}
    source = held.get("source") or params.get("source") or "?"
    return {"source": source, "label": params.get("label") or source, "windows": held.get("windows", params.get("n_windows")),
            "seq_len": held.get("seq_len", params.get("seq_len"))}


def heldout_key(evaluation: dict[str, Any]) -> tuple[str, Any, Any]:
    """Numbers are comparable only when measured on the same text with the same windows × tokens."""
    h = heldout_of(evaluation)
    return (h["source"], h["windows"], h["seq_len"])


def heldout_label(evaluation: dict[str, Any]) -> str:
    """'code-heldout (cal-1a2b) · 4 windows × 64 tokens = 256 tokens': the text and how much of it."""
    h = heldout_of(evaluation)
    name = h["label"] if h["label"] == h["source"] else f"{h['label']} ({h['source']})"
    w, t = h["windows"], h["seq_len"]
    size = f"{w} windows × {t} tokens = {w * t:,} tokens" if isinstance(w, int) and isinstance(t, int) else f"{w} windows × {t} tokens"
    return f"{name} · {size}"


#: Bar order and colours: dense first, the conversion next, baselines after.
VARIANT_ORDER = ("dense", "converted", "uniform", "abstopk", "teal")
VARIANT_COLOURS = {"dense": "#6b7280", "converted": "#1f77b4", "uniform": "#ff7f0e", "abstopk": "#2ca02c", "teal": "#9467bd"}


def perplexity_rows(conversions: Sequence[dict[str, Any]], evaluations: dict[str, list[dict[str, Any]]],
                    names: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One row per (held-out text and settings, conversion, variant) from ready evaluations
    (newest first, as the API lists them): a re-run on the same text and settings replaces the
    older one instead of being added to it. ``ratio`` is perplexity / dense of the same evaluation."""
    names = names or {}
    rows, seen = [], set()
    for c in conversions:
        for e in evaluations.get(c["id"], []):
            if e.get("status") != "ready":
                continue
            key = heldout_key(e)
            if (key, c["id"]) in seen:
                continue
            seen.add((key, c["id"]))
            variants = (e.get("summary") or {}).get("variants") or {}
            dense = (variants.get("dense") or {}).get("perplexity")
            for variant, d in variants.items():
                ppl = d.get("perplexity")
                if ppl is None:
                    continue
                ratio = d.get("perplexity_ratio")
                if ratio is None and dense:
                    ratio = ppl / dense
                rows.append({"text": heldout_label(e), "text_key": "|".join(map(str, key)), "conversion": names.get(c["id"], c["id"]),
                             "conversion_id": c["id"], "evaluation_id": e["id"], "variant": variant, "perplexity": ppl,
                             "ratio_to_dense": 1.0 if variant == "dense" else ratio,
                             "perplexity_ci": d.get("perplexity_ci"), "ratio_ci": None if variant == "dense" else d.get("perplexity_ratio_ci")})
    return rows


def _bar_label(row: dict[str, Any]) -> str:
    ppl = f"{row['perplexity']:.1f}" if row["perplexity"] < 1000 else f"{row['perplexity']:,.0f}"
    ratio, ci = row.get("ratio_to_dense"), row.get("ratio_ci")
    # three significant digits: 0.997× is not "1.00×", 54.9× needs no more
    if row["variant"] == "dense" or ratio is None:
        return ppl
    return f"{ppl} ({ratio:#.3g}× dense" + (f", 95% CI {ci[0]:#.3g}–{ci[1]:#.3g})" if ci else ")")


def _ci_bars(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Error bars of each bar's 95% bootstrap interval of perplexity (over windows); None when no row has one."""
    if not any(r.get("perplexity_ci") for r in rows):
        return None
    up = [(r["perplexity_ci"][1] - r["perplexity"]) if r.get("perplexity_ci") else 0 for r in rows]
    down = [(r["perplexity"] - r["perplexity_ci"][0]) if r.get("perplexity_ci") else 0 for r in rows]
    return {"type": "data", "symmetric": False, "array": up, "arrayminus": down, "thickness": 1, "width": 3}


def wrap_words(text: str, width: int) -> list[str]:
    """``text`` cut at spaces into lines of at most ``width`` characters (a longer word stands alone)."""
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines or [""]


#: Pixels of one line of tick label text and of one panel's plot area (compare_perplexity).
TICK_LINE_PX, PANEL_PX = 15, 240


def _category_label(row: dict[str, Any], width: int) -> str:
    """A bar group's tick label: the conversion's name wrapped into short lines (horizontal, never
    rotated into the next panel), its id below in small type."""
    lines = wrap_words(row["conversion"], width) if row["conversion"] != row["conversion_id"] else []
    return "<br>".join([*lines, f"<sub>{row['conversion_id']}</sub>"])


def compare_perplexity(rows: list[dict[str, Any]]) -> go.Figure:
    """Perplexity per conversion and variant, one panel per held-out text and settings: bars are only
    ever side by side when measured on the same text with the same windows × tokens (rows from
    :func:`perplexity_rows`). Each bar says its value and its ratio to dense with the ratio's 95% bootstrap interval over windows; error bars: the perplexity's.

    Tick labels are horizontal and wrapped; the space between panels (and below the last one) is
    sized in pixels from their line count, so no label runs into the next panel."""
    from plotly.subplots import make_subplots

    if not rows:
        return message_figure("no evaluation yet: evaluate from the designer or routing explorer")
    texts = list(dict.fromkeys(r["text_key"] for r in rows))
    titles = [next(r["text"] for r in rows if r["text_key"] == t) for t in texts]
    variants = sorted({r["variant"] for r in rows}, key=lambda v: (VARIANT_ORDER.index(v) if v in VARIANT_ORDER else 99, v))
    n_conv = len({r["conversion_id"] for r in rows})
    width = max(12, min(32, 64 // n_conv))  # characters per label line: narrower as more groups share the width
    labels = {r["conversion_id"]: _category_label(r, width) for r in rows}
    lines = max(label.count("<br>") + 1 for label in labels.values())
    label_px = TICK_LINE_PX * lines + 12
    gap_px = label_px + 40  # the tick labels, then the next panel's title
    plot_px = len(texts) * PANEL_PX + (len(texts) - 1) * gap_px
    fig = make_subplots(rows=len(texts), cols=1, subplot_titles=titles, vertical_spacing=gap_px / plot_px if len(texts) > 1 else 0)
    shown: set[str] = set()
    for i, t in enumerate(texts, start=1):
        mine = [r for r in rows if r["text_key"] == t]
        for v in variants:
            sel = [r for r in mine if r["variant"] == v]
            if not sel:
                continue
            fig.add_trace(go.Bar(
                name=v, legendgroup=v, showlegend=v not in shown, marker_color=VARIANT_COLOURS.get(v),
                x=[labels[r["conversion_id"]] for r in sel],
                y=[r["perplexity"] for r in sel], text=[_bar_label(r) for r in sel], textposition="outside", cliponaxis=False,
                error_y=_ci_bars(sel),
                customdata=[[r["text"], r["evaluation_id"], r["conversion"], r["conversion_id"]] for r in sel],
                hovertemplate="%{customdata[2]} (%{customdata[3]})<br>" + v + ": %{text}<br>%{customdata[0]}<br>"
                              "evaluation %{customdata[1]}<extra></extra>",
            ), row=i, col=1)
            shown.add(v)
        values = [r["perplexity"] for r in mine if r["perplexity"] > 0]
        # a wrecked baseline (ppl in the thousands) would flatten dense and converted to nothing
        log = bool(values) and max(values) / min(values) > 20
        fig.update_yaxes(title_text="perplexity (log)" if log else "perplexity", type="log" if log else "linear",
                         rangemode="tozero", row=i, col=1)
    fig.update_xaxes(tickangle=0, automargin=False, tickfont={"size": 11})
    top, bottom = 110, label_px + 50  # the last panel's labels, then the legend
    fig.update_layout(barmode="group", height=top + plot_px + bottom,
                      legend={"orientation": "h", "x": 0, "y": -label_px / plot_px, "yanchor": "top"})
    _layout(fig, "Perplexity on held-out text: dense vs converted vs baselines",
            "one panel per text and windows × tokens (never compared across texts); bar labels: perplexity (× dense)")
    return fig.update_layout(margin={"t": top, "b": bottom})  # room for the first panel's title under the note


#: Columns of the quality-vs-cost CSV: exactly what each plotted point is.
QUALITY_COST_COLUMNS = ("conversion_id", "conversion", "label", "calibration_set", "method", "recipe", "text", "domain", "evaluation_id",
                        "ffn_flops_fraction", "speed_decode_b1", "speed_decode_b8", "speed_prefill", "perplexity_ratio")

#: What :func:`quality_vs_cost` can put on x: (axis title, hover, which corner is better). ``speed_<phase>``: the
#: whole converted model's measured speed over dense's in that phase of the same evaluation (``summary.speed``).
QUALITY_X = {
    "ffn_flops_fraction": ("ffn_flops_fraction (FFN MACs/token ÷ dense, router included)", "cost %{x:.3f} of dense FFN",
                           "lower-left is better"),
    **{f"speed_{phase}": (f"measured {name} speed × dense (whole model, same process)", f"{name}: %{{x:.2f}}× dense speed",
                          "lower-right is better")
       for phase, name in {"decode_b1": "decode b1", "decode_b8": "decode b8", "prefill": "prefill"}.items()},
}


def quality_cost_points(points: list[dict[str, Any]], x: str = "ffn_flops_fraction") -> list[dict[str, Any]]:
    """The points :func:`quality_vs_cost` draws against ``x`` (a cost, speed or ratio not recorded is left out, not
    guessed), as CSV rows with :data:`QUALITY_COST_COLUMNS`."""
    return [{k: p.get(k) for k in QUALITY_COST_COLUMNS} for p in points
            if p.get(x) is not None and p.get("perplexity_ratio") is not None]


#: The marker of a point by whether its text is of the conversion's calibration domains (``names.domain_relation``).
DOMAIN_SYMBOLS = {"in domain": "circle", "partly in domain": "triangle-up", "out of domain": "x"}
DOMAIN_MARKS = {"in domain": "●", "partly in domain": "▲", "out of domain": "✕"}

#: One colour per held-out text in the quality-vs-cost chart (markers and their labels).
TEXT_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")

#: Where a point's label may go, tried in this order: beside the point on the side facing the plot's
#: middle (above, level, below), then the other side.
_SLOTS = ("top", "middle", "bottom")


def _text_positions(points: list[dict[str, Any]], mid: float, x_span: float, y_span: float, x: str) -> list[str]:
    """Each point's label position (``textposition``): on the side facing the plot's middle, so it
    never runs past the plot's edge, and in a slot no nearby point's label took (points at about
    the same cost and ratio, of any text, get labels above, level with and below them)."""
    out: list[str] = []
    for i, p in enumerate(points):
        px, y = p[x], math.log10(max(p["perplexity_ratio"], 1e-12))
        facing = "left" if px > mid else "right"
        near = {out[j] for j, q in enumerate(points[:i])
                if abs(q[x] - px) <= 0.15 * x_span and abs(math.log10(max(q["perplexity_ratio"], 1e-12)) - y) <= 0.08 * y_span}
        options = [f"{v} {h}" for h in (facing, "left" if facing == "right" else "right") for v in _SLOTS]
        out.append(next((o for o in options if o not in near), options[0]))
    return out


def quality_vs_cost(points: list[dict[str, Any]], x: str = "ffn_flops_fraction") -> go.Figure:
    """Perplexity over dense against FFN cost or a measured speed (``x``, a key of :data:`QUALITY_X`), one series per
    held-out text (ratios are only comparable on the same text); points: {label, text, ``x``, perplexity_ratio} and,
    for the hover, ``conversion`` (the full name) and ``conversion_id``.

    Each label is drawn beside its point on the side facing the plot's middle, and both axes'
    ranges are padded, so no label is cut at the plot's edge."""
    axis_title, hover, better = QUALITY_X[x]
    points = quality_cost_points(points, x)
    if not points:
        return message_figure("no evaluated conversion with a recorded ffn_flops_fraction" if x == "ffn_flops_fraction" else
                              "no evaluation of these conversions timed them: evaluate again (evaluations time the models)")
    xs = [p[x] for p in points]
    ys = [math.log10(p["perplexity_ratio"]) for p in points if p["perplexity_ratio"] > 0] or [0.0]
    x_lo, x_hi = min(xs), max(xs)
    if x != "ffn_flops_fraction":
        x_lo, x_hi = min(x_lo, 1.0), max(x_hi, 1.0)  # dense's speed in view
    x_pad = max(0.1 * (x_hi - x_lo), 0.05)
    y_lo, y_hi = min([*ys, 0.0]), max([*ys, 0.0])  # dense (ratio 1) always in view
    y_pad = max(0.15 * (y_hi - y_lo), 0.02)
    points = sorted(points, key=lambda p: (p["text"], p[x]))
    where = _text_positions(points, (x_lo + x_hi) / 2, x_hi - x_lo + 2 * x_pad, y_hi - y_lo + 3 * y_pad, x)
    texts = sorted({p["text"] for p in points})
    traces = []
    for n, t in enumerate(texts):
        mine = [i for i, p in enumerate(points) if p["text"] == t]
        pts = [points[i] for i in mine]
        colour = TEXT_COLOURS[n % len(TEXT_COLOURS)]  # a label in its text's colour: which text it was measured on
        traces.append(go.Scatter(
            x=[p[x] for p in pts], y=[p["perplexity_ratio"] for p in pts], mode="markers+text", marker_color=colour,
            marker_symbol=[DOMAIN_SYMBOLS.get(p.get("domain"), "circle") for p in pts], marker_size=10,
            text=[p["label"] for p in pts], textposition=[where[i] for i in mine], textfont={"size": 11, "color": colour},
            cliponaxis=False, name=t,
            customdata=[[p.get("conversion") or p["label"], p.get("conversion_id") or "",
                         p.get("domain") or "calibration domains unknown"] for p in pts],
            hovertemplate="%{customdata[0]}<br>%{customdata[1]}<br>" + hover + "<br>%{y:.3f}× dense perplexity"
                          "<br>%{customdata[2]}<extra>" + t + "</extra>"))
    fig = go.Figure(traces)
    fig.add_hline(y=1, line_dash="dot", line_color="gray")
    if x != "ffn_flops_fraction":  # dense's speed: right of it is faster than the model it came from
        fig.add_vline(x=1, line_dash="dot", line_color="gray")
    marks = sorted({p.get("domain") for p in points} - {None}, key=list(DOMAIN_SYMBOLS).index)
    key = "; ".join(f"{DOMAIN_MARKS[d]} {d} (text {'of' if d == 'in domain' else 'not of' if d == 'out of domain' else 'partly of'} "
                    "the conversion's calibration set)" for d in marks)
    title = "Quality vs cost" if x == "ffn_flops_fraction" else "Quality vs measured speed"
    return _layout(fig, title, f"{better}; compare points measured on the same text only" + (f"<br>{key}" if key else ""),
                   xaxis_title=axis_title,
                   xaxis_range=[x_lo - x_pad, x_hi + x_pad], yaxis_range=[y_lo - y_pad, y_hi + 2 * y_pad],
                   yaxis_title="perplexity / dense", yaxis_type="log",
                   legend={"orientation": "h", "y": -0.25})  # long text names below, not eating the plot's width


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
    return _layout(fig, "Active share of FFN neurons per layer", None, xaxis_title="layer", yaxis_title="active fraction",
                   legend={"orientation": "h", "y": -0.25})  # long conversion names below, not eating the plot's width


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


def finetune_eval_text(params: dict[str, Any]) -> str:
    """What a fine-tune's perplexities were measured on, as the trainer chooses it (``FinetuneParams.
    heldout_source``): 'on builtin:code held-out · 16 windows × 256 tokens'."""
    source = params.get("source") or ""
    held = params.get("eval_source") or (source if source.startswith("builtin:") else "builtin:mixed")
    return f"on {held} held-out · {params.get('eval_windows', '?')} windows × {params.get('seq_len', '?')} tokens"


def finetune_loss(log: dict[str, Any]) -> go.Figure:
    """Training curve of a fine-tune (the ``/finetunes/{id}/log`` payload): total loss
    (1 − w)·L_NTP + w·L_KD + λ·L_LB (EW Eq. 12), next-token loss and distillation loss on the left axis, the load-balancing loss
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
    if any(s.get("kd_loss") is not None for s in steps):
        traces.append(go.Scatter(x=x, y=[s.get("kd_loss") for s in steps], mode="lines", name="distillation loss KL(dense ‖ converted)",
                                 line={"dash": "dash"}))
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


# --------------------------------------------------------------------------- calibration sets


def calibration_size_unit(stats: dict[str, Any]) -> str:
    """'tokens' when the set's stored statistics count tokens for every task and domain, else
    'characters' (a set is built without a tokenizer: it belongs to no model)."""
    entries = [v for g in ("tasks", "domains") for v in (stats.get(g) or {}).values()]
    return "tokens" if entries and all("tokens" in v for v in entries) else "characters"


def calibration_sizes(stats: dict[str, Any]) -> go.Figure:
    """A calibration set's size per task and per domain, in tokens where its statistics have them,
    else in characters, as the title and the axis say."""
    unit = calibration_size_unit(stats)
    key = "tokens" if unit == "tokens" else "chars"
    fig = go.Figure()
    for group in ("tasks", "domains"):
        entries = stats.get(group) or {}
        if entries:
            fig.add_bar(name=f"by {group[:-1]}", x=list(entries), y=[v[key] for v in entries.values()],
                        customdata=[v.get("samples") for v in entries.values()],
                        hovertemplate="%{x}<br>%{y:,} " + unit + " in %{customdata} samples<extra></extra>")
    if not fig.data:
        return message_figure("the set has no task or domain labels")
    note = None if unit == "tokens" else "characters of text: a set is stored without a tokenizer, so tokens are counted per model"
    return _layout(fig, f"{unit.capitalize()} by task and domain", note, yaxis_title=unit, barmode="group", xaxis_automargin=True,
                   legend={"orientation": "h", "x": 1, "xanchor": "right", "y": 1.02, "yanchor": "bottom"})


# --------------------------------------------------------------------------- two profiles compared (set-specific neurons)

#: d < 0 (specific to B) blue, d > 0 (specific to A) red: the neuron card's colours for negative / positive h
SPECIFICITY_SCALE = [[0.0, "rgb(37, 99, 235)"], [0.5, "rgb(229, 231, 235)"], [1.0, "rgb(220, 38, 38)"]]


def specificity_scatter(data: dict[str, Any], names: tuple[str, str]) -> go.Figure:
    """Each neuron of the payload's layer at (mean on A, mean on B), coloured by its set-specificity d
    (red: specific to A, blue: to B, symmetric around 0); the diagonal is 'as active on both'.
    ``data``: GET /profiles/compare; ``names``: what A and B are (their calibration sets)."""
    sc = data["scatter"]
    d = _arr(sc["specificity"])
    finite = np.abs(d[np.isfinite(d)])
    top = max(2.0 * data["threshold"], float(np.quantile(finite, 0.99)) if finite.size else 0.0)
    x, y = _arr(sc["mean_a"]), _arr(sc["mean_b"])
    fig = go.Figure(go.Scatter(  # SVG, not WebGL: ≤ max_points points, and headless browsers lack WebGL
        x=x, y=y, mode="markers", customdata=np.stack([np.asarray(sc["neurons"]), d], axis=-1) if len(d) else None,
        marker={"color": d, "colorscale": SPECIFICITY_SCALE, "cmin": -top, "cmax": top, "size": 6,
                "colorbar": {"title": "d"}, "line": {"width": 0}},
        hovertemplate="neuron %{customdata[0]}<br>mean on A %{x:.4g}, on B %{y:.4g}<br>d = %{customdata[1]:.3g}<extra></extra>",
    ))
    finite_xy = np.concatenate([x[np.isfinite(x)], y[np.isfinite(y)]])
    if finite_xy.size:
        lo, hi = float(finite_xy.min()), float(finite_xy.max())
        fig.add_shape(type="line", x0=lo, y0=lo, x1=hi, y1=hi, line={"dash": "dot", "color": "#9ca3af", "width": 1})
    note = (f"{sc['note']}; colour: d (red: more active on A, blue: on B; specific: |d| ≥ {data['threshold']:g} and "
            f"Benjamini–Hochberg q ≤ {data['fdr']:g})")
    return _layout(fig, f"Layer {sc['layer']}: each neuron's mean gate activation on A and on B", note,
                   xaxis_title=f"mean gate activation on A: {names[0]}", yaxis_title=f"mean gate activation on B: {names[1]}")


def specific_share_bars(data: dict[str, Any], names: tuple[str, str]) -> go.Figure:
    """Per layer the share of neurons specific to A (d ≥ threshold) and to B (d ≤ −threshold), each kept by the
    false-discovery control (q ≤ fdr), stacked; the scatter's layer outlined."""
    rows = data["layers"]
    layers = [r["layer"] for r in rows]
    outline = [2 if layer == data["layer"] else 0 for layer in layers]
    fig = go.Figure([
        go.Bar(x=layers, y=[100 * r["share_a"] for r in rows], name=f"specific to A: {names[0]}", marker_color=SPECIFICITY_SCALE[2][1],
               marker_line={"width": outline, "color": "#111"}, customdata=[r["n_specific_a"] for r in rows],
               hovertemplate="layer %{x}: %{y:.1f}% (%{customdata} neurons) specific to A<extra></extra>"),
        go.Bar(x=layers, y=[100 * r["share_b"] for r in rows], name=f"specific to B: {names[1]}", marker_color=SPECIFICITY_SCALE[0][1],
               marker_line={"width": outline, "color": "#111"}, customdata=[r["n_specific_b"] for r in rows],
               hovertemplate="layer %{x}: %{y:.1f}% (%{customdata} neurons) specific to B<extra></extra>"),
    ])
    large = sum(r["n_large_a"] + r["n_large_b"] for r in rows)
    kept = sum(r["n_specific_a"] + r["n_specific_b"] for r in rows)
    note = (f"|d| ≥ {data['threshold']:g} and Welch's test kept at a false-discovery rate q ≤ {data['fdr']:g} (Benjamini–Hochberg "
            f"over every neuron): {kept} of the {large} neurons with that gap; outlined: layer {data['layer']} (the scatter's); "
            "click a bar to show its layer")
    return _layout(fig, "Share of set-specific neurons by layer", note, xaxis_title="layer", yaxis_title="% of the layer's neurons",
                   barmode="stack", legend={"orientation": "h", "x": 0, "y": -0.2, "yanchor": "top", "traceorder": "normal"})


def specific_rows(data: dict[str, Any], side: str) -> list[dict[str, Any]]:
    """The rows of a 'most specific to A/B' table: rank, layer, neuron, d and both sets' numbers, most specific first."""
    return [{"rank": i + 1, "layer": n["layer"], "neuron": n["neuron"], "d": n["specificity"], "mean_a": n["mean_a"],
             "mean_b": n["mean_b"], "rate_a": n["rate_a"], "rate_b": n["rate_b"]}
            for i, n in enumerate(data[f"top_{side}"])]


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
    if kind == "matching":
        return [{"layer": m["layer"], "expert_a": e["expert"], "expert_b": e["match"], "jaccard": e["jaccard"],
                 "best_b": e["best"], "best_jaccard": e["best_jaccard"], "mean_jaccard": m["mean_jaccard"],
                 "shared_jaccard": m["shared_jaccard"]} for m in data["layers"] for e in m["a"]]
    if kind == "profile-compare":
        sc = data["scatter"]
        return [{"layer": sc["layer"], "neuron": n, "mean_a": a, "mean_b": b, "d": d}
                for n, a, b, d in zip(sc["neurons"], sc["mean_a"], sc["mean_b"], sc["specificity"], strict=True)]
    if kind == "specific-shares":
        return [dict(r) for r in data["layers"]]
    if kind == "finetune-log":
        return [{k: st.get(k) for k in ("step", "loss", "ntp_loss", "kd_loss", "aux_loss", "lr", "tokens", "elapsed_s")} for st in data["steps"]]
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


# --------------------------------------------------------------------------- runs overlaid (Evaluations page)

#: per-layer curves of an evaluation (``GET /evaluations/{id}/charts/layers``) a user can overlay
LAYER_METRICS = {
    "reconstruction_error": ("Reconstruction error per layer", "relative L2 error of each layer's FFN on the dense model's inputs "
                             "(0: the layer stayed dense)", "relative error"),
    "load_cv": ("Expert load CV per layer (MI Eq. 7)", "0 = perfectly balanced routing", "load CV"),
    "js": ("Routing divergence per layer", "Jensen–Shannon divergence (bits) between a run's routing on its text and the same "
           "conversion's on the chosen text; 0 = same routing, 1 = disjoint", "JS (bits)"),
}


def js_between(curves: dict[str, Any], other: dict[str, Any]) -> list[float | None]:
    """Per layer of ``curves``: the JS divergence (``js_divergence``) of its expert shares and ``other``'s
    (an evaluation of the same conversion on another text, so expert ids are the same experts); None
    where either has no routed expert in that layer."""
    theirs = dict(zip(other["layers"], other["share"], strict=True))
    out: list[float | None] = []
    for layer, mine in zip(curves["layers"], curves["share"], strict=True):
        other_share = theirs.get(layer)
        if not mine or not other_share:
            out.append(None)
            continue
        p = np.array([np.nan if v is None else v for v in mine], dtype=float)
        q = np.array([np.nan if v is None else v for v in other_share], dtype=float)
        value = float(js_divergence(p[None], q[None])[0])
        out.append(value if np.isfinite(value) else None)
    return out


def layer_overlay(runs: list[dict[str, Any]], metric: str, note: str | None = None) -> go.Figure:
    """One line per run over the layers: ``runs`` are ``{"label", "layers", "values"}`` (None: no value
    at that layer, a gap in the line). ``metric`` is a key of ``LAYER_METRICS``."""
    title, what, axis = LAYER_METRICS[metric]
    if not runs:
        return message_figure("choose evaluations to overlay")
    fig = go.Figure([go.Scatter(x=r["layers"], y=list(r["values"]), mode="lines+markers", name=r["label"],
                                hovertemplate=f"{r['label']}<br>layer %{{x}}: %{{y:.4f}}<extra></extra>") for r in runs])
    extra = {"yaxis_range": [0, 1]} if metric == "js" else {}
    return _layout(fig, title, what + (f"<br>{note}" if note else ""), xaxis_title="layer", yaxis_title=axis,
                   legend={"orientation": "h", "y": -0.25}, showlegend=True, **extra)
