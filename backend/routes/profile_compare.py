"""Two profiles of one model compared neuron by neuron, and neuron search in one profile.

``GET /profiles/compare?a&b`` sits before ``/profiles/{profile_id}`` in the router list
(``routes.__init__``), or "compare" would be taken for a profile id. The comparison of a pair
(``moelab.engine.profiling.compare``: one read of both profiles' per-sample means) is kept per
(pair, both manifest stamps) in a small LRU, so a layer change or a threshold move costs only
the payload; encoded bodies go to the charts' ``PAYLOADS`` under both stamps, and a profile
re-run (new manifest) is never answered from either.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Response

from moelab.store.jsonsafe import jsonable

from moelab.engine.profiling.compare import DEFAULT_FDR, CompareError, ProfileComparison as Comparison, compare_profiles
from moelab.engine.profiling.search import MAX_LIMIT, MAX_TOKEN_CHARS, NeuronQuery, NeuronTable, SearchError, TopTokenIndex, search_neurons

from .. import profile_compare as payloads
from ..deps import OffsetQ, SessionDep, StoreDep
from ..errors import ApiError
from ..schemas import MAX_INT, NeuronHit, NeuronSearch, ProfileComparison
from .charts import PAYLOADS, Stamp, _derived, _encode, _layer, _manifest_stamp, _ready_profile

router = APIRouter(prefix="/profiles", tags=["profiles"])

#: comparisons kept: ~10 float32 arrays of every neuron each (18 MB for an 8B model's 460k neurons)
MAX_COMPARISONS = 4
_COMPARISONS: OrderedDict[tuple[Any, ...], Comparison] = OrderedDict()
_LOCK = threading.Lock()


def comparison(a: Any, stamp_a: Stamp, b: Any, stamp_b: Stamp) -> Comparison:
    """``compare_profiles(a, b)`` once per pair of published profile versions (422 for different models)."""
    key = (str(a.path), stamp_a, str(b.path), stamp_b)
    with _LOCK:
        found = _COMPARISONS.get(key)
        if found is not None:
            _COMPARISONS.move_to_end(key)
            return found
    try:
        made = compare_profiles(a, b)  # outside the lock: other pairs are not held up
    except CompareError as exc:  # DifferentModels too: the message says what to choose instead
        raise ApiError(422, str(exc)) from exc
    with _LOCK:
        _COMPARISONS[key] = made
        while len(_COMPARISONS) > MAX_COMPARISONS:
            _COMPARISONS.popitem(last=False)
    return made


def _pair(session, store, a: str, b: str, what: tuple[str, str] = ("a", "b")) -> tuple[tuple[Any, Stamp], tuple[Any, Stamp]]:
    if a == b:
        raise ApiError(422, f"{what[1]}: {b} is the same profile as {what[0]}; choose another profile of the same model, on other text")
    return _ready_profile(session, store, a), _ready_profile(session, store, b)


@router.get("/compare", response_model=ProfileComparison, responses={404: {}, 409: {}, 422: {}},
            summary="Two profiles of one model compared: each neuron's set-specificity d, shares per layer, top neurons of each")
def compare(
    session: SessionDep, store: StoreDep,
    a: Annotated[str, Query(description="profile A (positive d: specific to A)")],
    b: Annotated[str, Query(description="profile B, of the same model")],
    layer: Annotated[int | None, Query(ge=0, le=MAX_INT, description="layer of the scatter; default: the one with the largest share of specific neurons")] = None,
    threshold: Annotated[float, Query(gt=0, le=100, allow_inf_nan=False, description="|d| at and above which a neuron is specific")] = 1.0,
    fdr: Annotated[float, Query(gt=0, le=1, allow_inf_nan=False, description="false-discovery rate: a specific neuron's Welch "
                                "test must survive Benjamini–Hochberg over every neuron at q ≤ fdr")] = DEFAULT_FDR,
    top: Annotated[int, Query(ge=0, le=100, description="most specific neurons listed per side")] = 10,
    snippets: Annotated[int, Query(ge=0, le=8, description="top-token snippets per listed neuron from each profile")] = 2,
    max_points: Annotated[int, Query(ge=100, le=20000, description="scatter points at most; larger layers are sampled")] = 2048,
) -> Response:
    """Per neuron d = (μ_A − μ_B) / sqrt((σ_A² + σ_B²)/2 + ε²) over the per-sample mean gate activations each profile
    stores (``moelab/engine/profiling/compare.py`` says why this score); 422 when the two are profiles of different
    models (or the same profile), 404 for an unknown id, 409 for one not ready."""
    (pa, sa), (pb, sb) = _pair(session, store, a, b)
    if layer is not None:
        _layer(pa, layer)
    key = ("profile-compare", a, sa, b, sb, layer, threshold, fdr, top, snippets, max_points)
    body = PAYLOADS.get(key)
    if body is None:
        made = comparison(pa, sa, pb, sb)
        body = _encode(ProfileComparison(**payloads.comparison_payload((a, b), (pa, pb), made, layer, threshold, fdr, top, snippets, max_points)))
        if (_manifest_stamp(Path(pa.path) / "manifest.json"), _manifest_stamp(Path(pb.path) / "manifest.json")) == (sa, sb):
            PAYLOADS.put(key, body)
    return Response(body, media_type="application/json")


SortQ = Literal["cv", "rate", "mean", "abs_mean", "std", "specificity", "layer"]
Bound = Annotated[float | None, Query(allow_inf_nan=False)]


@router.get("/{profile_id}/neurons/search", response_model=NeuronSearch, responses={404: {}, 409: {}, 422: {}},
            summary="Neurons of a profile by CV, activation rate, set-specificity against another profile and top-token text")
def search(
    profile_id: str, session: SessionDep, store: StoreDep,
    layer: Annotated[int | None, Query(ge=0, le=MAX_INT, description="one layer; all when unset")] = None,
    cv_min: Bound = None, cv_max: Bound = None,
    rate_min: Annotated[float | None, Query(ge=0, le=1, allow_inf_nan=False, description="ATopK activation rate, a fraction")] = None,
    rate_max: Annotated[float | None, Query(ge=0, le=1, allow_inf_nan=False)] = None,
    vs: Annotated[str | None, Query(description="another profile of the same model: adds specificity d (> 0: specific to this one)")] = None,
    min_specificity: Bound = None, max_specificity: Bound = None,
    token: Annotated[str | None, Query(min_length=1, max_length=MAX_TOKEN_CHARS,
                                       description="text of one of the neuron's stored top tokens (see match)")] = None,
    case_sensitive: bool = False,
    match: Annotated[Literal["token", "substring"], Query(description="token: a top token is that text (spaces around it aside: "
                                                         "'def' finds ' def', not 'default'); substring: a top token contains it")] = "token",
    sort: Annotated[SortQ | None, Query(description="default: specificity with vs, else cv")] = None,
    descending: bool = True,
    offset: OffsetQ = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 50,
) -> NeuronSearch:
    """Every filter is optional and ranges are inclusive; results are sorted (NaN last, then by layer and neuron) and
    paginated. 422 names the filter to fix (a range upside down, specificity without ``vs``, a token search on a
    profile without top tokens, a ``vs`` profile of another model)."""
    query = NeuronQuery(layer=layer, cv_min=cv_min, cv_max=cv_max, rate_min=rate_min, rate_max=rate_max, min_specificity=min_specificity,
                        max_specificity=max_specificity, token=token, case_sensitive=case_sensitive, match=match, sort=sort, descending=descending,
                        offset=offset, limit=limit)
    if vs is not None:
        (profile, stamp), (other, other_stamp) = _pair(session, store, profile_id, vs, ("profile", "vs"))
    else:
        profile, stamp = _ready_profile(session, store, profile_id)
    try:
        query.check(profile.n_layers, vs is not None, profile.has_top_tokens)
    except SearchError as exc:
        raise ApiError(422, str(exc)) from exc
    made = comparison(profile, stamp, other, other_stamp) if vs is not None else None
    table = _derived(profile, ("neuron-table",), lambda: NeuronTable.of(profile))
    top = _derived(profile, ("top-token-index",), lambda: TopTokenIndex.of(profile)) if token is not None else None
    found = search_neurons(table, query, made, top)
    items = [NeuronHit(**jsonable(i)) for i in found.items]
    return NeuronSearch(profile_id=profile_id, vs=vs, total=found.total, offset=offset, limit=limit, sort=found.sort,
                        descending=descending, items=items,
                        note=payloads.search_note(found.total, len(items), offset, found.sort, descending, vs))
