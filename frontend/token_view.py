"""Token-level routing as text: every token of a probe coloured by the expert it is routed to in
one layer (pure functions of the probe's result, like ``figures``)."""

from __future__ import annotations

from typing import Any

from dash import dcc, html
from plotly import colors

#: one colour per expert id (ids beyond it wrap around; the tooltip always names the expert)
PALETTE: list[str] = colors.qualitative.Light24 + colors.qualitative.Dark24


def expert_colour(expert: int) -> str:
    return PALETTE[expert % len(PALETTE)]


def _rgb(colour: str) -> tuple[int, int, int]:
    """'#1ca71c' or 'rgb(28, 167, 28)' → (28, 167, 28)."""
    c = colour.strip()
    if c.startswith("#"):
        h = c[1:]
        h = "".join(ch * 2 for ch in h) if len(h) == 3 else h[:6]
        return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16)
    parts = c[c.index("(") + 1:c.index(")")].split(",")
    return int(float(parts[0])), int(float(parts[1])), int(float(parts[2]))


def relative_luminance(colour: str) -> float:
    """WCAG 2 relative luminance of an sRGB colour: 0 (black) … 1 (white)."""
    def channel(v: int) -> float:
        x = v / 255
        return x / 12.92 if x <= 0.04045 else ((x + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(v) for v in _rgb(colour))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast_ratio(a: str, b: str) -> float:
    """WCAG 2 contrast ratio of two colours, 1 … 21 (text needs ≥ 4.5)."""
    la, lb = sorted((relative_luminance(a), relative_luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def text_colour(background: str) -> str:
    """Black or white, whichever contrasts more with ``background`` (at least 4.58:1 for any colour)."""
    return "#000000" if contrast_ratio(background, "#000000") >= contrast_ratio(background, "#ffffff") else "#ffffff"


def _chip_style(colour: str) -> dict[str, str]:
    return {"backgroundColor": colour, "color": text_colour(colour)}


def routed_layers(result: dict[str, Any]) -> list[int]:
    return [lay["layer"] for lay in result.get("layers") or []]


def _layer(result: dict[str, Any], layer: int) -> dict[str, Any] | None:
    return next((lay for lay in result.get("layers") or [] if lay["layer"] == layer), None)


def routed_tokens(result: dict[str, Any], layer: int, expert: int | None = None, title: str = "",
                  colour_ids: dict[int, int] | None = None, labels: dict[int, str] | None = None) -> html.Div:
    """The probe's text with each token coloured by its best-scoring expert in ``layer`` (its
    tooltip lists all k, best first); with ``expert``, only the tokens routed to that expert are
    coloured (the expert's view: which tokens it sees). A legend gives each expert's token count.

    ``colour_ids``/``labels``: how another conversion's experts are drawn next to this one
    (``figures.matched_colour_ids``/``matched_label``): each expert in the colour of the expert it is
    matched to and named with both ids, since the bare ids of two conversions are unrelated."""
    lay = _layer(result, layer)
    if lay is None:
        have = ", ".join(map(str, routed_layers(result))) or "none"
        return html.Div(f"layer {layer} routes nothing in this conversion (routed layers: {have})", className="note")
    colour_ids, labels = colour_ids or {}, labels or {}

    def colour(e: int) -> str:
        return expert_colour(colour_ids.get(e, e))

    def name(e: int) -> str:
        return labels.get(e, str(e))

    tokens, experts = result["tokens"], lay["experts"]
    spans = []
    for t, (piece, chosen) in enumerate(zip(tokens, experts, strict=True)):
        hit = expert is None or expert in chosen
        background = colour(chosen[0] if expert is None else expert) if hit and chosen else "transparent"
        spans.append(html.Span(
            piece, className="tok" + (" tok-hit" if hit else ""),
            title=f"token {t} {piece!r} → experts {', '.join(map(name, chosen))} (best first)",
            style=_chip_style(background) if background != "transparent" else {"backgroundColor": background},
            **{"data-expert": str(chosen[0]) if chosen else "", "data-colour-id": str(colour_ids.get(chosen[0], chosen[0])) if chosen else ""},
        ))
    load = lay["load"]
    n = len(tokens)
    if expert is None:
        head = (f"layer {layer}: {lay['n_routed']} routed experts, top-{lay['top_k']}; colour = each token's best-scoring "
                "expert (hover a token for all of them)" + ("; matched experts share a colour" if colour_ids else ""))
    else:
        head = (f"layer {layer}, expert {name(expert)}: {load[expert] if expert < len(load) else 0} of {n} tokens routed to it "
                f"({lay['n_routed']} routed experts, top-{lay['top_k']})")
    legend = [html.Span(f"{name(e)}: {c}", className="chip", title=f"expert {name(e)}: {c} of {n} tokens",
                        style=_chip_style(colour(e))) for e, c in enumerate(load) if c]
    return html.Div([
        html.Div(title, className="probe-title") if title else None,
        html.Div(head, className="note"),
        html.Div(spans, className="token-text"),
        html.Div([html.Span("tokens per expert: ", className="note"), *legend], className="legend"),
    ], className="card token-routing")


def generation_card(name: str, side: dict[str, Any]) -> html.Div:
    """One model's continuation with its speed (``timed_generation``'s record)."""
    tps = side.get("tokens_per_s")
    return html.Div([
        html.H4(name),
        html.Pre(side.get("text") or "", className="generated"),
        html.Div(f"{side.get('new_tokens')} tokens in {side.get('seconds', 0):.2f} s: "
                 + (f"{tps:.1f} tokens/s" if tps else "no tokens")
                 + f"; prefill of {side.get('prefill_tokens')} prompt tokens {side.get('prefill_s', 0) * 1000:.0f} ms",
                 className="note speed"),
    ], className="card generation")


def expert_card(partition: dict[str, Any], expert: int, limit: int = 48) -> html.Div:
    """A routed expert's neurons (``GET /conversions/{id}/experts/{layer}``), each a link to its card
    in the neuron explorer with its CV; the mean CV against the shared expert's."""
    experts = partition.get("experts") or []
    if not 0 <= expert < len(experts):
        return html.Div(f"layer {partition.get('layer')} has experts 0–{len(experts) - 1}", className="note")
    e = experts[expert]
    cvs = e.get("cv")
    profile, layer = partition.get("profile_id"), partition["layer"]

    def mean(values: list[float] | None) -> str:
        return f"{sum(values) / len(values):.3g}" if values else "n/a"

    links = []
    for j, n in enumerate(e["neurons"][:limit]):
        label = f"{n}" + (f" (CV {cvs[j]:.2f})" if cvs else "")
        links.append(dcc.Link(label, href=f"/neurons?profile={profile}&layer={layer}&neuron={n}", className="neuron-link")
                     if profile else html.Span(label))
        links.append(html.Span(" "))
    more = len(e["neurons"]) - limit
    return html.Div([
        html.Div(f"expert {expert} of layer {layer}: {len(e['neurons'])} neurons, mean CV {mean(cvs)} "
                 f"(shared expert: {len(partition.get('shared') or [])} neurons, mean CV {mean(partition.get('shared_cv'))})",
                 className="note expert-head"),
        html.Div([*links, html.Span(f"… and {more} more") if more > 0 else None], className="expert-neurons"),
    ], className="expert-card")
