"""Chart-ready JSON read from stored artifacts with numpy (``backend.charts``): no model work.

Profiles are opened with the engine's lazy reader and kept in a small cache keyed by the
manifest's stamp (mtime, inode, size), so the CV arrays behind an allocation-preview slider are
read once. The profile charts and method previews the UI asks for on every slider move are also
kept as encoded JSON bodies (``PayloadCache``), keyed by (profile id, manifest stamp, endpoint,
parsed query values): a repeated request costs the profile row's lookup and readiness check (done
on every request, so a deleted or re-running profile is answered 404/409 as before) and a
``stat`` of the manifest, no numpy, pydantic or JSON work. A profile's files are published
atomically with the manifest written last, so a re-run (or any rewrite) gives the manifest a new
stamp and every body cached under the old one is never served again; a deleted profile directory
is refused 409 before the cache is looked at.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from types import SimpleNamespace
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from pydantic_core import to_json
from sqlalchemy import bindparam, select

from moelab.engine.core.params import ConversionError
from moelab.engine.core.speed_prediction import cpu_machine_name, find_table, plan_layers, predicted_summary
from moelab.store.jsonsafe import finite_list, jsonable
from moelab.engine.methods import REGISTRY

from .. import charts
from moelab.store.db import Conversion, Evaluation, Job, Profile
from ..deps import IndexPath, SessionDep, StoreDep, encoded, lookup, require_ready
from ..errors import ApiError, not_found
from ..schemas import (
    MAX_INT,
    ActivationTiles,
    CVHistogram,
    CVSummary,
    LayerCurves,
    LayerSimilarity,
    METHOD_PARAMS,
    MethodPreview,
    NeuronCard,
    NeuronStats,
    RoutingHeatmap,
    TaskSimilarity,
)

router = APIRouter(tags=["charts"])


#: what identifies one published version of a profile's files: its manifest's (mtime_ns, inode, size)
Stamp = tuple[int, int, int]


@lru_cache(maxsize=8)
def _open(path: str, stamp: Stamp) -> Any:
    from moelab.engine.profiling.store import StoredProfile  # imported on first use only

    return StoredProfile.open(Path(path))


#: per opened profile (weakly: they go when ``_open``'s cache lets the profile go), results that depend
#: only on the profile and a few query values: the τ-independent CV statistics, the CV histograms
_DERIVED: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Any]] = weakref.WeakKeyDictionary()


def _derived(profile: Any, key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
    """``compute()`` once per profile and ``key``; the UI asks for the same chart on every slider move."""
    cache = _DERIVED.get(profile)
    if cache is None:
        cache = _DERIVED.setdefault(profile, {})
    if key not in cache:
        if len(cache) > 256:  # a few per layer of a 80-layer model; small lists each
            cache.clear()
        cache[key] = compute()
    return cache[key]


def _cv_stats(profile: Any) -> charts.CVStats:
    return _derived(profile, ("cv-stats",), lambda: charts.cv_stats(profile.cv_by_layer()))


class PayloadCache:
    """A bounded LRU of encoded JSON bodies (thread-safe: sync routes run in the thread pool).

    At most ``max_entries`` bodies and ``max_bytes`` in all; a body over ``max_item_bytes`` (a
    full-resolution activation map) is not kept. One per API process."""

    def __init__(self, max_entries: int = 512, max_bytes: int = 32 << 20, max_item_bytes: int = 2 << 20) -> None:
        self.max_entries, self.max_bytes, self.max_item_bytes = max_entries, max_bytes, max_item_bytes
        self._items: OrderedDict[Hashable, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: Hashable) -> bytes | None:
        with self._lock:
            body = self._items.get(key)
            if body is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return body

    def put(self, key: Hashable, body: bytes) -> None:
        if len(body) > self.max_item_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            self._items[key] = body
            self._bytes += len(body)
            while len(self._items) > self.max_entries or self._bytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= len(dropped)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes


#: encoded chart and preview bodies of this process, keyed by (endpoint, profile id, manifest stamp, query values)
PAYLOADS = PayloadCache()


def _manifest_stamp(manifest: Path) -> Stamp | None:
    try:
        st = manifest.stat()
    except OSError:  # gone (deleted, or being replaced)
        return None
    return (st.st_mtime_ns, st.st_ino, st.st_size)


_READY_QUERY = (
    select(Profile.id, Job.id.label("job_id"), Job.state, Job.error)
    .outerjoin(Job, Profile.job_id == Job.id).where(Profile.id == bindparam("profile_id"))
)


def _ready_profile(session, store, profile_id: str) -> tuple[Any, Stamp]:
    """The opened profile and its manifest stamp: 404 for an unknown id, 409 unless its job succeeded
    and its files are there. Checked on every request, cached bodies or not."""
    # the row and its job's state in one Core query: a third of the ORM's ``session.get`` (identity map,
    # joined-eager loading) on the request every chart and slider move makes; the same 404 and 409 answers
    found = session.connection().execute(_READY_QUERY, {"profile_id": profile_id}).first()
    if found is None:
        raise not_found("profile", profile_id, "profiles")
    job = None if found.job_id is None else SimpleNamespace(id=found.job_id, state=found.state, error=found.error)
    require_ready(SimpleNamespace(id=found.id, job=job), "profile")
    path = store.path("profiles", found.id)
    stamp = _manifest_stamp(path / "manifest.json")
    if stamp is None:
        raise ApiError(409, f"profile {profile_id} has no stored result; re-run its job")
    return _open(str(path), stamp), stamp


def stored_profile(session, store, profile_id: str) -> Any:
    return _ready_profile(session, store, profile_id)[0]


def _json(body: bytes) -> Response:
    return Response(body, media_type="application/json")


def _cached_body(key: tuple[Any, ...], profile: Any, stamp: Stamp, encode: Callable[[], bytes]) -> Response:
    """``encode()``'s body for ``key`` (which holds the profile id and ``stamp``), from ``PAYLOADS`` when
    there. A body is kept only if the manifest still has ``stamp`` once it is built, so a profile
    replaced while it was computed is never cached under the old stamp."""
    body = PAYLOADS.get(key)
    if body is None:
        body = encode()
        if _manifest_stamp(Path(profile.path) / "manifest.json") == stamp:
            PAYLOADS.put(key, body)
    return _json(body)


def _encode(model: BaseModel) -> bytes:
    """The body FastAPI would send for ``model`` as its ``response_model`` (``deps.encoded``'s)."""
    return encoded(model).body


def _layer(profile: Any, layer: int) -> int:
    if not 0 <= layer < profile.n_layers:
        raise ApiError(422, f"layer: profile has {profile.n_layers} layers, use 0 … {profile.n_layers - 1} (got {layer})")
    return layer


LayerQ = Annotated[int, Query(ge=0, le=MAX_INT, description="decoder layer index")]


def _group_means(profile: Any, layer: int) -> tuple[Any, list[str]]:
    """The layer's per-group mean gate activations ā_{j,t} ([groups, d_ffn], EW §3.1) and the group names."""
    return profile.group_means(layer), [str(g) for g in profile.manifest["groups"]]


@router.get("/profiles/{profile_id}/charts/cv-histogram", response_model=CVHistogram, tags=["profiles"],
            summary="Per-layer neuron CV histograms (EW Eq. 3), bins chosen server-side")
def cv_histogram(
    profile_id: str, session: SessionDep, store: StoreDep,
    bins: Annotated[int | None, Query(ge=2, le=500, description="fixed bin count; default: Freedman–Diaconis")] = None,
    clip_quantile: Annotated[float, Query(gt=0.5, le=1.0, allow_inf_nan=False, description="upper range = this quantile of all CVs")] = 0.99,
    scale: Annotated[Literal["log", "linear"], Query(description="log: geometric bins from the smallest positive CV "
                                                                 "(CV is heavy-tailed); linear: equal widths from 0")] = "log",
) -> Response:
    profile, stamp = _ready_profile(session, store, profile_id)
    return _cached_body(("cv-histogram", profile_id, stamp, bins, clip_quantile, scale), profile, stamp, lambda: _encode(
        CVHistogram(profile_id=profile_id, **charts.cv_histograms(profile.cv_by_layer(), bins, clip_quantile, scale))))


@router.get("/profiles/{profile_id}/charts/cv-summary", response_model=CVSummary, tags=["profiles"],
            summary="CV quantiles by layer (EW Fig. 2) and r_ℓ for a threshold τ")
def cv_summary(
    profile_id: str, session: SessionDep, store: StoreDep,
    tau: Annotated[float | None, Query(gt=0, allow_inf_nan=False, description="EW Eq. 4 threshold")] = None,
) -> Response:
    profile, stamp = _ready_profile(session, store, profile_id)
    return _cached_body(("cv-summary", profile_id, stamp, tau), profile, stamp, lambda: _encode(
        CVSummary(profile_id=profile_id, **charts.cv_summary(_cv_stats(profile), tau))))


@router.get("/profiles/{profile_id}/charts/activations", response_model=ActivationTiles, tags=["profiles"],
            summary="Neuron × task (or sample) activation map of one layer (EW Fig. 1), tiled when large")
def activations(
    profile_id: str, session: SessionDep, store: StoreDep, layer: LayerQ = 0,
    rows: Annotated[Literal["groups", "samples"], Query(description="tasks/groups of the CV, or single samples")] = "groups",
    order: Annotated[charts.Order, Query(description="neuron order: index, cv (desc) or task (peak task, then value)")] = "task",
    normalize: Annotated[charts.Normalize, Query()] = "none",
    max_rows: Annotated[int, Query(ge=1, le=2000)] = 256,
    max_cols: Annotated[int, Query(ge=8, le=4096)] = 512,
) -> Response:
    profile, stamp = _ready_profile(session, store, profile_id)
    _layer(profile, layer)

    def tiles() -> dict[str, Any]:
        cv = profile.cv_by_layer()[layer]
        if rows == "groups":
            values, labels = _group_means(profile, layer)
        else:
            samples = profile.samples
            values = profile.sample_means(layer)
            labels = [f"{g}#{i}" for i, g in zip(samples["sample"].tolist(), samples["group"].astype(str).tolist(), strict=True)]
        return charts.activation_tiles(values, labels, cv, order=order, normalize=normalize, max_rows=max_rows, max_cols=max_cols)

    return _cached_body(("activations", profile_id, stamp, layer, rows, order, normalize, max_rows, max_cols), profile, stamp,
                        lambda: _encode(ActivationTiles(profile_id=profile_id, layer=layer, row_kind=rows, **tiles())))


@router.get("/profiles/{profile_id}/charts/neuron-stats", response_model=NeuronStats, tags=["profiles"],
            summary="Activation-rate histogram of one layer's neurons (CM Fig. 2) and its h-value histogram")
def neuron_stats(
    profile_id: str, session: SessionDep, store: StoreDep, layer: LayerQ = 0,
    bins: Annotated[int, Query(ge=2, le=500, description="activation-rate bins")] = 50,
) -> Response:
    profile, stamp = _ready_profile(session, store, profile_id)
    _layer(profile, layer)
    return _cached_body(("neuron-stats", profile_id, stamp, layer, bins), profile, stamp, lambda: _encode(NeuronStats(
        profile_id=profile_id, layer=layer,
        **charts.neuron_stats(profile.column_by_layer("rate")[layer], *profile.h_histogram(layer), bins=bins))))


@router.get("/profiles/{profile_id}/neurons/{layer}/{neuron}", response_model=NeuronCard, tags=["profiles"],
            summary="One neuron's card: CV, mean, rate, per-task means and its top-activating tokens with snippets")
def neuron_card(profile_id: str, layer: IndexPath, neuron: IndexPath, session: SessionDep, store: StoreDep) -> NeuronCard:
    """The neuron's row of neurons.parquet (CV of EW Eq. 3 across the profile's ``cv_basis``), its mean
    gate activation per group (the neuron × task map's column) and its ``top_tokens`` top-activating
    tokens by |h| (CM Eq. 1), each with the tokens from 12 before to 4 after it in its sample. A snippet
    token's ``value`` is the neuron's h where the profile knows it, at its top-K tokens, and null
    elsewhere: a profile does not keep every activation. A profile made before top tokens (or with
    ``top_tokens=0``) answers with an empty ``top`` and a note saying to re-profile."""
    profile = stored_profile(session, store, profile_id)
    _layer(profile, layer)
    d_ffn = int(profile.manifest["d_ffn"][layer])
    if not 0 <= neuron < d_ffn:
        raise ApiError(422, f"neuron: layer {layer} has {d_ffn} neurons, use 0 … {d_ffn - 1} (got {neuron})")
    table = profile.neurons
    row = table[(table["layer"] == layer) & (table["neuron"] == neuron)].iloc[0]
    means, groups = _group_means(profile, layer)
    top, note = [], "profile predates top tokens (or was made with top_tokens=0): re-profile to see them"
    if profile.has_top_tokens:
        values, tokens = profile.top_tokens(layer)
        top = charts.top_token_snippets(values[neuron], tokens[neuron], profile.tokens, profile.samples)
        note = (f"top {len(top)} tokens by |h| over {profile.manifest['n_tokens']} calibration tokens; a snippet token's "
                "value is known only at the neuron's top tokens (null elsewhere)")
    num = lambda v: jsonable(float(v))  # noqa: E731  (NaN/inf → None)
    return NeuronCard(
        profile_id=profile_id, layer=layer, neuron=neuron, d_ffn=d_ffn, cv=num(row["cv"]), cv_basis=profile.manifest["cv_basis"],
        mean=num(row["mean"]), abs_mean=num(row["abs_mean"]), std=num(row["std"]), rate=num(row["rate"]), groups=groups,
        group_means=jsonable([float(v) for v in means[:, neuron]]), top_tokens=int(profile.manifest.get("top_tokens", 0)),
        top=top, note=note,
    )


@router.get("/profiles/{profile_id}/charts/task-similarity", response_model=TaskSimilarity, tags=["profiles"],
            summary="Task × task cosine similarity of mean gate activations")
def task_similarity(
    profile_id: str, session: SessionDep, store: StoreDep,
    layer: Annotated[int | None, Query(ge=0, le=MAX_INT, description="one layer; all layers when unset")] = None,
    centered: bool = True,
) -> TaskSimilarity:
    profile = stored_profile(session, store, profile_id)
    layers = [_layer(profile, layer)] if layer is not None else list(range(profile.n_layers))
    out = charts.task_similarity([profile.group_means(i) for i in layers], [str(g) for g in profile.manifest["groups"]], centered)
    return TaskSimilarity(profile_id=profile_id, layer=layer, **out)


#: Dense2MoE's parameters as query parameters: the model generated from its dataclass (one δ everywhere).
Dense2MoEQuery = Annotated[METHOD_PARAMS["dense2moe"], Query()]


@router.get("/profiles/{profile_id}/charts/layer-similarity", response_model=LayerSimilarity, tags=["profiles"],
            summary="Layer × layer similarity of outputs (S_L) and MLP inputs (S_M), Dense2MoE Eqs. 4–5, with the fusion a "
                    "dense2moe conversion would pick")
def layer_similarity(profile_id: str, query: Dense2MoEQuery, session: SessionDep, store: StoreDep) -> LayerSimilarity:
    """Query parameters: Dense2MoE's (``delta``, ``n_fused``, ``layer``, ``max_fused``, …; absent ones take their
    default). ``fusion`` is the engine's own plan for them (``methods.dense2moe.preview`` → ``choose_fusion``), so the
    page outlines exactly what a conversion fuses; ``fusion_error`` is the conversion's refusal otherwise."""
    return layer_similarity_payload(profile_id, stored_profile(session, store, profile_id), query)


def layer_similarity_payload(profile_id: str, profile: Any, query: Any) -> LayerSimilarity:
    """The layer-similarity answer for an opened profile and parsed Dense2MoE parameters."""
    method = REGISTRY["dense2moe"]
    params = method.params(**query.model_dump())
    fusion, error = None, None
    try:
        fusion = method.preview(profile, params)["fusion"]
    except ConversionError as exc:
        error = f"dense2moe: {exc}"
    out = charts.layer_similarity(profile.similarity("outputs"), profile.similarity("mlp_inputs"), jsonable(fusion))
    return LayerSimilarity(profile_id=profile_id, delta=params.delta, params=params.to_dict(), fusion_error=error, **out)


def _json_fallback(value: Any) -> Any:
    """What ``jsonable`` makes of the numpy values pydantic's encoder does not know (NaN/inf → null there)."""
    if isinstance(value, np.ndarray):
        return finite_list(value)
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _preview_body(profile_id: str, method_name: str, out: dict[str, Any]) -> bytes:
    """``MethodPreview(profile_id=…, method=…, **jsonable(out))`` as FastAPI would encode it, in one pass
    of pydantic's encoder: numpy values as ``jsonable`` makes them, NaN/inf as null."""
    payload = {"profile_id": profile_id, "method": method_name, "params": out["params"], "layers": out.get("layers"),
               "fusion": out.get("fusion"), "summary": out["summary"]}
    return to_json(payload, fallback=_json_fallback, inf_nan_mode="null")


def _preview(profile_id: str, method_name: str, query: dict[str, str], session, store, data_dir: Path) -> Response:
    """Parse ``query`` with the method's generated parameters model (422 on unknown or bad values),
    then run the method's numpy-only preview on the stored profile (its body cached per parameters and kernel
    table). A per-layer plan also gets its predicted speed per phase (``core.speed_prediction``) when the model's
    kernel times were measured on this machine."""
    method = REGISTRY.get(method_name)
    if method is None:
        raise ApiError(404, f"no method {method_name!r}; list them with GET /api/v1/methods")
    if method.preview is None:
        raise ApiError(422, f"{method_name} has no preview: it reads {method.needs.replace('_', ' ')}, not one profile's statistics")
    try:
        given = METHOD_PARAMS[method_name].model_validate(query)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("query", *e["loc"])} for e in exc.errors()]) from exc
    profile, stamp = _ready_profile(session, store, profile_id)
    # the designer's API and its workers share a host in every layout moelab starts (serve, docker-compose)
    here = cpu_machine_name()
    table = find_table(data_dir, (profile.manifest.get("model") or {}).get("source"), here)

    def encode() -> bytes:
        try:
            params = method.params(**given.model_dump())
            out = method.preview(profile, params)
        except ConversionError as exc:
            raise ApiError(422, f"{method_name}: {exc}") from exc
        if out.get("layers") and "d_expert" in out["layers"][0]:
            layers = plan_layers(out["layers"], getattr(params, "down_keep", 1.0))
            out["summary"]["predicted_speed"] = predicted_summary(table, layers, here)
        return _preview_body(profile_id, method_name, out)

    key = ("preview", profile_id, stamp, method_name, given.model_dump_json(), table and table["measured_at"])
    return _cached_body(key, profile, stamp, encode)


