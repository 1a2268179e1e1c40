"""The conversion methods, one module each, registered here by their ``METHOD`` declaration.

Adding a method: write ``methods/NAME.py`` with a ``MethodParams`` dataclass (every field declared
with ``param(...)``) and a ``METHOD = Method(...)``, then list it in ``_MODULES`` below. The CLI
(``moelab convert``, ``moelab methods``), the API (``POST /conversions``, ``GET /methods``, previews)
and the designer's panels are generated from the registry.

Stored parameter dicts (``conversion.json`` → ``params``) carry their method, so a record can be
turned back into its parameters without knowing the method beforehand; records written before
the registry (ExpertWeaver/CMoE as ``{"allocation": {...}, "router": "paper", ...}``) are read too.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..core.params import ConversionError, MethodParams
from . import cmoe, dense2moe, expertweaver, hierarchical, midas
from .base import ConversionInputs, Method, Recovery
from .labels import generic_label, shared_parts

__all__ = ["ConversionInputs", "Method", "Recovery", "REGISTRY", "register", "get_method", "method_of",
           "params_from_dict", "describe_methods", "check_conversion", "conversion_label", "METHODS"]

REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add ``method`` to the registry (its name must be new and its parameters well declared)."""
    if method.name in REGISTRY:
        raise ValueError(f"method {method.name!r} is registered twice")
    if method.params.method != method.name:
        raise ValueError(f"{method.params.__name__}.method is {method.params.method!r}, not {method.name!r}")
    method.params.specs()  # fails now, not in a request, when a field lacks param(...)
    REGISTRY[method.name] = method
    return method


_MODULES = (expertweaver, cmoe, dense2moe, midas, hierarchical)
for _module in _MODULES:
    register(_module.METHOD)

#: Names in registration order (the CLI's choices, the API's enum, the designer's list).
METHODS: tuple[str, ...] = tuple(REGISTRY)


def get_method(name: str) -> Method:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConversionError(f"unknown conversion method {name!r}; use one of: {', '.join(REGISTRY)}") from None


def _legacy(d: Mapping[str, Any]) -> dict[str, Any]:
    """A pre-registry ExpertWeaver/CMoE dict, flattened: the allocation block's fields that the
    method reads, ``router="paper"`` as the method's paper router."""
    alloc = dict(d["allocation"])
    method = alloc.pop("method", "expertweaver")
    cls = get_method(method).params
    names = {s.name for s in cls.specs()}
    flat = {k: v for k, v in {**alloc, **{k: v for k, v in d.items() if k != "allocation"}}.items() if k in names}
    if flat.get("router") == "paper":
        flat["router"] = {"expertweaver": "centroid", "cmoe": "representative"}[method]
    return {"method": method, **flat}


def method_of(params: Any) -> str:
    """The method of a parameters object or of its stored dict."""
    if isinstance(params, MethodParams):
        return params.method
    if "allocation" in params and "method" not in params:
        return params["allocation"].get("method", "expertweaver")
    return params.get("method") or "expertweaver"


def normalise_params(d: Mapping[str, Any]) -> dict[str, Any]:
    """A stored params dict in today's flat form (``{"method": NAME, **fields}``); no torch."""
    return _legacy(d) if "allocation" in d and "method" not in d else dict(d)


def params_from_dict(d: Mapping[str, Any]) -> MethodParams:
    """The parameters object a stored ``params`` dict describes (any method, old records too)."""
    d = normalise_params(d)
    return get_method(d.get("method") or "expertweaver").params.from_dict(d)


def check_conversion(params: MethodParams, profile_paths: Sequence[Any], model: str | None, calib: str | None) -> list[Any]:
    """Everything a conversion can refuse before a model is loaded (no torch, so the CLI answers a bad
    parameter in a second): the parameters' own rules, the inputs the method reads (``Method.needs``),
    and the method's checks against the profiles' manifests; returns the opened profiles."""
    from ..profiling.store import StoredProfile

    method = get_method(method_of(params))
    params.check()
    if method.needs == "moe_model":
        if profile_paths:
            raise ConversionError(f"{method.name} conversion profiles the MoE model itself: give the model and a calibration set, not a profile")
        if not model or not calib:
            raise ConversionError(f"{method.name} conversion needs the MoE model and a calibration set (model=, calib=)")
    elif not profile_paths:
        raise ConversionError(f"{method.name} conversion needs a profile of the dense model (run `moelab profile` first)")
    elif method.needs == "profile" and len(profile_paths) > 1:
        several = ", ".join(n for n, m in REGISTRY.items() if m.needs == "profiles")
        raise ConversionError(f"{method.name} reads one profile; only {several} take(s) one profile per calibration set")
    profiles = [StoredProfile.open(p) for p in profile_paths]
    if method.validate is not None:
        method.validate(params, profiles)
    return profiles


def conversion_label(params: Mapping[str, Any]) -> str:
    """The few parameters that tell conversions of one method apart, in words (the method's ``label``, or its
    first three declared parameters, then the options methods share); ``params``: a stored params dict of any
    method, old records too. What the API returns as a conversion's ``label``."""
    p = normalise_params(params or {})
    method = REGISTRY.get(method_of(p))
    if method is None:  # a method no longer registered: its first stored parameters
        return ", ".join(generic_label(p, [k for k in p if k != "method"]))
    own = method.label(p) if method.label else generic_label(p, [s.name for s in method.params.specs()])
    return ", ".join([*own, *shared_parts(p)])


def describe_methods() -> list[dict[str, Any]]:
    """Every method with its parameters (name, type, default, help, paper reference, bounds)."""
    return [m.describe() for m in REGISTRY.values()]
