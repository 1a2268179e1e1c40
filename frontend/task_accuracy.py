"""Downstream accuracy (lm-evaluation-harness tasks) in the UI: an evaluation's accuracies in words, and the Compare
page's accuracy against FFN cost and against measured speed, in and out of the calibration domain.

Pure functions of the API's data (an evaluation's ``summary.tasks``: ``{task: {variant: {acc, acc_stderr, …}}}``).
"""

from __future__ import annotations

from typing import Any, Callable

import plotly.graph_objects as go

from frontend.figures import _layout, message_figure
from frontend.speed import PHASES, phase_speedup

#: An evaluation's metrics, in the order a task's headline number is chosen (as the harness's table does).
HEADLINE = ("acc", "pass@1", "exact_match", "acc_norm")
DOMAIN_SYMBOL = {"in domain": "circle", "partly in domain": "diamond", "out of domain": "x", None: "square"}


def headline(metrics: dict[str, Any] | None) -> tuple[str, float, float | None] | None:
    """``(metric, value, stderr)`` of a task's headline metric, or None."""
    for name in HEADLINE:
        value = (metrics or {}).get(name)
        if isinstance(value, (int, float)):
            err = (metrics or {}).get(f"{name}_stderr")
            return name, float(value), float(err) if isinstance(err, (int, float)) else None
    return None


def pct(metrics: dict[str, Any] | None, with_stderr: bool = False) -> str:
    h = headline(metrics)
    if h is None:
        return "–"
    text = f"{100 * h[1]:.1f}%"
    return text + (f" ± {100 * h[2]:.1f}" if with_stderr and h[2] is not None else "")


def accuracy_cell(summary: dict[str, Any] | None) -> str:
    """'moelab_chat_qa 41.0% / 45.5% dense; …': each task's converted accuracy next to the dense model's."""
    tasks = (summary or {}).get("tasks") or {}
    return "; ".join(f"{task} {pct(by.get('converted'))} / {pct(by.get('dense'))} dense" for task, by in tasks.items())


def accuracy_points(convs: list[dict[str, Any]], evals: dict[str, list[dict[str, Any]]], labels: dict[str, str],
                    task_domain: Callable[[dict[str, Any], str], str | None]) -> list[dict[str, Any]]:
    """One point per conversion × task (and the dense model's beside it) from the conversion's newest ready
    evaluation that ran tasks. ``task_domain(conversion, task)``: 'in domain', 'out of domain' … or None."""
    points: list[dict[str, Any]] = []
    for c in convs:
        ran = [e for e in evals.get(c["id"], []) if e.get("status") == "ready" and (e.get("summary") or {}).get("tasks")]
        if not ran:
            continue
        ev = max(ran, key=lambda e: str(e.get("created_at", "")))
        summary = ev["summary"]
        cost = (c.get("summary") or {}).get("ffn_flops_fraction")
        for task, by in summary["tasks"].items():
            conv, dense = headline(by.get("converted")), headline(by.get("dense"))
            if conv is None:
                continue
            points.append({"conversion_id": c["id"], "conversion": labels.get(c["id"], c["id"]), "evaluation_id": ev["id"],
                           "task": task, "metric": conv[0], "accuracy": conv[1], "stderr": conv[2],
                           "dense_accuracy": dense[1] if dense else None, "ffn_flops_fraction": cost,
                           **{f"speed_{phase}": phase_speedup(summary, phase) for phase in PHASES}, "domain": task_domain(c, task)})
    return points


AXES = {"ffn_flops_fraction": "FFN cost (ffn_flops_fraction, multiply-adds over dense)",
        **{f"speed_{phase}": f"measured {name} speed × dense (whole model, same process)" for phase, name in PHASES.items()}}


def accuracy_figure(points: list[dict[str, Any]], x: str) -> go.Figure:
    """Accuracy against ``x`` (``ffn_flops_fraction`` or ``speed_<phase>``): a colour per task, the marker says
    whether the task's text is in the conversion's calibration domain; each task's dense accuracy at x = 1."""
    shown = [p for p in points if isinstance(p.get(x), (int, float))]
    if not shown:
        return message_figure("no evaluation of these conversions ran tasks: evaluate with downstream tasks")
    fig = go.Figure()
    for task in dict.fromkeys(p["task"] for p in shown):
        mine = [p for p in shown if p["task"] == task]
        fig.add_trace(go.Scatter(
            x=[p[x] for p in mine], y=[100 * p["accuracy"] for p in mine], mode="markers", name=task, legendgroup=task,
            marker={"size": 11, "symbol": [DOMAIN_SYMBOL.get(p["domain"], "square") for p in mine]},
            error_y={"type": "data", "array": [100 * (p["stderr"] or 0) for p in mine], "visible": True},
            text=[f"{p['conversion']} · {p['domain'] or 'domain unknown'}" for p in mine],
            hovertemplate="%{text}<br>" + task + ": %{y:.1f}%<br>x = %{x:.3f}<extra></extra>"))
        dense = next((p["dense_accuracy"] for p in mine if p["dense_accuracy"] is not None), None)
        if dense is not None:
            fig.add_trace(go.Scatter(x=[1.0], y=[100 * dense], mode="markers", name=f"{task}: dense", legendgroup=task,
                                     marker={"size": 13, "symbol": "star"},
                                     hovertemplate=f"dense · {task}: %{{y:.1f}}%<extra></extra>"))
    return _layout(fig, f"Accuracy vs {'cost' if x == 'ffn_flops_fraction' else 'measured ' + PHASES[x.removeprefix('speed_')] + ' speed'}",
                   note="marker: ● in the calibration domain, × out of it, ◆ partly, ■ unknown; bars: ± stderr",
                   xaxis_title=AXES[x], yaxis_title="accuracy (%)")
