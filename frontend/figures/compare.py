"""The Compare conversions page's figures: perplexity bars with intervals, quality against cost or speed,
active experts."""

from __future__ import annotations

import math
import statistics

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from .common import _layout, heldout_key, heldout_label, message_figure, wrap_words


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
                        "ffn_flops_fraction", "speed_decode_b1", "speed_decode_b8", "speed_prefill", "perplexity_ratio",
                        "kernels_decode_b1", "kernels_decode_b8", "kernels_prefill")
#: ``kernels_<phase>``: the dense model in moelab's kernels (``evaluation.kernel_dense``), timed in the same evaluation
KERNELS_LABEL = "dense in moelab's kernels"


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
    xs = [p[x] for p in points] + [v for p in points if (v := p.get(x.replace("speed_", "kernels_", 1))) is not None
                                   and x.startswith("speed_")]
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
    traces += _kernel_dense_marks(points, x, texts)
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


def _kernel_dense_marks(points: list[dict[str, Any]], x: str, texts: list[str]) -> list[go.Scatter]:
    """On a speed axis, per held-out text, the dense model in moelab's kernels at its measured speed (the median over
    that text's evaluations) and dense perplexity: right of it a conversion's sparsity gains over the kernels, left of
    it the kernels alone are faster. None on the cost axis, or where no evaluation timed it."""
    if not x.startswith("speed_"):
        return []
    out = []
    for n, t in enumerate(texts):
        speeds = sorted(v for p in points if p["text"] == t and (v := p.get(x.replace("speed_", "kernels_", 1))) is not None)
        if speeds:
            colour = TEXT_COLOURS[n % len(TEXT_COLOURS)]
            out.append(go.Scatter(x=[statistics.median(speeds)], y=[1.0], mode="markers+text", text=[KERNELS_LABEL],
                                  textposition="bottom center", textfont={"size": 10, "color": colour}, cliponaxis=False,
                                  marker={"symbol": "diamond-open", "size": 12, "color": colour}, name=f"{t}: {KERNELS_LABEL}",
                                  hovertemplate=KERNELS_LABEL + " (the same weights and outputs, its MLPs and projections in "
                                  f"moelab's decode calls), median of {len(speeds)} evaluation(s): %{{x:.2f}}× dense speed<extra>{t}</extra>"))
    return out


def compare_active(plans: dict[str, list[dict[str, Any]]]) -> go.Figure:
    """Active fraction per layer of several conversions' plans."""
    fig = go.Figure([go.Scatter(x=[r["layer"] for r in rows], y=[r.get("active_fraction") for r in rows], mode="lines+markers", name=name)
                     for name, rows in plans.items()])
    return _layout(fig, "Active share of FFN neurons per layer", None, xaxis_title="layer", yaxis_title="active fraction",
                   legend={"orientation": "h", "y": -0.25})  # long conversion names below, not eating the plot's width
