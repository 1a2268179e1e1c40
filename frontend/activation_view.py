"""A neuron's activation on a text, token by token: each token a chip coloured on a diverging scale
around 0 (red positive, blue negative, white 0), its value in the chip's title (pure functions of an
activation probe's result, like ``figures`` and ``token_view``)."""

from __future__ import annotations

from typing import Any

from dash import html

from frontend.token_view import text_colour

#: the diverging scale's ends (ColorBrewer RdBu): |h| ≥ the scale is fully saturated
POSITIVE, NEGATIVE, ZERO = (178, 24, 43), (33, 102, 172), (255, 255, 255)


def activation_colour(value: float | None, scale: float) -> str:
    """``rgb(…)`` of ``value`` on the diverging scale: white at 0, the full end colour at ±``scale``
    and beyond; grey for a missing value (NaN/inf stored as null)."""
    if value is None:
        return "rgb(204, 204, 204)"
    t = min(abs(value) / scale, 1.0) if scale > 0 else 0.0
    end = POSITIVE if value > 0 else NEGATIVE
    r, g, b = (round(z + (e - z) * t) for z, e in zip(ZERO, end, strict=True))
    return f"rgb({r}, {g}, {b})"


def activation_scale(values: list[float | None], reference: dict[str, Any] | None = None) -> float:
    """The |h| the scale saturates at: the profile's largest calibration |h| of the neuron
    (``reference.top_value``) when known, so texts are comparable, else the text's own largest |h|;
    a value beyond it saturates (the title still says it)."""
    top = (reference or {}).get("top_value")
    if top:
        return abs(float(top))
    return max((abs(v) for v in values if v is not None), default=0.0) or 1.0


def activation_chips(result: dict[str, Any], index: int = 0) -> list[dict[str, Any]]:
    """Per token of neuron ``result["neurons"][index]``: its piece, value, background and text colour
    (the data the markup draws; tests check it)."""
    values = result["activations"][index]
    refs = result.get("reference") or []
    scale = activation_scale(values, refs[index] if index < len(refs) else None)
    out = []
    for piece, value in zip(result["tokens"], values, strict=True):
        colour = activation_colour(value, scale)
        out.append({"piece": piece, "value": value, "background": colour, "color": text_colour(colour),
                    "title": f"{piece!r}: h = {value:+.4g}" if value is not None else f"{piece!r}: h unknown"})
    return out


def activation_text(result: dict[str, Any], index: int = 0) -> html.Div:
    """The text as chips of neuron ``index`` of the result, with a line saying the scale."""
    chips = activation_chips(result, index)
    refs = result.get("reference") or []
    scale = activation_scale(result["activations"][index], refs[index] if index < len(refs) else None)
    neuron = result["neurons"][index]
    spans = [html.Span(c["piece"], title=c["title"], className="token-chip",
                       style={"backgroundColor": c["background"], "color": c["color"], "whiteSpace": "pre-wrap"}) for c in chips]
    basis = "the profile's largest |h| of the neuron" if (refs and index < len(refs) and refs[index].get("top_value")) else \
        "the largest |h| on this text"
    return html.Div([
        html.Div(f"layer {result['layer']} · neuron {neuron}: h on {len(chips)} tokens; red > 0 > blue, saturated at "
                 f"|h| = {scale:.4g} ({basis}); hover a token for its value", className="note"),
        html.Div(spans, className="token-text"),
    ])
