"""Human names for the API's records and readable values (pure functions, no I/O).

Ids (``pr-e06989ec8ade3ce0``) say nothing to a person: every dropdown and table shows a name
built from what the record is — model · calibration set · method · key parameters — with the
id second, and numbers are formatted instead of printed as Python reprs
(``mean_alpha: 0.5182291666666666``, ``jobs {'queued': 0}``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def fmt(value: Any, digits: int = 4) -> str:
    """A value as a person reads it: floats to ``digits`` significant digits, dicts as
    'k v, k v', lists comma-separated (long ones cut), None as ''."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    if isinstance(value, Mapping):
        return ", ".join(f"{k} {fmt(v, digits)}" for k, v in value.items()) or "none"
    if isinstance(value, (list, tuple)):
        shown = ", ".join(fmt(v, digits) for v in value[:12])
        return shown + (f", … ({len(value)} in all)" if len(value) > 12 else "")
    return str(value)


def ratio_ci(ratio: Any, ci: Any) -> str:
    """'1.53× (1.41–1.66)': a perplexity ratio with its 95% bootstrap interval over windows (the evaluation's
    ``perplexity_ratio_ci``); the ratio alone when no interval was measured."""
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool):
        return ""
    text = f"{ratio:.3g}×"
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(isinstance(v, (int, float)) for v in ci):
        text += f" ({ci[0]:.3g}–{ci[1]:.3g})"
    return text


def fmt_pct(value: Any) -> str:
    """0.25 → '25%'; anything not a number → ''."""
    return f"{value:.1%}".replace(".0%", "%") if isinstance(value, (int, float)) and not isinstance(value, bool) else ""


def key_params(c: Mapping[str, Any]) -> str:
    """The few parameters that tell conversions of one method apart: the API's ``label``, which the
    method declares (the rest is in the table); a record without one shows its first parameters."""
    if c.get("label"):
        return str(c["label"])
    params = {k: v for k, v in (c.get("params") or {}).items() if k != "method" and not isinstance(v, (dict, list))}
    return ", ".join(f"{k} {fmt(v)}" for k, v in list(params.items())[:3])


@dataclass
class Names:
    """Names of the records one page shows, from the API's lists (models, sets, profiles)."""

    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    sets: dict[str, dict[str, Any]] = field(default_factory=dict)
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_lists(cls, models: Sequence[dict[str, Any]] = (), sets: Sequence[dict[str, Any]] = (),
                   profiles: Sequence[dict[str, Any]] = ()) -> Names:
        return cls({m["id"]: m for m in models}, {s["id"]: s for s in sets}, {p["id"]: p for p in profiles})

    def model(self, model_id: str | None) -> str:
        m = self.models.get(model_id or "")
        return (m.get("name") or m["id"]) if m else (model_id or "?")

    def set(self, set_id: str | None) -> str:
        s = self.sets.get(set_id or "")
        return (s.get("name") or s["id"]) if s else (set_id or "?")

    def profile(self, p: dict[str, Any] | str | None) -> str:
        """'SmolLM2-135M · mixed · 256 tokens/sample'."""
        if isinstance(p, str) or p is None:
            p = self.profiles.get(p or "") or {"id": p or "?"}
        if "model_id" not in p:
            return p["id"]
        tokens = (p.get("params") or {}).get("max_tokens")
        parts = [self.model(p["model_id"]), self.set(p["calibration_set_id"])] + ([f"{tokens} tokens/sample"] if tokens else [])
        return " · ".join(parts)

    def conversion(self, c: dict[str, Any]) -> str:
        """'SmolLM2-135M · mixed · expertweaver · 64 experts, α 0.2–0.7, τ 0.6, sparsity 25%'."""
        params = c.get("params") or {}
        method = c.get("method") or params.get("method") or "expertweaver"
        prof = self.profiles.get(c.get("profile_id") or "")
        if prof:
            base = [self.model(prof["model_id"]), self.set(prof["calibration_set_id"])]
        else:
            base = [self.model(c.get("model_id"))] if c.get("model_id") else []
        return " · ".join([*base, method, key_params(c)])


