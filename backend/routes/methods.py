"""The conversion methods and their parameters, from the engine's registry (no model work)."""

from __future__ import annotations

from fastapi import APIRouter

from moelab.engine.methods import REGISTRY, describe_methods
from moelab.engine.runtime.export_plan import planned_export

from ..errors import ApiError
from ..schemas import ExportPlanIn, ExportPlanOut, MethodList, MethodOut

router = APIRouter(prefix="/methods", tags=["methods"])


@router.get("", response_model=MethodList, summary="Every conversion method with its parameters (name, type, default, help, paper)")
def list_methods() -> MethodList:
    return MethodList(items=[MethodOut(**m) for m in describe_methods()])


@router.post("/{method}/export-plan", response_model=ExportPlanOut, responses={404: {}},
             summary="Whether a conversion planned with these parameters will export to GGUF / native transformers, and why not")
def export_plan(method: str, body: ExportPlanIn) -> ExportPlanOut:
    """The rules the GGUF and native exporters apply, read back onto the planned parameters (no model work); the
    converted model's own check (``ConversionOut.gguf``) stays the word that counts."""
    if method not in REGISTRY:
        raise ApiError(404, f"no method {method!r}: choose one of {', '.join(REGISTRY)}")
    verdict, text = planned_export(method, body.params, body.family)
    return ExportPlanOut(verdict=verdict, text=text)
