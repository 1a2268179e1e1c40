"""What every page's figures share: the template, titles with their notes, the message figure, count bars and
histograms, and the identity of a held-out text."""

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


def wrap_words(text: str, width: int) -> list[str]:
    """``text`` cut at spaces into lines of at most ``width`` characters (a longer word stands alone)."""
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines or [""]
