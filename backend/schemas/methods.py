"""Methods: the conversion methods and their declared parameters (``GET /methods``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class ParamOut(BaseModel):
    name: str
    type: Literal["int", "float", "str", "bool"]
    default: Any
    help: str
    paper: str | None
    optional: bool
    choices: list[Any] | None
    ge: float | None
    gt: float | None
    le: float | None
    lt: float | None
    aliases: list[str]
    advanced: bool = Field(description="shown under 'more' in the designer")


class MethodOut(BaseModel):
    name: str
    title: str
    paper: str
    summary: str
    needs: Literal["profile", "profiles", "moe_model"]
    preview: bool = Field(description="GET /profiles/{id}/preview/{method} draws its plan before converting")
    recovery: str | None = Field(description="recovery fine-tuning this method offers (null: none)")
    recovery_summary: str | None = Field(None, description="what that fine-tuning mode trains, in one line (the Fine-tune page's words)")
    params: list[ParamOut]
    recipes: dict[str, dict[str, Any]] = Field(
        description="named parameter sets: 'paper' (the defaults: the paper's settings) and, where measured, 'best' "
                    "(the best training-free conversion found, tests/benchmarks/bench_frontier.py); "
                    "each maps parameter names to the values it sets over the defaults")


class MethodList(BaseModel):
    items: list[MethodOut]


class ParamList(BaseModel):
    items: list[ParamOut]


class ExportPlanIn(BaseModel):
    params: dict[str, Any] = Field(default_factory=dict, description="the method's parameters as planned (unset: its defaults)")
    family: str | None = Field(None, description="the source model's family (config model_type), when known")


class ExportPlanOut(BaseModel):
    verdict: Literal["as_converted", "after_recovery", "no"] = Field(
        description="exports as converted, after recovery fine-tuning in mode expertweaver, or not")
    text: str = Field(description="which formats, or what blocks the export and what would export (CLI words)")
