"""The conversion methods and their parameters, from the engine's registry (no model work)."""

from __future__ import annotations

from fastapi import APIRouter

from moelab.engine.methods import describe_methods

from ..schemas import MethodList, MethodOut

router = APIRouter(prefix="/methods", tags=["methods"])


@router.get("", response_model=MethodList, summary="Every conversion method with its parameters (name, type, default, help, paper)")
def list_methods() -> MethodList:
    return MethodList(items=[MethodOut(**m) for m in describe_methods()])
