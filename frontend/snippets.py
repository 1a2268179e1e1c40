"""A neuron card's text: its top-activating tokens in context, as Dash components (pure
functions of the card JSON of GET /profiles/{id}/neurons/{layer}/{neuron}, no I/O).

A token the profile knows this neuron's activation at (one of its top-K tokens, CM Eq. 1 h) is
highlighted: red for positive h, blue for negative, the colour's strength |h| / max |h| over the
card, the value on hover (``title``) and in ``data-value``. Every other token is plain: the
profile does not keep all activations, so an unhighlighted token means "not known", not zero.
"""

from __future__ import annotations

from typing import Any

from dash import html

from .figures import basis_names
from .names import fmt, fmt_pct

POSITIVE, NEGATIVE = (220, 38, 38), (37, 99, 235)


def token_colour(value: float, scale: float) -> str:
    """rgba background for h = ``value``: red (positive) or blue (negative), alpha |value| / scale."""
    alpha = min(1.0, abs(value) / scale) if scale > 0 else 0.0
    r, g, b = POSITIVE if value >= 0 else NEGATIVE
    return f"rgba({r}, {g}, {b}, {0.15 + 0.75 * alpha:.3f})"


def _shown(piece: str) -> str:
    return piece.replace("\n", "⏎ ")


def snippet(top: dict[str, Any], scale: float, label: str) -> html.Div:
    """One top token with its context; ``label`` names the neuron in the hover text."""
    spans = []
    for tok in top["snippet"]:
        if tok["value"] is None:
            spans.append(html.Span(_shown(tok["piece"]), className="tok"))
            continue
        spans.append(html.Span(
            _shown(tok["piece"]), className="tok hl" + (" centre" if tok["top"] else ""),
            title=f"{label}: h = {fmt(tok['value'])} (token {tok['token']}, position {tok['position']})",
            style={"backgroundColor": token_colour(tok["value"], scale)},
            **{"data-value": repr(float(tok["value"]))},
        ))
    where = " · ".join(x for x in (top.get("task"), top.get("domain")) if x) or f"sample {top['sample']}"
    return html.Div(className="snippet", children=[
        html.Div(className="snippet-head", children=f"#{top['rank'] + 1} · h = {fmt(top['value'])} · {where} · sample {top['sample']}, "
                                                    f"position {top['position']}"),
        html.Div(spans, className="token-text"),
    ])


def snippets(card: dict[str, Any]) -> html.Div:
    """All of a card's top tokens, largest |h| first, or why there are none."""
    tops = card.get("top") or []
    if not tops:
        return html.Div(card.get("note") or "no top tokens", className="note")
    scale = max(abs(t["value"]) for t in tops)
    label = f"layer {card['layer']} · neuron {card['neuron']}"
    return html.Div([html.Div(card["note"], className="note")] + [snippet(t, scale, label) for t in tops], className="snippets")


def card_title(card: dict[str, Any]) -> str:
    return f"layer {card['layer']} · neuron {card['neuron']}"


def card_stats(card: dict[str, Any]) -> str:
    """CV (EW Eq. 3, across the profile's groups), activation rate (CM Eq. 4), means."""
    many = basis_names(card.get("cv_basis"))[1]
    return (f"CV {fmt(card['cv'])} across {many} (EW Eq. 3) · among a token's top-K |h| on {fmt_pct(card['rate'])} of tokens "
            f"(activation rate, ATopK, CM Eq. 4: a rank among the layer's neurons) · mean gate activation act(x·W_gate) "
            f"{fmt(card['mean'])} · its |mean| {fmt(card['abs_mean'])} · std across {many} {fmt(card['std'])} · "
            f"{card['d_ffn']} neurons in the layer; snippets show h = act(x·W_gate)·(x·W_up)")
