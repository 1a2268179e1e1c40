"""The words of a conversion's key parameters ('64 experts, α 0.2–0.7, τ 0.6, sparsity 25%'): the methods'
``label`` functions format with these, and ``methods.conversion_label`` adds the options they share. The API
returns the result as ``label``, so the UI names a conversion of any method, registered later too. No torch.
"""

from __future__ import annotations

from typing import Any, Mapping


def num(value: Any) -> str:
    """A parameter value as a person reads it: floats to 4 significant digits, '?' when missing."""
    if value is None:
        return "?"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def pct(value: Any) -> str:
    """0.25 → '25%'; '?' when not a number."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "?"
    return f"{value:.1%}".replace(".0%", "%")


def generic_label(params: Mapping[str, Any], names: list[str]) -> list[str]:
    """A method without its own ``label``: the first three of ``names`` (its declared parameters), 'name value'."""
    return [f"{n} {num(params.get(n))}" for n in names[:3] if params.get(n) is not None]


def shared_parts(p: Mapping[str, Any]) -> list[str]:
    """Options several methods share (router kind, plan, compensation, kept down rows), named alike."""
    parts = [f"{p['router']} router"] if p.get("router") else []
    if p.get("plan") and p.get("plan") != "paper":
        parts.append(f"{p['plan']} plan")
    if p.get("compensation") and p.get("compensation") != "none":
        parts.append("skipped-expert means")
    if isinstance(p.get("down_keep"), (int, float)) and p["down_keep"] < 1:
        parts.append(f"down {pct(p['down_keep'])} kept")
    return parts


def layer_span(layers: list[int]) -> str:
    """[0, 1, 2, 5] → 'layers 0–2, 5'; [3] → 'layer 3'."""
    layers = sorted(set(layers))
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    parts = [f"{r[0]}–{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs]
    return ("layer " if len(layers) == 1 else "layers ") + ", ".join(parts)


def collapse_notes(notes: list[dict[str, Any]]) -> list[str]:
    """Per-layer notes, one line per distinct text saying which layers it applies to (30 identical
    'budget plan' lines become 'layers 0–29 (30 layers): budget plan: …')."""
    by_text: dict[str, list[int]] = {}
    for n in notes:
        by_text.setdefault(n["note"], []).append(n["layer"])
    return [f"{layer_span(layers)}" + (f" ({len(set(layers))} layers)" if len(set(layers)) > 1 else "") + f": {text}"
            for text, layers in by_text.items()]
