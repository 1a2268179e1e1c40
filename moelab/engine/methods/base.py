"""What a conversion method declares: its parameters, what it reads, its preview, its build step,
its recovery fine-tuning and its evaluation hooks. ``methods/__init__.py`` registers one ``Method``
per module; ``runs.py``, the fine-tuner, the CLI, the API and the designer read only this.

Method modules import torch (and the runtime) inside their build and fine-tuning hooks only: the
API imports every method for its parameters and previews, and must not load torch for that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

from ..core.params import MethodParams

if TYPE_CHECKING:
    from ..models import ModelAdapter
    from ..profiling.store import StoredProfile
    from ..progress import Progress

#: What a conversion reads: one profile of the dense model, one profile per calibration set
#: (same model), or an existing MoE model and a calibration set (it profiles the experts itself).
Needs = Literal["profile", "profiles", "moe_model"]


@dataclass
class ConversionInputs:
    """Everything a build step may read; ``run_conversion`` fills it in."""

    profiles: list["StoredProfile"]
    data_dir: Path
    device: str = "auto"
    model: str | None = None  # needs == "moe_model": the MoE model's source
    calib: str | None = None  # needs == "moe_model": calibration spec
    load_dense: Callable[[], "ModelAdapter"] | None = None  # the profiled dense model, float32
    # how per-layer work runs (``core.slicing.LayerMap``): in this process, one layer after the
    # other (None), or shared with other workers (``workers.fanout``); the result is the same
    map_layers: Callable[..., list[Any]] | None = None

    @property
    def profile(self) -> "StoredProfile":
        return self.profiles[0]


@dataclass(frozen=True)
class Recovery:
    """How recovery fine-tuning trains a conversion of this method (``training.finetune``).

    ``layer_kind``: the runtime layers it trains; ``lora``: LoRA adapters on the experts and the
    rest of the block, ``required``, ``optional`` (rank 0 trains the routers only) or ``off``; ``load_balance``: the λ of EW Eq. 12 applies; ``router_params``: the router
    parameters that train (None: every one); ``balance_bias``: the CM §3.3 bias b of ``scaled``
    layers follows the expert loads after each step (False: b stays 0); ``prepare(moe, modules,
    batch)`` makes the layers trainable in place and returns ``(modules, notes, structure_changed)``.
    ``accepts(spec)``: why one layer of ``layer_kind`` (its JSON spec) cannot start this training,
    or None (e.g. a combine the mode does not extend).
    """

    paper: str
    #: what the fine-tune trains and its loss, in one line with the paper's equations (the Fine-tune page shows it)
    summary: str = ""
    layer_kind: str = "moe"
    lora: Literal["required", "optional", "off"] = "required"
    load_balance: bool = True
    router_params: tuple[str, ...] | None = None
    balance_bias: bool = True
    prepare: Callable[..., tuple[dict[int, Any], dict[str, Any], bool]] | None = None
    accepts: Callable[[dict[str, Any]], str | None] | None = None

    def refusal(self, mode: str, specs: Sequence[dict[str, Any] | None]) -> str | None:
        """Why mode ``mode`` cannot fine-tune a conversion whose decoder layers have ``specs``
        (``config.json``'s ``moe_layers``; None: a dense layer), or None. JSON only, no torch:
        the API refuses a combination up front instead of failing the job later."""
        layers = [(i, s) for i, s in enumerate(specs) if s]
        kinds = sorted({str(s.get("kind", "")) for _, s in layers}) or ["none"]
        mine = [(i, s) for i, s in layers if s.get("kind") == self.layer_kind]
        if not mine:
            return (f"mode {mode!r} trains layers of kind {self.layer_kind!r}, but this conversion has layer kinds {kinds}: "
                    "use the mode of the conversion's method")
        if self.accepts is not None:
            bad = [(i, why) for i, s in mine if (why := self.accepts(s))]
            if bad:
                return f"mode {mode!r} cannot train layers {[i for i, _ in bad]}: {bad[0][1]}"
        return None


@dataclass(frozen=True)
class Method:
    """One conversion method.

    ``build(inputs, params, progress) -> (moe_model, tokenizer, record)``: the conversion; the record
    becomes ``conversion.json`` (``params``, ``summary``, ``layers``, ``timings``).
    ``validate(params, profiles)``: checks that need the inputs, made before a model is loaded.
    ``preview(profile, params)``: a numpy-only plan for the designer (None: the method has none).
    ``baselines(adapter, record, progress, data_dir)``: extra variants (layer index -> module) scored against
    the dense model in the same evaluation; only for methods whose layers swap into the dense model.
    ``reference(record, inputs)``: the ``(model, tokenizer)`` a conversion is compared with; None:
    the profiled dense model. ``extra_evaluation(converted, tokenizer, record, **kw)``: more
    numbers for the evaluation record.
    ``recipes``: named parameter overrides beyond the defaults (the defaults are the paper's
    settings, recipe ``paper``); ``best`` is the best training-free conversion measured
    (tests/benchmarks/bench_frontier.py).
    """

    name: str
    title: str
    paper: str
    summary: str
    params: type[MethodParams]
    needs: Needs
    build: Callable[[ConversionInputs, Any, "Progress"], tuple[Any, Any, dict[str, Any]]]
    validate: Callable[[Any, list["StoredProfile"]], None] | None = None
    preview: Callable[[Any, Any], dict[str, Any]] | None = None
    recovery: Recovery | None = None
    baselines: Callable[..., dict[str, Any]] | None = None
    reference: Callable[..., tuple[Any, Any]] | None = None
    extra_evaluation: Callable[..., dict[str, Any]] | None = None
    recipes: dict[str, dict[str, Any]] = field(default_factory=dict)
    # partition methods: ``(plan_for(profile, params), layer_builder(profile, params))``, so another
    # process can build any one layer's experts alone (``workers.fanout``)
    partition: tuple[Callable[..., Any], Callable[..., Any]] | None = None
    # ``label(params) -> ['64 experts', 'τ 0.6']``: the parameters that tell this method's conversions
    # apart, in words (``methods.conversion_label`` adds the shared options); None: the first three declared
    label: Callable[[Any], list[str]] | None = None

    def recipe(self, name: str, **given: Any) -> MethodParams:
        """The parameters of recipe ``name`` (``paper``: the defaults), with ``given`` on top."""
        from ..core.params import ConversionError

        known = {"paper": {}, **self.recipes}
        if name not in known:
            raise ConversionError(f"{self.name} has no recipe {name!r}; one of: {', '.join(known)}")
        return self.params(**{**known[name], **given})

    def describe(self) -> dict[str, Any]:
        """JSON-able: what ``moelab methods --json`` and ``GET /api/v1/methods`` list."""
        return {
            "name": self.name, "title": self.title, "paper": self.paper, "summary": self.summary,
            "needs": self.needs, "preview": self.preview is not None,
            "recovery": None if self.recovery is None else self.recovery.paper,
            "recovery_summary": None if self.recovery is None else self.recovery.summary,
            "params": [s.to_dict() for s in self.params.specs()],
            "recipes": {"paper": {}, **self.recipes},
        }
