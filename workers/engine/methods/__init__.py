"""The conversion methods moelab offers, and which parameters class each one reads.

* ``expertweaver`` / ``cmoe``: neuron partitioning from a profile (``conversion.ConversionParams``;
  the method is ``allocation.method``).
* ``dense2moe``: layer-fusion upcycling from a profile's S_L / S_M (``dense2moe.Dense2MoEParams``).
* ``midas``: one low-rank expert per calibration set, from ≥ 2 profiles (``midas.MidasParams``).
* ``hierarchical``: every expert of an existing MoE model split into shared + routed sub-experts,
  from the model and a calibration set, no profile (``hierarchical.HierarchicalParams``).

Stored parameter dicts (``conversion.json`` → ``params``) carry their method, so a record can be
turned back into its parameters class without knowing the method beforehand.
"""

from __future__ import annotations

from typing import Any

METHODS = ("expertweaver", "cmoe", "dense2moe", "midas", "hierarchical")
#: Methods that read a single profile of the dense model (MIDAS reads several, hierarchical none).
PROFILE_METHODS = ("expertweaver", "cmoe", "dense2moe", "midas")
#: Methods whose conversion can be compared against AbsTopK-GLU and the uniform allocation.
PARTITION_METHODS = ("expertweaver", "cmoe")


def method_of(params: Any) -> str:
    """The method of a parameters object or of its stored dict."""
    if isinstance(params, dict):
        return params.get("method") or params.get("allocation", {}).get("method", "expertweaver")
    return getattr(params, "method", None) or params.allocation.method


def params_class(method: str) -> type:
    """Imported on demand: the method modules load torch, which ``method_of``'s callers (the API's
    views) must not pay for."""
    from ..core.dense import ConversionError, ConversionParams

    if method in PARTITION_METHODS:
        return ConversionParams
    if method == "dense2moe":
        from .dense2moe import Dense2MoEParams

        return Dense2MoEParams
    if method == "midas":
        from .midas import MidasParams

        return MidasParams
    if method == "hierarchical":
        from .hierarchical import HierarchicalParams

        return HierarchicalParams
    raise ConversionError(f"unknown conversion method {method!r}; use one of: {', '.join(METHODS)}")


def params_from_dict(d: dict[str, Any]) -> Any:
    """The parameters object a stored ``params`` dict describes (any method)."""
    return params_class(method_of(d)).from_dict(dict(d))
