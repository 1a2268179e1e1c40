"""Request bodies generated from a parameter declaration (``moelab.engine.core.params``): the
profiler's settings, the fine-tuning hyper-parameters and every conversion method's block."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool, create_model

from moelab.engine.core.params import DeclaredParams, ParamSpec

from .common import MAX_INT, _In


def _field_annotation(spec: ParamSpec) -> Any:
    kind: Any = Literal[spec.choices] if spec.choices else {"int": int, "float": float, "str": str, "bool": StrictBool}[spec.type]  # type: ignore[valid-type]
    return kind | None if spec.optional else kind


def _upper(spec: ParamSpec) -> int | float | None:
    """The declared upper bound; an integer without one is held to MAX_INT (a seed of 2**64 fails in torch)."""
    return MAX_INT if spec.type == "int" and spec.le is None and spec.lt is None else spec.le


def _description(spec: ParamSpec) -> str:
    return f"{spec.help} ({spec.paper})" if spec.paper else spec.help


def declared_model(params: type[DeclaredParams], name: str, *, base: type[BaseModel] = _In, doc: str | None = None,
                   validators: dict[str, Any] | None = None) -> type[BaseModel]:
    """A request body generated from a parameter declaration (``moelab.engine.core.params``): one
    field per parameter that is not ``internal``, with the engine's name, type, default, bounds and
    help, so the CLI, the API and the engine cannot drift apart. ``base`` holds the request's own
    fields and validators; a parameter it defines itself (a request default that differs, string
    lengths) keeps that definition."""
    fields: dict[str, Any] = {
        spec.name: (_field_annotation(spec), Field(spec.default, description=_description(spec), ge=spec.ge, gt=spec.gt,
                                                   le=_upper(spec), lt=spec.lt, allow_inf_nan=False if spec.type == "float" else None))
        for spec in params.exposed_specs() if spec.name not in base.model_fields
    }
    return create_model(name, __base__=base, __doc__=doc if doc is not None else base.__doc__, __validators__=validators,
                        **fields)