def short_conversion(c: dict[str, Any]) -> str:
    """'expertweaver · 64 experts, α 0.2–0.7, …': the name without model and set (chart labels)."""
    method = c.get("method") or (c.get("params") or {}).get("method") or "expertweaver"
    return f"{method} · {key_params(c)}"


def with_id(name: str, record_id: str) -> str:
    """The name first, the id second (still searchable in a dropdown)."""
    return f"{name} — {record_id}" if name and name != record_id else record_id


def heldout_text(e: dict[str, Any]) -> str:
    """What an evaluation read: its set's name (``params.label``) or ``builtin:NAME``."""
    p = e.get("params") or {}
    held = (e.get("summary") or {}).get("heldout") or {}
    return p.get("label") or held.get("source") or p.get("source") or "?"


def evaluation_name(e: dict[str, Any], conversion: str | None) -> str:
    """'evaluation of SmolLM2 · mixed · expertweaver · … on builtin:mixed'."""
    return f"evaluation of {conversion or e.get('conversion_id') or '?'} on {heldout_text(e)}"


def _excerpt(text: str, limit: int = 32) -> str:
    one = " ".join(text.split())
    return one if len(one) <= limit else one[:limit - 1].rstrip() + "…"


def probe_name(p: dict[str, Any], conversion: str | None) -> str:
    """'routing probe of <conversion> on builtin:code sample 3' or '… on "def mean(values): …"'."""
    params = p.get("params") or {}
    kind = "generation" if params.get("kind") == "generate" else "routing"
    on = (f"{params['sample_source']} sample {params.get('sample', 0)}" if params.get("sample_source")
          else f"“{_excerpt(params['text'])}”" if params.get("text") else "")
    return f"{kind} probe of {conversion or p.get('conversion_id') or '?'}" + (f" on {on}" if on else "")


def finetune_name(f: dict[str, Any], conversion: str | None) -> str:
    """'fine-tune of <conversion> (cmoe, 60 steps)'."""
    params = f.get("params") or {}
    bits = [b for b in (params.get("mode"), f"{params['steps']} steps" if params.get("steps") else None) if b]
    return f"fine-tune of {conversion or f.get('conversion_id') or '?'}" + (f" ({', '.join(bits)})" if bits else "")


#: what a job of each kind works on, for jobs whose resource is gone (job rows stay as history)
JOB_RESOURCE = {"inspect_model": "model", "build_calibration": "calibration set", "profile": "profile", "conversion": "conversion",
                "evaluation": "evaluation", "finetune": "fine-tune", "probe": "probe", "export": "GGUF export"}


def job_subject(job: dict[str, Any], subjects: Mapping[str, str]) -> str:
    """What a job is about, in words: ``subjects`` maps resource ids to phrases ('model SmolLM2-135M',
    'evaluation of … on builtin:mixed'); a resource no longer stored is named by its kind, '(deleted)'."""
    rid = job.get("resource_id") or ""
    if rid in subjects:
        return subjects[rid]
    return f"{JOB_RESOURCE.get(job.get('kind', ''), job.get('kind', 'job'))} (deleted)"


def builtin_spec(set_record: Mapping[str, Any] | None) -> str | None:
    """``builtin:NAME`` of a calibration set built from a built-in source; None for an upload or a Hub set."""
    if not set_record or set_record.get("origin") != "builtin":
        return None
    name = (set_record.get("params") or {}).get("name")
    return f"builtin:{name}" if name else None


def domains_of(spec: str | None, builtin_domains: Mapping[str, Sequence[str]]) -> set[str] | None:
    """The built-in sources a ``builtin:NAME`` (or ``builtin:a+b``) spec draws from (``GET
    /calibration-sets/builtins``' ``domains``); None for anything else (its domains are unknown)."""
    if not spec or not spec.startswith("builtin:"):
        return None
    return {d for part in spec.removeprefix("builtin:").split("+") for d in builtin_domains.get(part, [part])}


