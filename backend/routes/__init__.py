"""One router per resource, all under ``/api/v1``; all but health behind the token check."""

from fastapi import APIRouter, Depends

from ..deps import require_token
from . import (
    activation_probes,
    artifacts,
    calibration_sets,
    charts,
    conversions,
    evaluations,
    exports,
    finetunes,
    health,
    jobs,
    methods,
    models,
    notes,
    probes,
    profile_compare,
    profiles,
    tasks,
)


def api_router() -> APIRouter:
    """Every route needs the token when one is configured, except ``/health`` (probes and load
    balancers must see it without a secret; it names no user data)."""
    router = APIRouter(prefix="/api/v1")
    router.include_router(health.router)
    # profile_compare before profiles: its /profiles/compare would otherwise be read as /profiles/{profile_id}
    for module in (methods, models, calibration_sets, profile_compare, profiles, conversions, exports, evaluations, finetunes, probes,
                   activation_probes, jobs, artifacts, charts, notes, tasks):
        router.include_router(module.router, dependencies=[Depends(require_token)])  # one level: matching stays flat
    return router
