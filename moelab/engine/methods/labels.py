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