@router.get("/profiles/{profile_id}/preview/{method}", response_model=MethodPreview, tags=["profiles"],
            summary="What a conversion with these parameters would build, from the stored statistics (numpy only)")
def method_preview(profile_id: str, method: str, request: Request, session: SessionDep, store: StoreDep) -> Response:
    """Query parameters: the method's parameters (GET /api/v1/methods lists them; absent ones take their default)."""
    return _preview(profile_id, method, dict(request.query_params), session, store, request.app.state.settings.data_dir)


@router.get("/profiles/{profile_id}/allocation-preview", response_model=MethodPreview, tags=["profiles"],
            summary="Per-layer expert plan of ExpertWeaver (α_min/α_max/τ/N_e/sparsity) or CMoE (S·A·E) (< 1 ms)")
def allocation_preview(profile_id: str, request: Request, session: SessionDep, store: StoreDep,
                       method: Literal["expertweaver", "cmoe"] = "expertweaver") -> Response:
    """The partition methods' preview at their historical address: ``method`` plus that method's parameters."""
    query = {k: v for k, v in request.query_params.items() if k != "method"}
    return _preview(profile_id, method, query, session, store, request.app.state.settings.data_dir)


def _evaluation_record(store, ev: Evaluation) -> dict[str, Any]:
    path = store.path("evaluations", ev.id) / "evaluation.json"
    if not path.is_file():
        raise ApiError(409, f"evaluation {ev.id} has no stored result; re-run its job")
    return json.loads(path.read_text())


