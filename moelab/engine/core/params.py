"""Parameters declared once: a dataclass whose fields carry their help text, paper reference and
bounds (``param``). The CLI options, the API schema, ``moelab methods`` and the designer's panels
are all generated from these declarations, so a parameter added to a method, to the profiler's
settings or to the fine-tuning appears everywhere without a second edit.

Stored dicts (``conversion.json`` → ``params``, job rows) are ``{"method": NAME, **fields}``;
``from_dict`` refuses unknown keys, because a typo must not silently fall back to a default.
"""

from __future__ import annotations

import functools
import math
import operator
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar, Literal, Mapping, TypeVar, Union

from ..runtime.moelab_routers import ROUTERS
from ..sizes import format_size

FIT_SEQ_LEN = 256  # tokens per calibration window a fit reads (``core.fitting``)

T = TypeVar("T")
_BOUNDS = (("ge", operator.ge, "≥"), ("gt", operator.gt, ">"), ("le", operator.le, "≤"), ("lt", operator.lt, "<"))


class ConversionError(ValueError):
    """The conversion cannot run as asked; the message says what to change."""


def param(default: Any, help: str, *, paper: str | None = None, ge: float | None = None, gt: float | None = None,
          le: float | None = None, lt: float | None = None, aliases: tuple[str, ...] = (), advanced: bool = False,
          internal: bool = False) -> Any:
    """A parameter: its default, one line of help, the paper equation it reads and its bounds.

    ``aliases``: extra CLI spellings kept for existing scripts (``--experts`` for ``n_experts``).
    ``advanced``: hidden behind "more" in the designer (still in the CLI and the API).
    ``internal``: checked like the others, but neither a CLI option nor an API field (an engine
    constant that is recorded with the results, e.g. the profiler's histogram bins).
    """
    meta = {"help": help, "paper": paper, "ge": ge, "gt": gt, "le": le, "lt": lt, "aliases": aliases, "advanced": advanced,
            "internal": internal}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as every interface sees it (JSON-able with ``asdict``)."""

    name: str
    type: Literal["int", "float", "str", "bool"]
    default: Any
    help: str
    paper: str | None = None
    optional: bool = False  # None is a valid value (e.g. "choose it for me")
    choices: tuple[Any, ...] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    aliases: tuple[str, ...] = ()
    advanced: bool = False
    internal: bool = False

    def to_dict(self) -> dict[str, Any]:
        """How an interface lists the parameter (``moelab methods``, ``GET /methods``); internal
        parameters are never listed, so the flag is not part of it."""
        d = asdict(self)
        del d["internal"]
        d["choices"] = list(self.choices) if self.choices is not None else None
        d["aliases"] = list(self.aliases)
        return d

    def check(self, value: Any) -> str | None:
        """What is wrong with ``value`` for this parameter, or None."""
        if value is None:
            return None if self.optional else f"{self.name} must be given"
        if self.choices is not None:
            return None if value in self.choices else f"{self.name}={value!r}: use one of {', '.join(map(str, self.choices))}"
        if self.type == "bool":
            return None if isinstance(value, bool) else f"{self.name}={value!r}: use true or false"
        if self.type == "str":
            return None if isinstance(value, str) else f"{self.name}={value!r}: use a string"
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if self.type == "int" and not (numeric and float(value).is_integer()):
            return f"{self.name}={value!r}: use an integer"
        if not numeric or not math.isfinite(value):
            return f"{self.name}={value!r}: use a finite number"
        for attr, op, word in _BOUNDS:
            bound = getattr(self, attr)
            if bound is not None and not op(value, bound):
                return f"{self.name}={value!r}: must be {word} {bound:g}"
        return None


def _spec_type(hint: Any) -> tuple[str, bool, tuple[Any, ...] | None]:
    """(type name, optional, choices) of a field annotation."""
    optional = False
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint, origin = args[0], typing.get_origin(args[0])
    if origin is Literal:
        choices = typing.get_args(hint)
        return type(choices[0]).__name__, optional, choices
    name = getattr(hint, "__name__", str(hint))
    if name not in ("int", "float", "str", "bool"):
        raise TypeError(f"parameter type {hint!r} is not one of int, float, str, bool, Literal[...]")
    return name, optional, None


class DeclaredParams:
    """Base of every parameter dataclass declared with ``param``: the specs every interface is
    generated from, and the check of each field against its own declaration (type, choices,
    bounds). Subclasses name the ``error`` they raise and may add ``_check`` for rules that relate
    several fields. Not a dataclass itself: a subclass may be frozen (``MethodParams``) or not."""

    error: ClassVar[type[Exception]] = ValueError

    @classmethod
    @functools.cache  # read on every check() and preview (each slider move): parse the annotations once
    def specs(cls) -> tuple[ParamSpec, ...]:
        hints = typing.get_type_hints(cls)
        out = []
        for f in fields(cls):
            kind, optional, choices = _spec_type(hints[f.name])
            meta = dict(f.metadata)
            if "help" not in meta:
                raise TypeError(f"{cls.__name__}.{f.name} is not declared with param(...): it needs help text")
            default = f.default if f.default is not MISSING else None
            out.append(ParamSpec(name=f.name, type=kind, default=default, optional=optional, choices=choices, **meta))
        return tuple(out)

    @classmethod
    def exposed_specs(cls) -> tuple[ParamSpec, ...]:
        """The parameters the CLI and the API offer (every one not declared ``internal``)."""
        return tuple(s for s in cls.specs() if not s.internal)

    def check(self) -> None:
        """Raise ``error`` naming the parameter to fix: each field against its declaration, then ``_check``."""
        for spec in self.specs():
            problem = spec.check(getattr(self, spec.name))
            if problem:
                raise self.error(self._problem(problem))
        self._check()

    def _problem(self, problem: str) -> str:
        """The message of a field's problem (a subclass may say whose parameter it is)."""
        return problem

    def _check(self) -> None:
        """Rules that relate several fields; overridden by the classes that have them."""


