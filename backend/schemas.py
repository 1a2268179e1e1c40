"""The API contract: request and response models (separate from the SQL tables in ``db``).

Conversion parameters are generated from the engine's method registry (``workers.engine.methods``):
a slider in the UI, a field here, a CLI option and a field of the method's parameter dataclass
carry one name, one default and one set of bounds.

Validation that needs only the request lives here (α_min ≤ α_max, τ > 0, sparsity in (0, 1),
S + A ≤ E …) and answers 422 with what to fix; checks that need stored state (experts that
fit the profile's d_ffn, a profile that failed) are made by the routes.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, create_model, model_validator

from workers.engine.core.params import DeclaredParams, ParamSpec
from workers.engine.data.builtin import BUILTIN_SETS
from workers.engine.methods import REGISTRY, Method
from workers.engine.profiling.settings import ProfileSettings
from workers.engine.runtime.gguf_layout import GGUF_TYPES
from workers.engine.sizes import parse_size
from workers.engine.text import first_text_problem
from workers.engine.training.params import FinetuneMode, FinetuneParams

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
ResourceStatus = Literal["queued", "running", "ready", "failed", "cancelled"]
JobKind = Literal["inspect_model", "build_calibration", "profile", "conversion", "evaluation", "finetune", "probe", "activation_probe",
                  "export"]
BuiltinName = Literal[tuple(BUILTIN_SETS)]  # type: ignore[valid-type]


class _In(BaseModel):
    """Request bodies refuse unknown fields: a typo (``alpha-max``) must not silently use a default.
    They refuse non-finite numbers too (``Infinity``, ``NaN``, ``1e999``): a bound like ``gt=0`` lets
    ``inf`` through, and the stored parameters would no longer be standard JSON.
    They refuse text a store would refuse later (a NUL, a lone surrogate: PostgreSQL, UTF-8 files) and
    take booleans as JSON booleans only (``"no"`` is not ``false``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _storable_text(cls, data: Any) -> Any:
        problem = first_text_problem(data)
        if problem:
            raise ValueError(problem)
        return data


#: the largest integer any parameter takes: JSON's exact range (IEEE doubles), so a JavaScript client can say every
#: accepted value, and far below the 64-bit limits of SQL (an ``OFFSET`` of 2**64 overflows SQLite) and torch seeds
MAX_INT = 2**53


# --------------------------------------------------------------------------- notes and tags

TAG_PATTERN = r"^[\w][\w .:+/-]{0,39}$"
MAX_TAGS = 16
MAX_NOTES = 20_000
Tag = Annotated[str, Field(pattern=TAG_PATTERN, description="1–40 characters: letters, digits, _ . : + / - and spaces, "
                                                                   "starting with a letter, digit or _")]


class _Noted(BaseModel):
    """What every stored resource carries of its user's own: notes and tags (``PATCH`` sets them)."""

    notes: str | None = Field(None, description="the user's free-text notes on this resource")
    tags: list[str] = Field(default_factory=list, description="the user's labels, to find it again (lists filter by ?tag=)")


class NotesUpdate(_In):
    """Replace a resource's notes and/or tags; a field left out stays as it is."""

    notes: str | None = Field(None, max_length=MAX_NOTES, description="new notes ('' clears them)")
    tags: list[Tag] | None = Field(None, max_length=MAX_TAGS, description=f"the new tags, at most {MAX_TAGS} (replaces the old ones; [] clears them)")
    add_tags: list[Tag] = Field(default_factory=list, max_length=MAX_TAGS, description="tags to add to the present ones")
    remove_tags: list[Tag] = Field(default_factory=list, max_length=MAX_TAGS, description="tags to take away")

    @model_validator(mode="after")
    def _one_way(self) -> NotesUpdate:
        if self.tags is not None and (self.add_tags or self.remove_tags):
            raise ValueError("give either tags (replaces them all) or add_tags / remove_tags, not both")
        if self.notes is None and self.tags is None and not self.add_tags and not self.remove_tags:
            raise ValueError("nothing to change: give notes, tags, add_tags or remove_tags")
        return self


class NotesOut(_Noted):
    id: str
    resource: str = Field(description="the collection, e.g. 'evaluations'")


class TagCount(BaseModel):
    tag: str
    count: int = Field(description="resources carrying it")
    resources: dict[str, int] = Field(description="how many in each collection")


class TagList(BaseModel):
    items: list[TagCount]


# --------------------------------------------------------------------------- jobs


class ProgressOut(BaseModel):
    stage: str | None = Field(None, description="what the engine is doing, e.g. 'profile' or 'cluster experts'")
    current: int = 0
    total: int = 0
    fraction: float | None = Field(None, description="current / total within the stage, when total > 0")
    stage_s: float | None = Field(None, description="seconds the present stage has run (or ran, once the job ended)")
    stage_left_s: float | None = Field(None, description="a running stage's time left at its pace so far (stage_s / current × "
                                       "(total − current)); stages ahead are not counted")


class JobOut(BaseModel):
    id: str = Field(description="job id; also the Celery task id")
    kind: JobKind
    state: JobState
    queue: str
    resource_type: str
    resource_id: str
    progress: ProgressOut
    cancel_requested: bool
    error: str | None = Field(None, description="why it failed or was cancelled, and what to do")
    error_type: str | None = Field(None, description="invalid_input | worker_lost | worker_shutdown | cancelled | out_of_memory | storage (no space left: an operator error) | internal")
    worker: str | None = None
    retry_of: str | None = Field(None, description="the job this one re-runs")
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    heartbeat_at: datetime | None = None
    progress_at: datetime | None = Field(None, description="when the worker last reported progress (at least every few seconds "
                                         "while it runs: MOELAB_PROGRESS_TICK_S)")
    queued_s: float | None = Field(None, description="seconds from creation to start (or until now)")
    queue_position: int | None = Field(None, description="a queued job's place in its queue's line (1: the next to start "
                                       "when a worker of that queue is free)")
    run_s: float | None = Field(None, description="seconds from start to end (or until now)")
    timings: dict[str, Any] | None = Field(None, description="engine timings of a finished job")


class JobList(BaseModel):
    items: list[JobOut]
    total: int


# --------------------------------------------------------------------------- models


class ModelCreate(_In):
    source: str = Field(
        "default", min_length=1, max_length=1000,
        description="'default' (SmolLM2-135M-Instruct, offline), a Hugging Face id (org/name) or a local "
        "directory / .gguf file on the server",
    )
    name: str | None = Field(None, max_length=200, description="display name; defaults to the source's last part")
    trust_remote_code: StrictBool = Field(False, description="run the model repository's own code (the server must allow it)")


class ModelOut(_Noted):
    id: str
    name: str
    source: str
    kind: Literal["default", "local", "hf"]
    trust_remote_code: bool
    status: ResourceStatus = Field(description="'ready' once the inspection job has described the model")
    info: dict[str, Any] | None = Field(None, description="layer structure (engine ModelAdapter.describe()); memory: weight "
                                        "bytes in total, of the largest layer, and min_max_memory, the least max_memory a profile streams in")
    job_id: str | None
    job: JobOut | None = None
    created_at: datetime


class ModelList(BaseModel):
    items: list[ModelOut]
    total: int


class LayerOut(BaseModel):
    index: int
    d_ffn: int


class ModelLayers(BaseModel):
    model_id: str
    family: str
    tested_family: bool
    activation: str
    n_layers: int
    d_model: int
    fused_gate_up: bool
    n_parameters: int
    n_ffn_parameters: int
    layers: list[LayerOut]


# --------------------------------------------------------------------------- calibration sets


class BuiltinSetOut(BaseModel):
    name: str
    description: str
    spec: str
    domains: list[str] = Field(default_factory=list, description="the built-in sources it draws from (mixed: all six); a held-out "
                               "text of none of a conversion's calibration domains is out of domain")


class BuiltinCalibrationCreate(_In):
    source: Literal["builtin"]
    name: BuiltinName = Field(description="built-in set (GET /calibration-sets/builtins)")  # type: ignore[valid-type]
    samples: int = Field(240, ge=1, le=20000, description="number of samples drawn")
    seed: int = Field(0, ge=0)
    split: Literal["calibration", "heldout"] = "calibration"


class HFCalibrationCreate(_In):
    source: Literal["hf"]
    dataset: str = Field(min_length=1, max_length=1000, description="Hugging Face dataset name ('name' or 'org/name'), or the absolute path of a data file / directory "
                         "inside DATA_DIR/uploads or a directory the server lists in MOELAB_DATA_ROOTS (others: 403)")
    split: str = Field("train", min_length=1, max_length=100, pattern=r"^[\w.\-\[\]:%]+$")
    config: str | None = Field(None, max_length=200)
    text_field: str = Field("text", min_length=1, max_length=200)
    task_field: str = Field("task", min_length=1, max_length=200)
    domain_field: str = Field("domain", min_length=1, max_length=200)
    samples: int | None = Field(None, ge=1, le=20000, description="task-balanced subsample; all rows when unset")
    seed: int = Field(0, ge=0)


CalibrationCreate = Annotated[BuiltinCalibrationCreate | HFCalibrationCreate, Field(discriminator="source")]


class CalibrationSetOut(_Noted):
    id: str
    name: str
    origin: Literal["builtin", "upload", "hf"]
    params: dict[str, Any]
    content_id: str | None = Field(None, description="engine content id (same text → same id)")
    status: ResourceStatus
    stats: dict[str, Any] | None = Field(None, description="samples and characters overall, per task and per domain")
    job_id: str | None
    job: JobOut | None = None
    created_at: datetime


class CalibrationSetList(BaseModel):
    items: list[CalibrationSetOut]
    total: int


class SampleOut(BaseModel):
    index: int
    text: str
    chars: int
    truncated: bool
    task: str | None
    domain: str | None


class SamplePage(BaseModel):
    calibration_set_id: str
    offset: int
    limit: int
    total: int = Field(description="samples matching the filter")
    items: list[SampleOut]


# --------------------------------------------------------------------------- declared parameters


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
    """A request body generated from a parameter declaration (``workers.engine.core.params``): one
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


# --------------------------------------------------------------------------- profiles


class _ProfileRequest(_In):
    """``POST /profiles``: the model, the calibration set, how much of it and the memory budget; the
    profiler's settings (``workers.engine.profiling.settings.ProfileSettings``) are generated."""

    model_id: str
    calibration_set_id: str
    samples: int | None = Field(None, ge=1, le=100000, description="task-balanced subsample of the set; all when unset")
    max_memory: str | None = Field(
        None, max_length=32, examples=["2GiB", "512MB"],
        description="memory budget: a model whose weights exceed it is profiled one decoder layer at a time "
        "(same statistics); below one layer's weights: 422 naming the minimum; unset: the worker's MOELAB_MAX_MEMORY",
    )

    @model_validator(mode="after")
    def _batch_holds_a_sample(self) -> _ProfileRequest:
        if self.batch_tokens < self.max_tokens:  # generated fields (ProfileCreate)
            raise ValueError(
                f"batch_tokens ({self.batch_tokens}) must be ≥ max_tokens ({self.max_tokens}): "
                "a batch has to hold at least one whole sample"
            )
        if self.max_memory is not None:
            parse_size(self.max_memory)  # its ValueError says how to write a size
        return self


ProfileCreate = declared_model(ProfileSettings, "ProfileCreate", base=_ProfileRequest)


class ProfileOut(_Noted):
    id: str
    model_id: str
    calibration_set_id: str
    params: dict[str, Any]
    status: ResourceStatus
    summary: dict[str, Any] | None = Field(None, description="layers, d_ffn, tokens, CV basis, groups, timings")
    job_id: str | None
    job: JobOut | None = None
    created_at: datetime


class ProfileList(BaseModel):
    items: list[ProfileOut]
    total: int


# --------------------------------------------------------------------------- allocation and conversions


def method_params_model(method: Method) -> type[BaseModel]:
    """The request body block of one method, generated from its parameter dataclass: the same
    names, types, defaults, bounds and help as the engine, the CLI and ``GET /methods``. Rules that
    relate several fields are the engine's own ``check()`` (a 422 with its message)."""

    def engine_check(self: BaseModel) -> BaseModel:
        method.params(**self.model_dump()).check()  # ConversionError is a ValueError: 422
        return self

    title = "".join(part.capitalize() for part in method.name.split("_"))
    return declared_model(method.params, f"{title}Params", doc=f"{method.title} ({method.paper}): {method.summary}",
                          validators={"engine_check": model_validator(mode="after")(engine_check)})


#: One generated parameters model per registered method.
METHOD_PARAMS: dict[str, type[BaseModel]] = {name: method_params_model(m) for name, m in REGISTRY.items()}
ConversionMethod = Literal[tuple(REGISTRY)]  # type: ignore[valid-type]


class _ConversionBase(_In):
    method: ConversionMethod = Field("expertweaver", description="the conversion method (GET /api/v1/methods lists them)")  # type: ignore[valid-type]
    profile_id: str | None = Field(None, description="the dense model's profile (methods that read a profile)")
    extra_profile_ids: list[str] = Field(
        default_factory=list, max_length=63, description="midas: profiles of the other calibration sets (same model)"
    )
    model_id: str | None = Field(None, description="hierarchical: the registered MoE model")
    calibration: str | None = Field(
        None, max_length=200, description="hierarchical: builtin:NAME or the id of a stored calibration set"
    )
    max_memory: str | None = Field(
        None, max_length=32, examples=["2GiB"],
        description="memory budget: when the dense model's weights exceed it, an expertweaver/cmoe conversion (paper "
        "routers, paper plan) runs one decoder layer at a time into the export (same result); below one layer's "
        "weights: 422 naming the minimum; unset: the worker's MOELAB_MAX_MEMORY",
    )

    @model_validator(mode="after")
    def _inputs_of_method(self) -> "_ConversionBase":
        if self.max_memory is not None:
            try:
                parse_size(self.max_memory)
            except ValueError as exc:  # it says how to write a size
                raise ValueError(f"max_memory: {exc}") from None
        m = self.method
        others = [name for name in REGISTRY if name != m and getattr(self, name) is not None]
        if others:
            raise ValueError(f"parameter block(s) {', '.join(others)} given, but method is {m!r}: put the parameters in {m!r}")
        needs = REGISTRY[m].needs
        if needs == "moe_model":
            if not self.model_id or not self.calibration:
                raise ValueError(f"{m} conversion needs model_id (an MoE model) and calibration (e.g. builtin:mixed)")
            if self.profile_id or self.extra_profile_ids:
                raise ValueError(f"{m} conversion profiles the MoE model itself: drop profile_id")
            return self
        if not self.profile_id:
            raise ValueError(f"{m} conversion needs profile_id (profile the dense model first)")
        if needs == "profiles" and not self.extra_profile_ids:
            raise ValueError(f"{m} builds one expert per calibration set: give extra_profile_ids (≥ 1 more profile of the same model)")
        if needs == "profile" and self.extra_profile_ids:
            several = ", ".join(n for n, x in REGISTRY.items() if x.needs == "profiles")
            raise ValueError(f"{m} reads one profile; only {several} take(s) extra_profile_ids")
        return self

    def engine_params(self) -> dict[str, Any]:
        """The engine's parameters dict for this request (``workers.engine.methods.params_from_dict``)."""
        block = getattr(self, self.method) or METHOD_PARAMS[self.method]()
        return {"method": self.method, **block.model_dump()}


#: ``POST /conversions`` body: the method, its inputs and one parameter block named after the method.
ConversionCreate = create_model(
    "ConversionCreate", __base__=_ConversionBase,
    **{name: (model | None, Field(None, description=f"{REGISTRY[name].title} parameters (used when method is {name!r})"))
       for name, model in METHOD_PARAMS.items()},
)


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
    params: list[ParamOut]
    recipes: dict[str, dict[str, Any]] = Field(
        description="named parameter sets: 'paper' (the defaults: the paper's settings) and, where measured, 'best' "
                    "(the best training-free conversion found, tests/benchmarks/bench_frontier.py); "
                    "each maps parameter names to the values it sets over the defaults")


class MethodList(BaseModel):
    items: list[MethodOut]


# --------------------------------------------------------------------------- exports (GGUF for llama.cpp / Ollama)

GgufType = Literal[GGUF_TYPES]  # type: ignore[valid-type]


class GgufCheck(BaseModel):
    """Whether a conversion's layout exports to GGUF exactly, read from its stored config.json (no model loaded)."""

    exportable: bool = Field(description="its layout maps exactly onto llama.cpp's deepseek MoE architecture")
    reason: str | None = Field(None, description="why not: what blocks it, and which conversion would export")
    types: list[GgufType] = Field(description="the GGUF types an export can be written in")  # type: ignore[valid-type]


class ExportCreate(_In):
    format: Literal["gguf"] = Field("gguf", description="gguf: one .gguf file that stock llama.cpp and Ollama run")
    type: GgufType = Field("f16", description="weight type of the file: f32 (exact), f16 or q8_0 (8-bit, about a quarter of f32)")  # type: ignore[valid-type]


class ExportOut(_Noted):
    id: str
    conversion_id: str
    format: Literal["gguf"]
    type: str
    status: ResourceStatus = Field(description="'ready' once its job has written the file")
    params: dict[str, Any] = Field(description="format and type, and the estimate the job was checked against "
                                   "(weights, file_bytes, disk_bytes, memory_bytes)")
    summary: dict[str, Any] | None = Field(None, description="file (its name), bytes, architecture (deepseek), layout")
    file: str | None = Field(None, description="the .gguf file's name, once ready")
    bytes: int | None = Field(None, description="its size, once ready")
    download_url: str | None = Field(None, description="GET it to download the .gguf (streamed), once ready")
    archive_url: str | None = Field(None, description="the .gguf with its Ollama Modelfile and model card as a zip, once ready")
    files: list["ArtifactFile"] | None = Field(None, description="every file of the export (detail view only, once ready)")
    job_id: str | None
    job: JobOut | None = None
    created_at: datetime


class ExportList(BaseModel):
    items: list[ExportOut]
    total: int
    gguf: GgufCheck | None = Field(None, description="the conversion's GGUF check (listing one conversion's exports only)")


class ConversionOut(_Noted):
    id: str
    method: str = Field(description="expertweaver, cmoe, dense2moe, midas or hierarchical")
    profile_id: str | None = Field(None, description="the profile it was made from (null for hierarchical)")
    model_id: str | None = Field(None, description="hierarchical: the MoE model it restructures")
    params: dict[str, Any]
    status: ResourceStatus
    summary: dict[str, Any] | None = Field(None, description="active fraction, static and clamped layers, timings")
    layers: list[dict[str, Any]] | None = Field(None, description="per-layer plan and clustering (detail view only)")
    gguf: GgufCheck | None = Field(None, description="whether it exports to GGUF and why not (null until it is ready)")
    exports: list[ExportOut] = Field(default_factory=list, description="its exports (POST /conversions/{id}/exports), newest first")
    job_id: str | None
    job: JobOut | None = None
    created_at: datetime


class ConversionList(BaseModel):
    items: list[ConversionOut]
    total: int


# --------------------------------------------------------------------------- evaluations


#: An lm-eval task name (its registry's names: letters, digits, ``_ - .``).
TaskName = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")]


class TaskOut(BaseModel):
    name: str
    source: Literal["builtin", "task_dir", "lm-eval"] = Field(description="moelab's built-in tasks, the task_dir's, lm-eval's registry")
    offline: bool = Field(description="runs without network: built-in and task_dir tasks; lm-eval's need their data cached")
    domain: str | None = Field(None, description="a built-in task: the built-in set its text comes from (builtin:chat …), "
                               "so a conversion's calibration tells whether the task is in its domain")
    needs: str | None = Field(None, description="what installs its data first (moelab_bigbench_mc: moelab data install bigbench)")


class TaskList(BaseModel):
    items: list[TaskOut]
    total: int = Field(description="tasks listed, before any paging of lm-eval's registry")


class EvaluationCreate(_In):
    conversion_id: str
    source: str = Field(
        "builtin:mixed", min_length=1, max_length=200,
        description="held-out text: builtin:NAME (its held-out split) or the id of a stored calibration set",
    )
    n_windows: int = Field(32, ge=1, le=4096, description="non-overlapping token windows; n_windows × seq_len is at most "
                           "MOELAB_MAX_EVAL_TOKENS (422 beyond)")
    seq_len: int = Field(256, ge=8, le=32768, description="tokens per window; at most the model's max_position_embeddings")
    baselines: StrictBool = Field(True, description="also evaluate AbsTopK-GLU, the uniform allocation and TEAL "
                            "(activation sparsity) at the conversion's FFN cost")
    speed: StrictBool = Field(True, description="time the whole converted model against its dense model in the same "
                              "process, interleaved (decode at batch 1 and 8, prefill of up to 512 tokens; median of 3): "
                              "the summary's speed, in seconds and × dense, with the device, dtype, threads and runtime")
    multiple_choice_per_task: int = Field(
        50, ge=0, le=10000, description="BIG-bench multiple-choice items per task when that set is installed (0: skip): "
        "lm-eval task moelab_bigbench_mc, reported in the summary's tasks"
    )
    tasks: list[TaskName] = Field(
        default_factory=list, max_length=16,
        description="lm-evaluation-harness tasks scored on every model evaluated (accuracy ± stderr): moelab's built-in "
        "ones (GET /api/v1/tasks), lm-eval's registry (their data must be in the server's HF cache), or task_dir's",
    )
    num_fewshot: int | None = Field(None, ge=0, le=64, description="few-shot examples per item; unset: each task's own")
    limit: int | None = Field(None, ge=1, le=100000, description="items per task; unset: all")
    task_dir: str | None = Field(
        None, min_length=1, max_length=4096,
        description="a server directory of lm-eval task YAMLs inside MOELAB_DATA_ROOTS (not uploads: a task YAML may "
        "run Python through !function, so only directories the server's administrator placed are read)",
    )

    @model_validator(mode="after")
    def _known_builtin(self) -> EvaluationCreate:
        if self.source.startswith("builtin:") and self.source[len("builtin:"):] not in BUILTIN_SETS:
            raise ValueError(f"unknown built-in set {self.source!r}; use one of: " + ", ".join(f"builtin:{n}" for n in BUILTIN_SETS))
        return self


class EvaluationOut(_Noted):
    id: str
    conversion_id: str
    params: dict[str, Any]
    status: ResourceStatus
    summary: dict[str, Any] | None = Field(
        None, description="per variant: perplexity, ratio to dense, tokens/s, mean reconstruction error and load CV, multiple-choice "
        "accuracy; speed: the converted model's time per phase against dense's (when timed)"
    )
    job_id: str | None
    job: JobOut | None = None
    created_at: datetime


class EvaluationList(BaseModel):
    items: list[EvaluationOut]
    total: int



# --------------------------------------------------------------------------- recovery fine-tuning

class _FinetuneRequest(_In):
    """Recovery fine-tuning of a ready conversion; the hyper-parameters are generated from
    ``workers.engine.training.params.FinetuneParams`` (names, defaults, bounds).

    The engine's ``validate`` makes the checks that need several fields or the conversion
    (answered 422 with its message).
    """

    conversion_id: str
    mode: FinetuneMode | None = Field(
        None, description="what is trained and how; default: the conversion's method (expertweaver → expertweaver, cmoe → cmoe, "
        "midas → midas, dense2moe → dense2moe)",
    )
    source: str = Field(
        "builtin:mixed", min_length=1, max_length=200,
        description="training text: builtin:NAME (its calibration split) or the id of a stored calibration set",
    )
    eval_source: str | None = Field(
        None, min_length=1, max_length=200,
        description="held-out text for perplexity before / after / dense: builtin:NAME (its held-out split); default: source "
        "when it is a built-in, else builtin:mixed",
    )

    @model_validator(mode="after")
    def _known_builtin(self) -> _FinetuneRequest:
        for name in ("source", "eval_source"):
            value = getattr(self, name)
            if value is not None and value.startswith("builtin:") and value[len("builtin:"):] not in BUILTIN_SETS:
                raise ValueError(f"{name}: unknown built-in set {value!r}; use one of: " + ", ".join(f"builtin:{n}" for n in BUILTIN_SETS))
        if self.eval_source is not None and not self.eval_source.startswith("builtin:"):
            raise ValueError(f"eval_source {self.eval_source!r}: perplexity needs a held-out split, which only built-in sets have; "
                             "use builtin:NAME")
        return self


FinetuneCreate = declared_model(FinetuneParams, "FinetuneCreate", base=_FinetuneRequest)


class FinetuneOut(_Noted):
    id: str
    conversion_id: str = Field(description="the conversion being fine-tuned")
    params: dict[str, Any] = Field(description="the engine's parameters (mode resolved)")
    status: ResourceStatus
    summary: dict[str, Any] | None = Field(
        None, description="perplexity before / after / dense, steps, tokens, seconds, result_conversion_id"
    )
    result_conversion_id: str | None = Field(None, description="the fine-tuned model as a conversion (evaluate it like any other)")
    job_id: str | None
    job: JobOut | None = None
    created_at: datetime


class FinetuneList(BaseModel):
    items: list[FinetuneOut]
    total: int


class TrainStep(BaseModel):
    step: int
    loss: float | None = Field(None, description="total loss (1 − w)·L_NTP + w·L_KD + λ·L_LB (EW Eq. 12; w = distill)")
    ntp_loss: float | None = Field(None, description="next-token prediction loss")
    kd_loss: float | None = Field(None, description="distillation loss KL(dense ‖ converted) per token; null when distill is 0")
    aux_loss: float | None = Field(None, description="load-balancing loss L_LB (EW Eq. 12); null when the routers have no probabilities")
    load_cv: float | None = Field(None, description="mean over layers of the step's expert-load CV (MI Eq. 7)")
    lr: float | None = None
    tokens: int | None = Field(None, description="training tokens seen so far")
    elapsed_s: float | None = None


class TrainLog(BaseModel):
    finetune_id: str
    state: JobState | None = Field(None, description="state of the fine-tune's latest job")
    status: str | None = Field(None, description="the trainer's own status in its log; null before it wrote one")
    mode: str | None = None
    total_steps: int = Field(description="steps asked for")
    n_steps: int = Field(description="steps logged so far (across resumed runs)")
    steps: list[TrainStep] = Field(description="logged steps in order; bucket means of consecutive steps when aggregated")
    aggregated: bool = Field(description="True when more than max_points steps were logged and buckets were averaged")
    resumed_at: list[int] = Field(default_factory=list, description="steps a re-run resumed from (its checkpoints)")
    perplexity_before: float | None = Field(None, description="the conversion as it was")
    perplexity_start: float | None = Field(None, description="where training starts (differs when the mode re-parameterises the routers)")
    perplexity_after: float | None = None
    dense_perplexity: float | None = Field(None, description="the dense model on the same held-out windows")
    result_conversion_id: str | None = None

class ExpertOut(BaseModel):
    expert: int = Field(description="routed expert id in its layer (as in routing heatmaps and probes)")
    neurons: list[int] = Field(description="the dense FFN's neuron ids this expert holds")
    cv: list[float] | None = Field(None, description="each neuron's CV (EW Eq. 3) in the conversion's profile; null without it")


class ExpertNeurons(BaseModel):
    conversion_id: str
    profile_id: str | None
    layer: int
    shared: list[int] = Field(description="neurons of the shared expert (run for every token)")
    shared_cv: list[float] | None = None
    experts: list[ExpertOut]


class MatchedExpert(BaseModel):
    expert: int = Field(description="routed expert id in its own conversion's layer")
    size: int = Field(description="its number of dense neurons")
    match: int | None = Field(description="the other conversion's expert assigned to it (maximum total Jaccard); "
                                          "null: unmatched (surplus expert, or no common neuron)")
    jaccard: float | None = Field(description="Jaccard index of the expert and its match (their neuron sets)")
    best: int | None = Field(description="the other conversion's expert sharing most neurons with it (may differ from the "
                                         "assigned match); null without any common neuron")
    best_jaccard: float


class LayerMatchingOut(BaseModel):
    layer: int
    n_a: int
    n_b: int
    a: list[MatchedExpert] = Field(description="A's routed experts, each with its match in B")
    b: list[MatchedExpert] = Field(description="B's routed experts, each with its match in A")
    mean_jaccard: float = Field(description="the assignment's total Jaccard over min(n_a, n_b) pairs")
    shared_jaccard: float | None = Field(description="Jaccard index of the two shared experts' neurons (null: neither has one)")
    shared_sizes: list[int] = Field(description="neurons of A's and B's shared expert")
    jaccard: list[list[float]] | None = Field(None, description="[n_a][n_b] Jaccard of every pair; only when one layer is asked")


class SkippedLayer(BaseModel):
    layer: int
    reason: str = Field(description="why this layer has no experts made of dense neurons in A or B")


class ExpertMatching(BaseModel):
    a: str = Field(description="conversion A's id")
    b: str = Field(description="conversion B's id")
    method_a: str
    method_b: str
    layers: list[LayerMatchingOut]
    skipped: list[SkippedLayer]


# --------------------------------------------------------------------------- probes (token routing, playground)

#: held-out samples a probe can pick per built-in set (``workers.engine.runs.HELDOUT_PICK``)
PROBE_HELDOUT_PICK = 48
PROBE_MAX_TEXT = 20_000  # characters; routing reads at most 512 tokens of it


class ProbeCreate(_In):
    """A short look at a ready conversion on one text, run as a job on a worker (the API runs no model).

    ``kind: routing``: the expert every token is routed to, per layer. ``kind: generate``: ``text``
    as a prompt, greedily continued by the dense and the converted model, each timed. The text is
    either given (``text``) or a held-out sample of a built-in set (``sample_source`` + ``sample``).
    """

    conversion_id: str
    kind: Literal["routing", "generate"] = "routing"
    text: str | None = Field(None, min_length=1, max_length=PROBE_MAX_TEXT, description="the text (routing) or prompt (generate)")
    sample_source: str | None = Field(None, description="builtin:NAME: probe a held-out sample of that set instead of text")
    sample: int = Field(0, ge=0, lt=PROBE_HELDOUT_PICK, description=f"which of the set's first {PROBE_HELDOUT_PICK} held-out samples")
    max_new_tokens: int = Field(32, ge=1, le=256, description="tokens each model generates (generate only)")

    @model_validator(mode="after")
    def _one_text(self) -> ProbeCreate:
        if (self.text is None) == (self.sample_source is None):
            raise ValueError("give exactly one of text or sample_source (builtin:NAME, with sample)")
        if self.sample_source is not None:
            name = self.sample_source.removeprefix("builtin:")
            if not self.sample_source.startswith("builtin:") or name not in BUILTIN_SETS or name == "bigbench":
                raise ValueError(f"sample_source {self.sample_source!r}: use one of "
                                 + ", ".join(f"builtin:{n}" for n in BUILTIN_SETS if n != "bigbench"))
        if self.text is not None and not self.text.strip():
            raise ValueError("text is blank: give at least one word")
        return self


class ProbeOut(_Noted):
    id: str
    conversion_id: str
    params: dict[str, Any]
    status: ResourceStatus
    summary: dict[str, Any] | None = Field(
        None, description="routing: tokens and per layer the experts of every token; generate: dense and converted text, "
        "tokens/s and the speed-up (the whole result is also the artifact probes/<id>/probe.json)",
    )
    job_id: str | None
    job: JobOut | None = None
    created_at: datetime


class ProbeList(BaseModel):
    items: list[ProbeOut]
    total: int


# --------------------------------------------------------------------------- activation probes (neurons on any text)

#: tokens and neurons an activation probe reads at most (``workers.engine.evaluation.activations``)
ACTIVATION_MAX_TOKENS = 512
ACTIVATION_MAX_NEURONS = 64


class ActivationProbeCreate(_In):
    """Chosen neurons of one layer of a ready profile's dense model on one text: their FFN activation
    h = act(x W_gate) ⊙ (x W_up) (CM Eq. 1, the quantity of the profile's top tokens) on every token,
    run as a job on a worker. The text is given (``text``, at most 512 tokens: a longer one fails the
    job with its length) or a held-out sample of a built-in set (``sample_source`` + ``sample``)."""

    profile_id: str
    layer: int = Field(ge=0, description="the layer (0-based)")
    neurons: list[int] = Field(min_length=1, max_length=ACTIVATION_MAX_NEURONS,
                               description=f"neurons of the layer (at most {ACTIVATION_MAX_NEURONS})")
    text: str | None = Field(None, min_length=1, max_length=PROBE_MAX_TEXT, description="the text, at most 512 tokens")
    sample_source: str | None = Field(None, description="builtin:NAME: a held-out sample of that set instead of text")
    sample: int = Field(0, ge=0, lt=PROBE_HELDOUT_PICK, description=f"which of the set's first {PROBE_HELDOUT_PICK} held-out samples")

    @model_validator(mode="after")
    def _one_text(self) -> ActivationProbeCreate:
        ProbeCreate._one_text(self)  # type: ignore[arg-type]  (the same text / sample rule)
        if any(n < 0 for n in self.neurons):
            raise ValueError("neurons: indices start at 0")
        if len(set(self.neurons)) != len(self.neurons):
            raise ValueError("neurons: each neuron once")
        return self


class NeuronReference(BaseModel):
    neuron: int
    top_value: float | None = Field(description="signed h at the neuron's calibration token of largest |h| (null: the profile "
                                              "keeps no top tokens)")
    gate_mean: float | None = Field(description="μ_j: the profile's mean gate activation act(x W_gate) (EW §3.1; not a mean of h)")
    rate: float | None = Field(description="ATopK activation rate over the calibration tokens (CM Eq. 4)")


class ActivationResult(BaseModel):
    """``GET /activation-probes/{id}/result``: ``activations[i][t]`` is neuron ``neurons[i]``'s h on token t."""

    kind: Literal["activation"]
    text: str
    tokens: list[str] = Field(description="each token's own text; they concatenate to the text as the model saw it")
    token_ids: list[int]
    layer: int
    neurons: list[int]
    activations: list[list[float | None]] = Field(description="per neuron, h on every token")
    reference: list[NeuronReference] = Field(description="per neuron, the profile's statistics, to scale the values")
    timings: dict[str, Any]


class ActivationProbeOut(_Noted):
    id: str
    profile_id: str
    params: dict[str, Any]
    status: ResourceStatus
    summary: dict[str, Any] | None = Field(None, description="layer, neurons, token count, each neuron's max |h| on the text")
    job_id: str | None
    job: JobOut | None = None
    created_at: datetime


class ActivationProbeList(BaseModel):
    items: list[ActivationProbeOut]
    total: int


# --------------------------------------------------------------------------- deleting


class DeletedRef(BaseModel):
    type: Literal["models", "calibration_sets", "profiles", "conversions", "evaluations", "finetunes", "probes", "activation_probes",
                  "exports"]
    id: str


class DeleteOut(BaseModel):
    """What a ``DELETE`` removed: the resource, and with ``cascade=true`` everything that depended on it."""

    deleted: list[DeletedRef] = Field(description="removed resources, dependants first")
    cancelled_jobs: list[str] = Field(description="queued or running jobs of those resources that were cancelled first")
    artifacts_removed: int = Field(description="artifact directories removed")


# --------------------------------------------------------------------------- artifacts


class ArtifactFile(BaseModel):
    path: str
    size: int
    modified: datetime
    url: str


class ArtifactOut(BaseModel):
    kind: str
    id: str
    size: int
    files: list[ArtifactFile]
    archive_url: str


class ArtifactSummary(BaseModel):
    kind: str
    id: str
    url: str


class ArtifactList(BaseModel):
    items: list[ArtifactSummary]
    total: int


# --------------------------------------------------------------------------- health


class HealthDiskOut(BaseModel):
    free_bytes: int | None = Field(description="free bytes on its file system (None: could not be read)")
    total_bytes: int | None = None
    state: Literal["ok", "low", "unknown"] = Field(
        description="low: under 1 GB or 5 % of the disk free (the smaller), jobs and uploads may fail with 507/storage")


class HealthOut(BaseModel):
    status: Literal["ok", "degraded"]
    version: str
    database: str
    broker: str
    workers: list[str] = Field(description="workers that sent a heartbeat recently")
    jobs: dict[str, int] = Field(description="queued and running job counts")
    disk: dict[str, HealthDiskOut] = Field(
        default_factory=dict, description="free space of the artifacts dir ('artifacts') and of MOELAB_DATA_DIR ('data')")
    disk_state: Literal["ok", "low", "unknown"] = Field("ok", description="the worst state in disk")
    warnings: list[str] = Field(default_factory=list, description="what an operator should look at (low disk space)")


# --------------------------------------------------------------------------- charts (chart-ready JSON)

Num = float | None


class CVHistogram(BaseModel):
    profile_id: str
    layers: list[int]
    edges: list[Num] = Field(description="bins + 1 edges shared by all layers")
    counts: list[list[int]] = Field(description="[layer][bin] neuron counts")
    overflow: list[int] = Field(description="per layer: neurons with CV above the last edge")
    not_finite: list[int]
    underflow: list[int] = Field(description="per layer: neurons below the first edge (log scale: CV ≤ 0)")
    n_neurons: list[int]
    bins: int
    scale: Literal["linear", "log"] = Field(description="edge spacing: geometric (log) or equal width (linear)")
    clipped_at: float
    note: str


class CVSummary(BaseModel):
    profile_id: str
    layers: list[int]
    quantiles: list[float]
    values: list[list[Num]] = Field(description="[layer][quantile]")
    mean: list[Num]
    median: list[Num]
    tau: float | None
    specialisation_ratio: list[float | None] | None = Field(None, description="EW Eq. 4 r_ℓ for the given tau")


class ActivationTiles(BaseModel):
    profile_id: str
    layer: int
    row_kind: Literal["groups", "samples"]
    values: list[list[Num]] = Field(description="[row][column] mean signed gate activation (normalised as asked)")
    rows: list[str]
    neuron_order: str
    normalize: str
    n_rows: int
    n_neurons: int
    neurons_per_column: int
    rows_per_row: int
    column_first_neuron: list[int] = Field(description="first neuron (in the chosen order) of each column")
    aggregated: bool = Field(description="True when tiles average several neurons or rows")
    note: str


class NeuronStats(BaseModel):
    profile_id: str
    layer: int
    rate_edges: list[Num] = Field(description="bins + 1 edges of the activation-rate histogram")
    rate_counts: list[int] = Field(description="neurons per rate bin (ATopK activation rate, CM Eq. 4 / Fig. 2)")
    rate_mean: Num
    n_neurons: int
    h_edges: list[Num] = Field(description="edges of the h-value (gate activation) histogram")
    h_counts: list[int] = Field(description="token × neuron h values per bin")
    h_below: int = Field(description="h values below the first edge")
    h_above: int = Field(description="h values above the last edge")
    note: str


class SnippetToken(BaseModel):
    token: int = Field(description="global token index (tokens.parquet row)")
    position: int = Field(description="position in its sample")
    piece: str = Field(description="the text the token decodes to")
    value: Num = Field(description="this neuron's h at the token where the profile knows it (its top-K tokens), else null")
    top: bool = Field(description="the top-activating token this snippet is centred on")


class TopToken(BaseModel):
    rank: int = Field(description="0 = largest |h|")
    token: int
    sample: int
    position: int
    value: float = Field(description="signed h (CM Eq. 1) of the neuron at this token")
    task: str | None
    domain: str | None
    group: str | None = Field(description="the sample's group in the CV (its task, domain or sample number)")
    snippet: list[SnippetToken] = Field(description="the sample's tokens from position − 12 to position + 4")


class NeuronCard(BaseModel):
    profile_id: str
    layer: int
    neuron: int
    d_ffn: int = Field(description="neurons in this layer")
    cv: Num = Field(description="EW Eq. 3 CV of the neuron's signed group means")
    cv_basis: str = Field(description="what the CV is taken across: task, domain or sample")
    mean: Num = Field(description="μ_j, mean over groups of the signed mean gate activation")
    abs_mean: Num
    std: Num
    rate: Num = Field(description="ATopK activation rate over all tokens (CM Eq. 4)")
    groups: list[str]
    group_means: list[Num] = Field(description="per group (task …): the neuron's mean gate activation ā_{j,t} (EW §3.1)")
    top_tokens: int = Field(description="K top tokens the profile keeps per neuron; 0 when it keeps none")
    top: list[TopToken] = Field(description="the neuron's top-activating tokens by |h|, largest first, with snippets")
    note: str


# ----- two profiles compared (workers/engine/profiling/compare.py) and neuron search (profiling/search.py)


class SpecificNeuron(BaseModel):
    layer: int
    neuron: int
    specificity: Num = Field(description="d = (μ_A − μ_B) / sqrt((σ_A² + σ_B²)/2 + ε²) over per-sample mean gate activations; "
                                         "> 0: specific to A")
    p: Num = Field(description="Welch's two-sided p-value for equal means over the two sets' samples")
    q: Num = Field(description="Benjamini–Hochberg q over every neuron of the comparison")
    mean_a: Num = Field(description="mean over A's samples of the neuron's per-sample mean gate activation")
    mean_b: Num
    std_a: Num = Field(description="standard deviation (ddof 1) of the per-sample means over A's samples")
    std_b: Num
    rate_a: Num = Field(description="ATopK activation rate over A's tokens (CM Eq. 4)")
    rate_b: Num
    cv_a: Num = Field(description="EW Eq. 3 CV in A (across A's CV basis)")
    cv_b: Num
    top_a: list[TopToken] = Field(description="the neuron's strongest top tokens in A's text, with snippets (empty when A keeps none)")
    top_b: list[TopToken] = Field(description="the same in B's text")


class LayerSpecificity(BaseModel):
    layer: int
    d_ffn: int
    n_specific_a: int = Field(description="neurons with d ≥ threshold and Benjamini–Hochberg q ≤ fdr")
    n_specific_b: int = Field(description="neurons with d ≤ −threshold and q ≤ fdr")
    share: float = Field(description="(n_specific_a + n_specific_b) / d_ffn")
    share_a: float
    share_b: float
    n_large_a: int = Field(description="neurons with d ≥ threshold, before the test")
    n_large_b: int = Field(description="neurons with d ≤ −threshold, before the test")


class CompareScatter(BaseModel):
    layer: int
    neurons: list[int] = Field(description="neuron index of each point")
    mean_a: list[Num]
    mean_b: list[Num]
    specificity: list[Num]
    sampled: bool = Field(description="True when the layer has more neurons than max_points: every specific neuron (largest |d| "
                                      "first) and a seeded sample of the rest")
    note: str


class ProfileComparison(BaseModel):
    a: str = Field(description="profile A's id")
    b: str = Field(description="profile B's id")
    model: str | None = Field(description="the model both are profiles of")
    n_layers: int
    d_ffn: list[int]
    n_samples_a: int
    n_samples_b: int
    threshold: float = Field(description="|d| at and above which a neuron counts as specific (with q ≤ fdr)")
    fdr: float = Field(description="the false-discovery rate: a specific neuron's Welch test survives Benjamini–Hochberg at q ≤ fdr")
    score: str = Field(description="the set-specificity score's definition")
    layer: int = Field(description="the layer of the scatter (the asked one, else the one with the largest share of specific neurons)")
    scatter: CompareScatter
    layers: list[LayerSpecificity]
    top_a: list[SpecificNeuron] = Field(description="the most A-specific neurons over all layers, largest d first")
    top_b: list[SpecificNeuron] = Field(description="the most B-specific neurons over all layers, smallest d first")
    note: str


class NeuronHit(BaseModel):
    layer: int
    neuron: int
    cv: Num
    rate: Num
    mean: Num
    abs_mean: Num
    std: Num
    specificity: Num = Field(None, description="d against the vs profile (> 0: specific to this one); null without vs")
    tokens: list[str] | None = Field(None, description="the neuron's top tokens that contain the searched text; null without token")


class NeuronSearch(BaseModel):
    profile_id: str
    vs: str | None
    total: int = Field(description="neurons passing every filter")
    offset: int
    limit: int
    sort: str
    descending: bool
    items: list[NeuronHit]
    note: str


class TaskSimilarity(BaseModel):
    profile_id: str
    layer: int | None = Field(description="None: all layers concatenated")
    labels: list[str]
    matrix: list[list[Num]]
    centered: bool
    metric: str
    note: str


class LayerSimilarity(BaseModel):
    profile_id: str
    layers: list[int]
    S_L: list[list[Num]] = Field(description="D2 Eq. 4: cosine similarity of decoder-layer outputs")
    S_M: list[list[Num]] = Field(description="D2 Eq. 5: cosine similarity of MLP inputs")
    adjacent_S_L: list[Num]
    adjacent_S_M: list[Num]
    delta: float = Field(description="D2 §2.3 δ used: a span l → l+n qualifies when its MLP-input distance 1 − S_M[l, l+n] < δ "
                                     "(the dense2moe parameter, same meaning everywhere)")
    params: dict[str, Any] = Field(description="the dense2moe parameters the fusion was planned with (defaults filled in)")
    fusion: dict[str, Any] | None = Field(None, description="what a dense2moe conversion with these parameters fuses: the engine's "
                                                            "choose_fusion (l*, n*, S_L, S_M, distance, rank, ranked candidates)")
    removed_layers: list[int] | None = Field(None, description="the blocks that fusion prunes, l*+1 … l*+n*")
    fusion_error: str | None = Field(None, description="why a conversion with these parameters would be refused (then no fusion)")


class MethodPreview(BaseModel):
    profile_id: str
    method: str
    params: dict[str, Any]
    layers: list[dict[str, Any]] | None = Field(None, description="partition methods: per-layer plan (EW Eqs. 4–6 / S·A·E): r, alpha, shared/routed experts, top_k, static, clamped, note")
    fusion: dict[str, Any] | None = Field(None, description="dense2moe: the chosen (l*, n*) and the ranked candidates (D2 §2.3)")
    summary: dict[str, Any] = Field(description="active fraction, sparsity, static and clamped layers, mean alpha; or the fusion's layer counts; "
                                    "predicted_speed: per phase (decode_b1, decode_b8, prefill) the plan's predicted speed over dense "
                                    "from this machine's measured kernel times, or a note saying why there is none")


class RoutingHeatmap(BaseModel):
    conversion_id: str
    variant: str
    sets: list[str] = Field(description="held-out set of each evaluation")
    evaluations: list[str]
    layers: list[int]
    n_experts: int
    share: list[list[list[Num]]] = Field(description="[set][layer][expert] share of the layer's routed selections")
    counts: list[list[list[Num]]]
    load_cv: list[list[Num]] = Field(description="[set][layer] MI Eq. 7 load CV")
    note: str


class LayerCurves(BaseModel):
    """One evaluation's per-layer curves (``charts.layer_curves``); None where a layer has no value
    (no routed expert, or the variant left it dense)."""

    evaluation_id: str
    conversion_id: str
    text: str = Field(description="the held-out text it was scored on")
    variant: str
    layers: list[int]
    reconstruction_error: list[Num | None] = Field(description="relative L2 error of each layer's FFN on the dense model's inputs")
    load_cv: list[Num | None] = Field(description="MI Eq. 7 load CV of each layer's routing")
    share: list[list[Num] | None] = Field(description="[layer][expert] share of the layer's routed selections")


for _model in (ExportOut, ExportList, ConversionOut, ConversionList):  # ExportOut.files are ArtifactFile, defined further down
    _model.model_rebuild()
