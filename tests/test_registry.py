"""One place per method: every registered parameter reaches the CLI and the API with the same
default; ``workers`` and ``backend`` never import each other; a sixth method is one module."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import click

from backend.schemas import MAX_INT
from click.testing import CliRunner
import pytest

from tests.conftest import REPO
from moelab.engine.core.params import ConversionError, MethodParams, param
from moelab.engine.methods import REGISTRY, Method, describe_methods, params_from_dict, register


def _convert_options() -> dict[str, click.Option]:
    from moelab.cli import convert

    return {p.name: p for p in convert.params if isinstance(p, click.Option)}


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_parameter_reaches_the_cli_and_the_api_with_its_default(name):
    from backend.schemas import ConversionCreate, METHOD_PARAMS

    method = REGISTRY[name]
    options = _convert_options()
    api_fields = METHOD_PARAMS[name].model_fields
    assert name in ConversionCreate.model_fields  # the request's block for this method
    for spec in method.params.specs():
        opt = options[spec.name]
        assert f"--{spec.name.replace('_', '-')}" in opt.opts, spec.name
        assert f"{name} {spec.default}" in opt.help  # the method's own default, stated
        if spec.choices:
            assert set(spec.choices) <= set(opt.type.choices)
        assert api_fields[spec.name].default == spec.default, spec.name
        assert spec.help and spec.help in (api_fields[spec.name].description or "")
    # the API's defaults are the engine's: an empty block gives the dataclass defaults
    assert params_from_dict({"method": name, **METHOD_PARAMS[name]().model_dump()}) == method.params()


# ---------------------------------------------------------------------------- profile and fine-tuning settings

#: Spec bound -> JSON-schema keyword, and whether click's range leaves that end open.
_JSON_BOUNDS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}
#: Request-level defaults that differ from the engine's on purpose: a fine-tune's mode defaults to
#: the conversion's method (the engine's default is one mode).
_REQUEST_DEFAULTS = {"mode": None}


def _declared(kind: str) -> tuple[Any, Any, click.Command]:
    """(declared class, API request model, CLI command) of ``profile`` or ``finetune``."""
    from backend.schemas import FinetuneCreate, ProfileCreate
    from moelab import cli
    from moelab.engine.profiling.settings import ProfileSettings
    from moelab.engine.training.params import FinetuneParams

    return {"profile": (ProfileSettings, ProfileCreate, cli.profile), "finetune": (FinetuneParams, FinetuneCreate, cli.finetune)}[kind]


def _api_mismatches(spec: Any, prop: dict[str, Any]) -> list[str]:
    """How the JSON schema of one request field differs from the declaration (empty: it agrees)."""
    variants = [v for v in prop.get("anyOf", [prop]) if v.get("type") != "null"]
    problems = []
    if prop.get("default") != _REQUEST_DEFAULTS.get(spec.name, spec.default):
        problems.append(f"default {prop.get('default')!r}")
    for attr, key in _JSON_BOUNDS.items():
        want = getattr(spec, attr)
        if attr == "le" and spec.type == "int" and spec.le is None and spec.lt is None:
            want = MAX_INT  # the API holds an unbounded integer to JSON's exact range (a seed of 2**64 fails in torch)
        if [v.get(key) for v in variants] != [want] * len(variants):
            problems.append(f"{key} {[v.get(key) for v in variants]} (declared {attr}={getattr(spec, attr)})")
    if spec.choices and [set(v.get("enum", ())) for v in variants] != [set(spec.choices)]:
        problems.append(f"choices {variants}")
    if spec.optional != ("anyOf" in prop) and spec.name not in _REQUEST_DEFAULTS:
        problems.append("optional" if "anyOf" in prop else "required")
    return problems


def _cli_mismatches(spec: Any, opt: click.Option) -> list[str]:
    """How one CLI option differs from the declaration (empty: it agrees)."""
    dashed = spec.name.replace("_", "-")
    problems = []
    if f"--{dashed}" not in opt.opts:
        problems.append(f"spelled {opt.opts}")
    if opt.default != _REQUEST_DEFAULTS.get(spec.name, spec.default):
        problems.append(f"default {opt.default!r}")
    if spec.type == "bool":
        if not opt.is_flag or f"--no-{dashed}" not in opt.secondary_opts:
            problems.append(f"not a --{dashed}/--no-{dashed} flag")
    elif spec.choices:
        if set(getattr(opt.type, "choices", ())) != set(spec.choices):
            problems.append(f"choices {getattr(opt.type, 'choices', None)}")
    else:
        low = spec.ge if spec.ge is not None else spec.gt
        high = spec.le if spec.le is not None else spec.lt
        declared = (low, high, spec.gt is not None, spec.lt is not None)
        given = tuple(getattr(opt.type, a, None) for a in ("min", "max")) + tuple(
            bool(getattr(opt.type, a, False)) for a in ("min_open", "max_open"))
        if given != declared:
            problems.append(f"range {opt.type} (declared {spec.ge=}, {spec.gt=}, {spec.le=}, {spec.lt=})")
    return problems


@pytest.mark.parametrize("kind", ["profile", "finetune"])
def test_every_declared_setting_reaches_the_cli_and_the_api_with_its_default_and_bounds(kind):
    """``ProfileSettings`` and ``FinetuneParams`` are declared once: each exposed field is a field
    of the request body and an option of the command, with the declaration's default and bounds
    (click's ranges included); internal fields are in neither."""
    declared, request, command = _declared(kind)
    props = request.model_json_schema()["properties"]
    options = {p.name: p for p in command.params if isinstance(p, click.Option)}
    exposed = declared.exposed_specs()
    assert exposed and {s.name for s in declared.specs()} - {s.name for s in exposed} == (
        {"hist_bins", "cv_eps"} if kind == "profile" else set())
    for spec in declared.specs():
        if spec.internal:
            assert spec.name not in props and spec.name not in options, spec.name
            continue
        assert not _api_mismatches(spec, props[spec.name]), (spec.name, _api_mismatches(spec, props[spec.name]))
        assert not _cli_mismatches(spec, options[spec.name]), (spec.name, _cli_mismatches(spec, options[spec.name]))


def test_the_api_and_cli_defaults_are_the_engines():
    from backend.schemas import FinetuneCreate, ProfileCreate
    from moelab.engine.profiling.settings import ProfileSettings
    from moelab.engine.training.params import FinetuneParams

    body = ProfileCreate(model_id="m", calibration_set_id="c").model_dump(exclude={"model_id", "calibration_set_id", "samples", "max_memory"})
    assert ProfileSettings(**body) == ProfileSettings()
    body = FinetuneCreate(conversion_id="c", mode="cmoe").model_dump(exclude={"conversion_id"})
    assert FinetuneParams(**body) == FinetuneParams()


def test_the_setting_checkers_see_a_drift():
    """The comparison above can fail: an option or a field with other bounds or another default is reported."""
    from moelab.engine.training.params import FinetuneParams

    rank = next(s for s in FinetuneParams.specs() if s.name == "lora_rank")
    assert _cli_mismatches(rank, click.Option(["--lora-rank"], type=click.IntRange(min=0, max=4096), default=8)) == []
    assert _cli_mismatches(rank, click.Option(["--lora-rank"], type=click.IntRange(min=1), default=8))
    assert _cli_mismatches(rank, click.Option(["--lora-rank"], type=int, default=8))
    assert _cli_mismatches(rank, click.Option(["--lora-rank"], type=click.IntRange(min=0, max=4096), default=4))
    assert _api_mismatches(rank, {"default": 8, "minimum": 0, "maximum": 4096}) == []
    assert _api_mismatches(rank, {"default": 8, "minimum": 1, "maximum": 4096})
    assert _api_mismatches(rank, {"default": 8, "minimum": 0})


def test_methods_are_listed_by_the_cli_and_the_api(tmp_path):
    from fastapi.testclient import TestClient

    from backend.app import create_app
    from moelab.settings import Settings
    from moelab.cli import main

    out = CliRunner().invoke(main, ["methods", "--json"])
    assert out.exit_code == 0, out.output
    listed = json.loads(out.stdout)
    assert [m["name"] for m in listed] == list(REGISTRY)
    ew = next(m for m in listed if m["name"] == "expertweaver")
    tau = next(p for p in ew["params"] if p["name"] == "tau")
    assert tau == {**tau, "type": "float", "default": 0.6, "paper": "EW Eq. 4", "gt": 0}
    cmoe_names = {p["name"] for p in next(m for m in listed if m["name"] == "cmoe")["params"]}
    assert not cmoe_names & {"alpha_min", "alpha_max", "tau", "sparsity"}  # nothing CMoE ignores
    settings = Settings(data_dir=tmp_path, redis_url="redis://127.0.0.1:1/0")
    with TestClient(create_app(settings)) as client:
        items = client.get("/api/v1/methods").json()["items"]
    assert items == json.loads(json.dumps(describe_methods()))


def test_a_parameter_the_method_does_not_read_is_refused_by_the_cli(tmp_path):
    from moelab.cli import main

    out = CliRunner().invoke(main, ["convert", "--method", "cmoe", "--tau", "0.5", "--profile", "x", "--out", str(tmp_path / "c")])
    assert out.exit_code == 2 and "--tau: not a parameter of cmoe" in out.output


def _imports(package: str) -> set[tuple[str, str]]:
    """(file, imported module) for every import in ``package``'s files, relative ones resolved."""
    found = set()
    for path in (REPO / package).rglob("*.py"):
        rel = path.relative_to(REPO).with_suffix("")
        here = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {(str(rel), a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                found.add((str(rel), ".".join([*base, *(node.module or "").split(".")]).strip(".")))
    return found


def test_workers_and_backend_never_import_each_other():
    """The job/database code both need lives in ``moelab.store``; the engine (``moelab.engine``) is the library
    every side imports, and it imports none of them: not the API, the workers, the UI, the store or the CLI."""
    workers_bad = sorted((f, m) for f, m in _imports("workers") if m == "backend" or m.startswith("backend."))
    assert not workers_bad, workers_bad
    backend_bad = sorted((f, m) for f, m in _imports("backend") if m == "workers" or m.startswith("workers."))
    assert not backend_bad, backend_bad
    engine_bad = sorted((f, m) for f, m in _imports("moelab/engine")
                        if m.split(".")[0] in ("backend", "workers", "celery", "fastapi", "dash", "frontend", "httpx")
                        or (m.split(".")[0] == "moelab" and not m.startswith("moelab.engine")))
    assert not engine_bad, engine_bad
    store_bad = sorted((f, m) for f, m in _imports("moelab/store")
                       if m.split(".")[0] in ("backend", "frontend", "workers"))
    assert not store_bad, store_bad


def test_the_import_checker_sees_a_violation(tmp_path, monkeypatch):
    """The boundary test above can fail: a file importing backend from workers is reported."""
    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "bad.py").write_text("from backend.db import Job\nfrom ..backend import x\n")
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    assert ("workers/bad", "backend.db") in _imports("workers")


# ---------------------------------------------------------------------------- a sixth method


@dataclass(frozen=True)
class PruneParams(MethodParams):
    """A deliberately trivial method: keep the first ``keep`` share of every FFN's neurons."""

    method: ClassVar[str] = "prune_head"
    keep: float = param(0.5, "share of neurons kept", gt=0, le=1)


def _prune_preview(profile: Any, params: PruneParams) -> dict[str, Any]:
    d = profile.manifest["d_ffn"]
    return {"params": params.to_dict(), "summary": {"kept": [int(params.keep * x) for x in d]}}


def test_a_new_method_is_one_module_and_one_registration(monkeypatch):
    """Walk-through of adding a method: declare parameters + a Method, register it; the CLI, the
    API schema and ``moelab methods`` pick it up with no other edit."""
    import importlib

    import backend.schemas
    import backend.schemas.conversions
    import moelab.cli
    from moelab.engine.methods import conversion_label

    monkeypatch.setattr("moelab.engine.methods.REGISTRY", dict(REGISTRY))
    import moelab.engine.methods as registry

    register(Method(name="prune_head", title="Prune", paper="-", summary="keep the first neurons", params=PruneParams,
                    needs="profile", build=lambda *a: None, preview=_prune_preview))
    monkeypatch.setattr(registry, "METHODS", tuple(registry.REGISTRY))
    # the models generated from the registry (METHOD_PARAMS, ConversionCreate) are made when
    # backend.schemas.conversions runs: reload it, then the package that re-exports them
    importlib.reload(backend.schemas.conversions)
    schemas = importlib.reload(backend.schemas)
    cli = importlib.reload(moelab.cli)
    try:
        assert "prune_head" in schemas.ConversionCreate.model_fields
        body = schemas.ConversionCreate(method="prune_head", profile_id="p", prune_head={"keep": 0.25})
        assert body.engine_params() == {"method": "prune_head", "keep": 0.25}
        with pytest.raises(Exception, match="keep"):
            schemas.ConversionCreate(method="prune_head", profile_id="p", prune_head={"keep": 2})
        opts = {p.name: p for p in cli.convert.params if isinstance(p, click.Option)}
        assert "--keep" in opts["keep"].opts and "prune_head" in opts["method"].type.choices
        assert params_from_dict({"method": "prune_head", "keep": 0.3}) == PruneParams(keep=0.3)
        # no label declared: its conversions are named by their first parameters (the API's `label`, the UI's names)
        assert conversion_label({"method": "prune_head", "keep": 0.3, "router": "ridge"}) == "keep 0.3, ridge router"
        with pytest.raises(ConversionError, match="keep=0.0: must be > 0"):
            PruneParams(keep=0.0).check()
    finally:
        monkeypatch.undo()
        importlib.reload(backend.schemas.conversions)
        importlib.reload(backend.schemas)
        importlib.reload(moelab.cli)
