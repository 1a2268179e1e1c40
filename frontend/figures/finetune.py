"""The Fine-tune page's loss curve and its summary words."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from .common import _layout, message_figure


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