def domain_relation(calibration: str | None, text: str | None, builtin_domains: Mapping[str, Sequence[str]]) -> str | None:
    """Whether a held-out ``text`` is of the domains a conversion was calibrated on (both ``builtin:`` specs):
    'in domain' (all of its sources were calibrated on), 'out of domain' (none), 'partly in domain', or
    None when either is not a built-in set (unknown)."""
    cal, held = domains_of(calibration, builtin_domains), domains_of(text, builtin_domains)
    if not cal or not held:
        return None
    if held <= cal:
        return "in domain"
    return "out of domain" if not held & cal else "partly in domain"


#: sizes a user sets with any recipe (portable's 12 experts and best's 16,384 fit tokens are defaults, not what makes them)
SIZE_KEYS = ("n_experts", "sparsity", "fit_tokens")


def recipe_of(method: dict[str, Any] | None, params: dict[str, Any]) -> str | None:
    """The designer recipe a conversion's parameters follow: a recipe whose every override the
    parameters have ('best'), else 'paper' when none of the recipes' parameters differs from its
    default, else None (its own mix). None also for a method without recipes beyond 'paper'."""
    recipes = {name: {k: v for k, v in over.items() if k not in SIZE_KEYS}
               for name, over in ((method or {}).get("recipes") or {}).items()}
    if len(recipes) < 2:
        return None
    for name, over in sorted(recipes.items(), key=lambda kv: -len(kv[1])):
        if over and all(params.get(k) == v for k, v in over.items()):
            return name
    defaults = {p["name"]: p["default"] for p in method["params"]}
    keys = {k for over in recipes.values() for k in over}
    return "paper" if all(params.get(k, defaults.get(k)) == defaults.get(k) for k in keys) else None


def calibration_of(c: dict[str, Any], names: Names) -> str:
    """The name of the calibration set a conversion was built from (its profile's; a conversion of
    an MoE model names its ``calibration`` parameter)."""
    prof = names.profiles.get(c.get("profile_id") or "")
    if prof:
        return names.set(prof.get("calibration_set_id"))
    cal = (c.get("params") or {}).get("calibration")
    return names.set(cal) if cal else "?"


def calibration_spec(c: dict[str, Any], names: Names) -> str | None:
    """``builtin:NAME`` of the built-in set a conversion was calibrated on (None: an upload or Hub set)."""
    prof = names.profiles.get(c.get("profile_id") or "")
    if prof:
        return builtin_spec(names.sets.get(prof.get("calibration_set_id") or ""))
    cal = (c.get("params") or {}).get("calibration")
    return cal if cal and cal.startswith("builtin:") else builtin_spec(names.sets.get(cal or ""))


def heldout_spec(e: dict[str, Any], names: Names) -> str | None:
    """``builtin:NAME`` of an evaluation's held-out text (a stored set: the built-in it was made from)."""
    source = (e.get("params") or {}).get("source") or ""
    return source if source.startswith("builtin:") else builtin_spec(names.sets.get(source))


def chart_label(c: dict[str, Any], names: Names, methods: dict[str, dict[str, Any]]) -> tuple[str, str | None]:
    """A conversion's short name on charts, 'code · expertweaver best': calibration set, method and
    recipe (or, for a method without recipes, its first key parameter), and the recipe itself."""
    params = c.get("params") or {}
    method = c.get("method") or params.get("method") or "expertweaver"
    recipe = recipe_of(methods.get(method), params)
    what = recipe if recipe else key_params(c).split(", ")[0]
    if recipe is None and method in methods and len(methods[method].get("recipes") or {}) > 1:
        what = "own recipe"
    return f"{calibration_of(c, names)} · {method} {what}", recipe