def _ready_record(session: Any, store: Any, evaluation_id: str) -> tuple[Evaluation, dict[str, Any]]:
    """A ready evaluation and its stored report (404 unknown, 409 not ready or without a report)."""
    ev = lookup(session, Evaluation, evaluation_id, "evaluation", "evaluations")
    require_ready(ev, "evaluation")
    return ev, _evaluation_record(store, ev)


def _for_variant(chart: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``chart()``; a variant the report lacks (KeyError) is the client's 422."""
    try:
        return chart()
    except KeyError as exc:
        raise ApiError(422, f"variant: {exc.args[0]}") from exc


def _label(ev: Evaluation) -> str:
    return str(ev.params.get("label") or ev.params.get("source") or ev.id)


@router.get("/conversions/{conversion_id}/charts/routing", response_model=RoutingHeatmap, tags=["conversions"],
            summary="Routing heatmap layer × expert × set from this conversion's evaluations (EW Fig. 8)")
def conversion_routing(
    conversion_id: str, session: SessionDep, store: StoreDep,
    evaluation_id: Annotated[list[str] | None, Query(description="evaluations to include (default: all succeeded)")] = None,
    variant: Annotated[str, Query(max_length=40, description="converted, uniform, …")] = "converted",
) -> RoutingHeatmap:
    conversion = lookup(session, Conversion, conversion_id, "conversion", "conversions")
    if evaluation_id:
        evs = []
        for ident in evaluation_id:
            ev = lookup(session, Evaluation, ident, "evaluation", "evaluations")
            if ev.conversion_id != conversion.id:
                raise ApiError(422, f"evaluation_id: {ident} evaluates conversion {ev.conversion_id}, not {conversion.id}")
            require_ready(ev, "evaluation")
            evs.append(ev)
    else:
        evs = session.execute(
            select(Evaluation).join(Job, Evaluation.job_id == Job.id)
            .where(Evaluation.conversion_id == conversion.id, Job.state == "succeeded").order_by(Evaluation.created_at)
        ).scalars().unique().all()
        if not evs:
            raise ApiError(409, f"conversion {conversion_id} has no succeeded evaluation yet; POST /api/v1/evaluations first")
    out = _for_variant(lambda: charts.routing_heatmap([(ev.id, _label(ev), _evaluation_record(store, ev)) for ev in evs], variant))
    return RoutingHeatmap(conversion_id=conversion.id, **out)


@router.get("/evaluations/{evaluation_id}/charts/routing", response_model=RoutingHeatmap, tags=["evaluations"],
            summary="Routing heatmap layer × expert of one evaluation")
def evaluation_routing(
    evaluation_id: str, session: SessionDep, store: StoreDep,
    variant: Annotated[str, Query(max_length=40)] = "converted",
) -> RoutingHeatmap:
    ev, record = _ready_record(session, store, evaluation_id)
    out = _for_variant(lambda: charts.routing_heatmap([(ev.id, _label(ev), record)], variant))
    return RoutingHeatmap(conversion_id=ev.conversion_id, **out)


@router.get("/evaluations/{evaluation_id}/charts/layers", response_model=LayerCurves, tags=["evaluations"],
            summary="Per-layer curves of one evaluation: reconstruction error, load CV, token share per expert (for run overlays)")
def evaluation_layers(
    evaluation_id: str, session: SessionDep, store: StoreDep,
    variant: Annotated[str, Query(max_length=40)] = "converted",
) -> LayerCurves:
    ev, record = _ready_record(session, store, evaluation_id)
    out = _for_variant(lambda: charts.layer_curves(record, variant))
    return LayerCurves(evaluation_id=ev.id, conversion_id=ev.conversion_id, text=_label(ev), **out)