@dataclass(frozen=True)
class MethodParams(DeclaredParams):
    """Base of every method's parameters. Subclasses set ``method`` and may add ``_check`` for rules
    that relate several fields (bounds of single fields come from their ``param`` declaration)."""

    method: ClassVar[str] = ""
    error: ClassVar[type[Exception]] = ConversionError

    def _problem(self, problem: str) -> str:
        return f"{self.method}: {problem}"

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, **asdict(self)}

    @classmethod
    def from_dict(cls: type[T], d: Mapping[str, Any]) -> T:
        d = dict(d)
        method = d.pop("method", cls.method)  # type: ignore[attr-defined]
        if method != cls.method:  # type: ignore[attr-defined]
            raise ConversionError(f"these are {method!r} parameters, not {cls.method}")  # type: ignore[attr-defined]
        return from_known_fields(cls, d, cls.method, ConversionError)  # type: ignore[attr-defined]


def from_known_fields(cls: type[T], d: Mapping[str, Any], what: str, error: type[Exception]) -> T:
    """``cls(**d)``, or ``error`` naming the keys ``cls`` does not have (a typo must not pass silently)."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise error(f"unknown {what} parameters: {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**d)


def needs_fitting(params: Any) -> bool:
    """A fitted router (``Router.fitted``: ridge), the budget and leading plans and the skipped-expert compensation
    are fitted on calibration tokens (``core.fitting``)."""
    router = getattr(params, "router", None)
    return ((router in ROUTERS and ROUTERS[router].fitted) or getattr(params, "plan", "paper") in ("budget", "leading")
            or getattr(params, "compensation", "none") != "none")


def fit_bytes(params: Any, d_model: int, d_ffn: int, n_layers: int) -> int:
    """What a streamed fit (``streaming.conversion``) holds beside a layer's weights, at most: float32, per
    ``fit_tokens`` calibration token, its hidden state carried between layers and one layer's MLP input (``d_model``
    each), hidden activations and the routed experts' copy of them (``d_ffn`` each) and the fit's temporaries (one
    ``d_model`` and two ``d_ffn`` more); with the compensation, every layer's per-rank sums until the second pass
    (``core.fitting.rank_sums``: float32, the counts float64). 0 without a fit. Measured on the default model
    (``--recipe best``, 16,384 tokens, the freed heap given back after each layer): up to 513 MiB over what the
    process held before the fit, this bound 518 MiB."""
    if not needs_fitting(params):
        return 0
    tokens = max(FIT_SEQ_LEN, getattr(params, "fit_tokens", 0) // FIT_SEQ_LEN * FIT_SEQ_LEN)  # whole windows
    held = tokens * 4 * (3 * d_model + 4 * d_ffn)
    if getattr(params, "compensation", "none") != "none":
        n = getattr(params, "n_experts", 1)
        held += n_layers * n * n * (4 * -(-d_ffn // n) + 8)
    return held


def fit_budget_error(params: Any, max_memory: int, floor_bytes: int, fit: int) -> str | None:
    """Why ``max_memory`` cannot hold a streamed conversion's largest step (``floor_bytes``) and its fit (``fit``,
    ``fit_bytes``) beside it, and what to give instead; None where it can (or there is no fit)."""
    if not fit or max_memory >= floor_bytes + fit:
        return None
    return (f"memory budget (--max-memory / max_memory) {format_size(max_memory)} is too small for a fitted conversion "
            f"streamed layer by layer: the fit on {params.fit_tokens} calibration tokens holds up to "
            f"{format_size(fit)} beside the largest step's {format_size(floor_bytes)}; give at least "
            f"{format_size(floor_bytes + fit)} ({floor_bytes + fit} bytes) or fewer fit_tokens (--fit-tokens)")


def check_compensation(params: Any) -> None:
    """The skipped-expert compensation adds unweighted expert means (``core.fitting``): only under the
    ``sum`` combine are they what a skipped expert would have added."""
    if params.compensation != "none" and params.combine != "sum":
        raise ConversionError(f"compensation {params.compensation!r} adds unweighted expert means: it needs combine 'sum', "
                              f"not {params.combine!r}")


def check_streamable(method: Any, params: Any) -> None:
    """Raise what blocks a layer-streamed conversion (``streaming.conversion``), and what to do instead."""
    if method.partition is None:
        raise ConversionError(
            f"{method.name} cannot convert under --max-memory: only the partition methods (expertweaver, cmoe) build one "
            "layer at a time; run it on a machine that holds the whole model, or without --max-memory")
    if getattr(params, "plan_error", "residual") == "fisher":
        raise ConversionError(
            "plan_error 'fisher' reads the loss gradient of the whole model at once, which --max-memory does not hold: "
            "use plan_error 'residual' (--recipe best), or convert without --max-memory")
    if getattr(params, "refit", "none") != "none":
        raise ConversionError(
            f"refit {params.refit!r} runs the whole converted model over the calibration text, which --max-memory does "
            "not hold: use refit 'none' (--recipe best), or convert without --max-memory")
