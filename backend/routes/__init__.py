"""One router per resource, all under ``/api/v1``."""

from fastapi import APIRouter, Depends

from ..deps import require_token
from . import (
    artifacts,
    calibration_sets,
    charts,
    conversions,
    evaluations,
    finetunes,
    health,
    jobs,
    methods,
    models,
    profiles,
)


def api_router() -> APIRouter:
    router = APIRouter(prefix="/api/v1", dependencies=[Depends(require_token)])
    for module in (health, methods, models, calibration_sets, profiles, conversions, evaluations, finetunes, jobs, artifacts, charts):
        router.include_router(module.router)
    return router
