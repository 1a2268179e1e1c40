"""The Calibration sets page's size histogram."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from .common import _layout, message_figure


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
