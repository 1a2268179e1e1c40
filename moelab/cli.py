"""The ``moelab`` command line: a thin shell over ``moelab.engine``.

Every engine error becomes a one-line message and a non-zero exit; long work shows a
progress bar driven by the engine's progress callback.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import click

from .settings import get_settings

ENGINE_ERRORS: tuple[type[Exception], ...] = (ValueError, FileNotFoundError)


class _Bars:
    """One tqdm bar per engine stage."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.bar = None
        self.stage = None

    def __call__(self, stage: str, current: int, total: int) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        if stage != self.stage:
            self.close()
            self.stage = stage
            self.bar = tqdm(total=total, desc=stage, unit="step", file=sys.stderr, leave=True)
        self.bar.n = current
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _fail(exc: Exception) -> click.ClickException:
    return click.ClickException(str(exc))


@contextmanager
def _engine_errors(extra: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """Engine errors (bad input, missing files) become one-line CLI errors with exit 1."""
    try:
        yield
    except ENGINE_ERRORS + extra as exc:
        raise _fail(exc) from exc


@contextmanager
def _progress(quiet: bool = False, extra: tuple[type[Exception], ...] = ()) -> Iterator[Any]:
    """An engine Progress drawing bars, inside ``_engine_errors``."""
    from moelab.engine.progress import Progress

    bars = _Bars(enabled=not quiet)
    try:
        with _engine_errors(extra):
            yield Progress(callback=bars)
    finally:
        bars.close()


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


@click.group()
@click.version_option(package_name="moelab")
def main() -> None:
    """moelab: turn dense GLU language models into Mixture-of-Experts models, and see why."""


# --------------------------------------------------------------------------- declared parameters


def _param_option(spec: Any, *, type: Any, default: Any, help: str, aliases: list[str] | tuple[str, ...] = (),
                  **extra: Any) -> Callable[..., Any]:
    """The click option of one declared parameter (``moelab.engine.core.params``): ``--name``
    (plus its aliases), a bool as a ``--name/--no-name`` flag."""
    if spec.type == "bool" and not spec.choices:
        flags = [f"--{n}/--no-{n}" for n in (spec.name.replace("_", "-"), *(a.lstrip("-") for a in aliases))]
        return click.option(*flags, spec.name, default=default, help=help, **extra)
    return click.option(f"--{spec.name.replace('_', '-')}", *aliases, spec.name, type=type, default=default, help=help, **extra)


def _click_type(spec: Any) -> Any:
    """A declared parameter's choices, or its type within its declared bounds (gt/lt: open ends)."""
    if spec.choices:
        return click.Choice(list(spec.choices))
    low = spec.ge if spec.ge is not None else spec.gt
    high = spec.le if spec.le is not None else spec.lt
    if spec.type in ("int", "float") and (low is not None or high is not None):
        bounded = click.IntRange if spec.type == "int" else click.FloatRange
        return bounded(low, high, min_open=spec.gt is not None, max_open=spec.lt is not None)
    return {"int": int, "float": float, "str": str, "bool": bool}[spec.type]


def _declared_options(params: Any, skip: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """One option per parameter of a declared class (``ProfileSettings``, ``FinetuneParams``) that is
    neither ``internal`` nor in ``skip`` (a request-level option written by hand): its default,
    bounds, help and paper reference are the declaration's, as in the API schema."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        for spec in reversed(params.exposed_specs()):
            if spec.name not in skip:
                help_text = f"{spec.help} ({spec.paper})" if spec.paper else spec.help
                command = _param_option(spec, type=_click_type(spec), default=spec.default, help=help_text,
                                        show_default=True)(command)
        return command

    return decorate


def _profile_settings() -> Any:
    from moelab.engine.profiling.settings import ProfileSettings

    return ProfileSettings


def _finetune_params() -> Any:
    from moelab.engine.training.params import FinetuneParams

    return FinetuneParams


# --------------------------------------------------------------------------- profile


@main.command()
@click.option("--model", "model_spec", default="default", show_default=True, help="default | local dir | .gguf | HF id")
@click.option("--calib", default="builtin:mixed", show_default=True, help="builtin:NAME | FILE.jsonl | FILE.txt | hf:NAME | saved set dir")
@click.option("--samples", type=click.IntRange(min=1), default=240, show_default=True, help="samples drawn from the set")
@_declared_options(_profile_settings())
@click.option("--out", type=click.Path(path_type=Path), required=True, help="profile directory to write")
@click.option("--device", default=None, help="auto | cpu | cuda (default: MOELAB_DEVICE or auto)")
@click.option("--dtype", default=None, help="auto | float32 | bfloat16 | float16")
@click.option("--max-memory", default=None, metavar="SIZE", help="memory budget, e.g. 2GiB or 512MB: a larger model is profiled one decoder layer at a time (default: MOELAB_MAX_MEMORY; unset: load it whole)")
@click.option("--trust-remote-code", is_flag=True, help="allow the model's own Python code")
@click.option("--json", "as_json", is_flag=True, help="print the manifest as JSON")
@click.option("--quiet", is_flag=True, help="no progress bars")
def profile(
    model_spec: str, calib: str, samples: int, out: Path, device: str | None, dtype: str | None, max_memory: str | None,
    trust_remote_code: bool, as_json: bool, quiet: bool, **given: Any,
) -> None:
    """Profile a model's FFN activations over a calibration set (one streaming pass)."""
    from moelab.engine.data.calibration import load_calibration
    from moelab.engine.profiling.settings import ProfileSettings

    cfg = get_settings()
    settings = ProfileSettings(**{**given, "batch_tokens": max(given["batch_tokens"], given["max_tokens"])})
    with _engine_errors():  # a bad setting or set is refused in a second, before torch is imported
        settings.validate()
        cset = load_calibration(calib, samples=samples, seed=settings.seed, data_dir=cfg.data_dir)
    from moelab.engine.runs import run_profile

    _quiet_transformers()
    with _progress(quiet) as progress:
        stored = run_profile(
            model_spec, cset, out, settings, samples=samples, data_dir=cfg.data_dir, device=device or cfg.device,
            dtype=dtype or cfg.dtype, trust_remote_code=trust_remote_code or cfg.trust_remote_code, progress=progress,
            max_memory=max_memory or cfg.max_memory, time_kernels=cfg.time_kernels,
        )
    if as_json:
        click.echo(json.dumps(stored.manifest, indent=2))
        return
    _print_profile_summary(stored)


def _print_profile_summary(stored: Any) -> None:
    m = stored.manifest
    t = m["timings"]
    click.echo(
        f"profile written to {stored.path}\n"
        f"  model {m['model'].get('name', m['model']['source'])} ({m['model']['family']}, "
        f"{m['n_layers']} layers), calibration {m['calibration']['name']} "
        f"({m['calibration']['n_samples']} samples, {m['n_tokens']} tokens), CV across {m['cv_basis']}s"
    )
    click.echo(
        f"  forward {t['forward_s']:.1f}s ({m['n_tokens'] / t['forward_s']:.0f} tokens/s), "
        f"total {t['total_s']:.1f}s, peak RSS {t['peak_rss_mib']:.0f} MiB"
    )
    if t.get("streamed"):
        disk = [k for k in ("hidden_states", "unit_vectors", "second_moment") if t.get(f"{k}_on_disk")]
        click.echo(
            f"  streamed one layer at a time under --max-memory {t['max_memory_bytes'] / 2**30:.2f} GiB "
            f"({t['seconds_per_layer']:.2f} s/layer; on disk: {', '.join(disk).replace('_', ' ') or 'nothing'})"
        )
    by_layer = stored.neurons.groupby("layer").cv
    click.echo("  CV by layer (median / p90):")
    med, p90 = by_layer.median(), by_layer.quantile(0.9)
    for layer in med.index:
        bar = "#" * min(40, int(round(med[layer] * 20)))
        click.echo(f"    {layer:3d}  {med[layer]:6.3f} / {p90[layer]:6.3f}  {bar}")


# --------------------------------------------------------------------------- convert / evaluate


def _method_param_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """One ``--name`` option per parameter name of any registered method (``methods.REGISTRY``):
    the options are generated, so a parameter added to a method appears here without an edit.
    Defaults are the method's own (shown in the help); an option the chosen method does not read
    is refused by ``convert``."""
    from moelab.engine.methods import REGISTRY

    by_name: dict[str, list[tuple[str, Any]]] = {}
    for method in REGISTRY.values():
        for spec in method.params.exposed_specs():
            by_name.setdefault(spec.name, []).append((method.name, spec))
    for name, uses in reversed(list(by_name.items())):
        spec = uses[0][1]
        choices = sorted({c for _, s in uses for c in (s.choices or ())}, key=str)
        kind = click.Choice(choices) if choices else {"int": int, "float": float, "str": str, "bool": bool}[spec.type]
        defaults = ", ".join(f"{m} {s.default}" for m, s in uses)
        papers = sorted({s.paper for _, s in uses if s.paper})
        help_text = f"{spec.help}{' (' + '; '.join(papers) + ')' if papers else ''} [default: {defaults}]"
        aliases = [f"--{a}" for a in {a for _, s in uses for a in s.aliases}]
        command = _param_option(spec, type=kind, default=None, help=help_text, aliases=aliases)(command)
    return command


def _method_params(method: str, given: dict[str, Any], recipe: str = "paper") -> Any:
    """The chosen method's parameters: its recipe (``paper``: the defaults) with the options given on
    top; an option the method does not read is an error."""
    from moelab.engine.core.params import ConversionError
    from moelab.engine.methods import get_method

    cls = get_method(method).params
    names = {s.name for s in cls.specs()}
    stray = sorted(k for k, v in given.items() if v is not None and k not in names)
    if stray:
        flags = ", ".join("--" + k.replace("_", "-") for k in stray)
        raise click.UsageError(f"{flags}: not a parameter of {method} (see `moelab methods`)")
    try:
        return get_method(method).recipe(recipe, **{k: v for k, v in given.items() if v is not None and k in names})
    except ConversionError as exc:
        raise click.UsageError(str(exc)) from exc


def _method_choices() -> list[str]:
    from moelab.engine.methods import METHODS

    return list(METHODS)


def _recovery_modes() -> list[str]:
    from moelab.engine.methods import REGISTRY

    return [name for name, m in REGISTRY.items() if m.recovery is not None]


@main.command(context_settings={"max_content_width": 120})
@click.option("--method", type=click.Choice(_method_choices()), default="expertweaver", show_default=True)
@click.option("--profile", "profile_dirs", type=click.Path(path_type=Path), multiple=True, help="profile directory (moelab profile); midas: one per calibration set, repeat the option")
@click.option("--model", "model_source", help="hierarchical: the MoE model to restructure (a local directory or hub id)")
@click.option("--calib", help="hierarchical: calibration set spec, e.g. builtin:mixed")
@click.option("--recipe", type=click.Choice(["paper", "best", "portable"]), default="paper", show_default=True,
              help="paper: the method's paper settings; best: the best training-free conversion measured "
                   "(expertweaver: 128 experts, ridge router, per-layer budget plan, skipped-expert compensation; with --sparsity S its "
                   "ffn_flops_fraction is ≤ 1 − S); portable (expertweaver): the best one that exports to GGUF / native "
                   "HF after `moelab finetune --mode expertweaver` (one top-k, leading dense layers, no compensation)")
@_method_param_options
@click.option("--max-memory", default=None, metavar="SIZE",
              help="memory budget, e.g. 2GiB: a dense model larger than it is converted one decoder layer at a time "
                   "(expertweaver/cmoe, every recipe: a fitted one in two passes, its fit held beside the layer; "
                   "default: MOELAB_MAX_MEMORY; unset: load it whole)")
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--json", "as_json", is_flag=True)
@click.option("--quiet", is_flag=True)
def convert(method: str, profile_dirs: tuple[Path, ...], model_source: str | None, calib: str | None, recipe: str,
            max_memory: str | None, out: Path, as_json: bool, quiet: bool, **given: Any) -> None:
    """Convert a model into an MoE model and export it (`moelab methods` lists every method and parameter).

    \b
    expertweaver, cmoe  neuron partitioning of a profiled dense model (training-free)
    dense2moe           layer-fusion upcycling from the profile's S_L / S_M (D2 §2.3)
    midas               one low-rank expert per calibration set: one --profile per set (MI §3.2)
    hierarchical        shared + routed sub-experts inside every expert of an MoE model (AF §4.4)
    """
    from moelab.engine.methods import check_conversion

    cfg = get_settings()
    params = _method_params(method, given, recipe)
    with _engine_errors():  # refused in a second, before torch is imported
        check_conversion(params, list(profile_dirs), model_source, calib)
    from moelab.engine.runs import run_conversion

    _quiet_transformers()
    with _progress(quiet) as progress:
        record = run_conversion(
            profile_dirs[0] if profile_dirs else None, params, out, data_dir=cfg.data_dir, device=cfg.device,
            trust_remote_code=cfg.trust_remote_code, progress=progress, extra_profiles=profile_dirs[1:],
            model=model_source, calib=calib, max_memory=max_memory or cfg.max_memory, time_kernels=cfg.time_kernels,
        )
    if as_json:
        click.echo(json.dumps(record, indent=2))
        return
    s = record["summary"]
    sizes = ""
    if s.get("total_params"):
        sizes = f", {s['active_params'] / 1e6:.1f}M of {s['total_params'] / 1e6:.1f}M parameters active per token"
    if s.get("ffn_flops_fraction") is not None:
        sizes += f", FFN cost {s['ffn_flops_fraction']:.3f} of dense (ffn_flops_fraction)"
    t = record["timings"]
    click.echo(f"converted model written to {out} ({method}){sizes}, {t['total_s']:.1f}s")
    if t.get("streamed"):
        fitted = " (fitted in a first pass, built in a second)" if record.get("fit") else ""
        budget = t["max_memory_bytes"] / 2**30
        click.echo(f"  streamed one layer at a time under --max-memory {budget:.2f} GiB{fitted}, "
                   f"peak RSS {t['peak_rss_mib']:.0f} MiB")
    if s.get("predicted_speed"):
        from moelab.engine.core.speed_prediction import describe_predicted

        click.echo(describe_predicted(s["predicted_speed"]))
    if s.get("speed_guard"):
        click.echo(f"speed guard: {s['speed_guard']}")
    if "active_fraction" in s:  # a per-layer partition plan
        _print_partition(record)
    else:
        for key, value in s.items():
            if not isinstance(value, (dict, list)):
                click.echo(f"  {key}: {value}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable: every method with its parameters")
def methods(as_json: bool) -> None:
    """List the conversion methods and their parameters (name, type, default, help, paper reference)."""
    from moelab.engine.methods import describe_methods

    described = describe_methods()
    if as_json:
        click.echo(json.dumps(described, indent=2))
        return
    for m in described:
        click.echo(f"{m['name']}  ({m['title']}, {m['paper']}; reads: {m['needs']})")
        click.echo(f"  {m['summary']}")
        for p in m["params"]:
            kind = "|".join(map(str, p["choices"])) if p["choices"] else p["type"]
            bounds = " ".join(f"{sym}{p[k]:g}" for k, sym in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")) if p[k] is not None)
            paper = f"  [{p['paper']}]" if p["paper"] else ""
            click.echo(f"    --{p['name'].replace('_', '-'):<20} {kind:<26} default {str(p['default']):<14} {bounds:<12} {p['help']}{paper}")
        if m["recovery"]:
            click.echo(f"  recovery fine-tuning: {m['recovery']}")
        click.echo("")


@main.command()
@click.argument("conversion_dir", type=click.Path(path_type=Path))
@click.option("--mode", type=click.Choice(_recovery_modes()), default=None,
              help="default: the conversion's method (CM §3.3 gate scale + bias + LoRA; EW Eqs. 11-12 softmax router + "
                   "load balancing; MIDAS gate + LoRA; Dense2MoE router)")
@_declared_options(_finetune_params(), skip=("mode",))
@click.option("--out", type=click.Path(path_type=Path), required=True, help="work dir; an interrupted run resumes from its last checkpoint")
@click.option("--json", "as_json", is_flag=True)
@click.option("--quiet", is_flag=True)
def finetune(conversion_dir: Path, mode: str | None, out: Path, as_json: bool, quiet: bool, **given: Any) -> None:
    """Recovery fine-tuning of a converted model; the fine-tuned model is exported to OUT/model."""
    from moelab.engine.training.finetune import FinetuneError, FinetuneParams, run_finetune
    from moelab.engine.methods import method_of
    from moelab.engine.runs import read_conversion

    cfg = get_settings()
    _quiet_transformers()
    with _progress(quiet, extra=(FinetuneError,)) as progress:  # bars on stderr with --json too; stdout stays the JSON
        if mode is None:
            method = method_of(read_conversion(conversion_dir)["params"])
            if method not in _recovery_modes():
                raise click.UsageError(f"{method} conversions have no recovery mode yet; pass --mode explicitly")
            mode = method
        params = FinetuneParams(mode=mode, **given)
        params.validate()
        summary = run_finetune(conversion_dir, params, out, data_dir=cfg.data_dir, device=cfg.device, progress=progress)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(f"fine-tuned model written to {out / 'model'} ({mode})")
    for key in ("perplexity_before", "perplexity_after", "dense_perplexity", "steps", "tokens"):
        if key in summary:
            click.echo(f"  {key}: {summary[key]}")


def _print_partition(record: dict[str, Any]) -> None:
    s = record["summary"]
    click.echo(f"  {100 * s['active_fraction']:.1f}% of FFN neurons active")
    click.echo("  layer  shared  routed  top-k  expert  objective  iters")
    for row in record["layers"]:
        obj = "-" if row["objective"] is None else f"{row['objective']:.4g}"
        flag = "  static" if row["static"] else ""
        click.echo(
            f"  {row['layer']:5d}  {row['d_shared']:6d}  {row['n_routed']:6d}  {row['top_k']:5d}  "
            f"{row['expert_size']:6d}  {obj:>9}  {row['n_iter']:5d}{flag}"
        )
    from moelab.engine.methods.labels import collapse_notes

    for line in collapse_notes([row for row in record["layers"] if row["note"]]):
        click.echo(f"  note, {line}")


@main.command()
@click.argument("conversion_dir", type=click.Path(path_type=Path))
@click.option("--windows", type=click.IntRange(min=1), default=32, show_default=True, help="held-out windows")
@click.option("--seq-len", type=click.IntRange(min=8), default=256, show_default=True)
@click.option("--source", default="builtin:mixed", show_default=True, help="built-in set whose held-out split is used")
@click.option("--no-baselines", is_flag=True, help="skip AbsTopK-GLU, uniform allocation and TEAL (activation sparsity)")
@click.option("--no-speed", is_flag=True, help="do not time the converted model against dense (decode batch 1 and 8, prefill)")
@click.option("--tasks", "task_names", default=None,
              help="lm-evaluation-harness tasks, comma-separated (e.g. moelab_chat_qa,moelab_lastword,arc_easy): "
                   "accuracy ± stderr of every model evaluated; `moelab tasks` lists them")
@click.option("--num-fewshot", type=click.IntRange(min=0), default=None, help="few-shot examples per item (default: each task's own)")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="items per task (default: all)")
@click.option("--task-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="a directory of your own lm-eval task YAMLs (lm-eval's include path)")
@click.option("--online", is_flag=True, help="let lm-eval download task data (default: offline, installed or cached data only)")
@click.option("--table", type=click.Choice(["markdown", "csv"]), default=None,
              help="print the tasks as a paper-style table (one row per model, one column per task) instead of the report")
@click.option("--json", "as_json", is_flag=True)
@click.option("--quiet", is_flag=True)
def evaluate(conversion_dir: Path, windows: int, seq_len: int, source: str, no_baselines: bool, no_speed: bool,
             task_names: str | None, num_fewshot: int | None, limit: int | None, task_dir: Path | None, online: bool, table: str | None,
             as_json: bool, quiet: bool) -> None:
    """Perplexity dense vs converted vs baselines on held-out text, reconstruction, routing; with --tasks, downstream
    accuracy through lm-evaluation-harness; the whole converted model timed against dense in three phases."""
    from moelab.engine.evaluation.harness import TaskRequest, task_table
    from moelab.engine.evaluation.speed import SpeedProtocol, describe
    from moelab.engine.runs import run_evaluation

    cfg = get_settings()
    _quiet_transformers()
    if table and not task_names:
        raise click.UsageError("--table needs --tasks")
    request = None
    if task_names:
        names = tuple(dict.fromkeys(t.strip() for t in task_names.split(",") if t.strip()))
        request = TaskRequest(tasks=names, num_fewshot=num_fewshot, limit=limit, task_dir=task_dir, online=online)
    with _progress(quiet) as progress:  # bars on stderr even with --json (stdout stays the JSON): minutes of silence read as hung
        report = run_evaluation(
            conversion_dir, data_dir=cfg.data_dir, n_windows=windows, seq_len=seq_len,
            baselines=not no_baselines, source=source, device=cfg.device, progress=progress,
            max_tokens=cfg.max_eval_tokens,  # windows × seq-len beyond MOELAB_MAX_EVAL_TOKENS: refused before any model loads
            tasks=request, speed=None if no_speed else SpeedProtocol(**cfg.speed_protocol()),
        )
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    if table:
        click.echo(task_table(report["tasks"], fmt=table), nl=False)
        return
    h = report["heldout"]
    click.echo(f"held-out {h['source']} ({h['windows']} windows x {h['seq_len']} tokens)")
    click.echo("  variant      perplexity  x dense  95% CI (windows)  tokens/s  mean recon. err  mean load CV")
    for name, r in report["results"].items():
        rec = r.get("reconstruction_error")
        cv = [v for v in r.get("routing", {}).get("load_cv", {}).values() if v == v]
        tps = "stored" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:.0f}"  # a reused dense score
        ci = r.get("perplexity_ratio_ci")
        interval = f"{ci[0]:.3f}-{ci[1]:.3f}" if ci else ""
        click.echo(
            f"  {name:<11} {r['perplexity']:11.2f}  {r.get('perplexity_ratio', 1):7.2f}  {interval:>16}  {tps:>8}  "
            f"{(sum(rec) / len(rec)) if rec else 0:15.3f}  {(sum(cv) / len(cv)) if cv else float('nan'):12.3f}"
        )
    own = report["summary"].get("ffn_flops_fraction")
    for name, r in report["results"].items():  # a baseline matched to the conversion's cost says what it was built at
        if "ffn_flops_fraction" in r:
            click.echo(f"  {name}: ffn_flops_fraction {r['ffn_flops_fraction']:.3f}"
                       + (f" (the conversion's: {own:.3f})" if isinstance(own, (int, float)) else ""))
    for name, note in (report.get("notes") or {}).items():
        click.echo(f"  note ({name}): {note}")
    if report.get("speed"):
        click.echo("\n".join(describe(report["speed"])))
    if report.get("tasks"):
        click.echo("downstream accuracy (lm-evaluation-harness; % ± stderr)")
        click.echo(task_table(report["tasks"]), nl=False)


@main.command("tasks")
@click.option("--task-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="also list the tasks of this directory of lm-eval task YAMLs")
@click.option("--all", "show_all", is_flag=True, help="also list lm-eval's registry (their data must be cached, or --online)")
@click.option("--json", "as_json", is_flag=True)
def tasks_list(task_dir: Path | None, show_all: bool, as_json: bool) -> None:
    """Tasks `moelab evaluate --tasks` can run: moelab's built-in ones (offline), a --task-dir's, lm-eval's."""
    from moelab.engine.evaluation.harness import list_tasks

    with _engine_errors():
        listed = list_tasks(task_dir)
    registry = [t for t in listed if t["source"] == "lm-eval"]
    shown = listed if show_all else [t for t in listed if t["source"] != "lm-eval"]
    if as_json:
        click.echo(json.dumps(shown, indent=2))
        return
    for t in shown:
        click.echo(f"{t['name']:<40} {t['source']:<9} {'offline' if t['offline'] else 'needs its data cached or --online'}")
    if not show_all:
        click.echo(f"… and {len(registry)} tasks of lm-eval's registry (--all lists them; their data must be cached, or --online)")


@main.command("export")
@click.argument("src")
@click.option("--format", "fmt", type=click.Choice(["moelab", "native", "gguf"]), default="moelab", show_default=True,
              help="moelab: the moelab runtime (trust_remote_code=True); native: a stock transformers architecture "
                   "(Qwen2-MoE / Qwen3-MoE, no remote code); gguf: a llama.cpp file (deepseek architecture; Ollama "
                   "imports it). native and gguf need a layout they express exactly, else an error says why")
@click.option("--type", "gguf_type", type=click.Choice(["f32", "f16", "q8_0"]), default="f16", show_default=True,
              help="GGUF tensor type (--format gguf)")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="directory to write (replaced atomically)")
@click.option("--json", "as_json", is_flag=True)
def export(src: str, fmt: str, gguf_type: str, out: Path, as_json: bool) -> None:
    """Export a conversion or fine-tuned model directory SRC (with its model card, README.md).

    \b
    native exports a uniform plan (same routed experts, expert size, top-k and shared width in every
    MoE layer; other layers dense) with a softmax router and weighted combine (EW Eq. 11, i.e. after
    `moelab finetune --mode expertweaver`; Dense2MoE with --combine weighted), from a Llama, Qwen2, Gemma
    or Mistral source as Qwen2-MoE, from a Qwen3 source without shared part as Qwen3-MoE.
    gguf needs the same from a Llama or Mistral source, with the dense layers only before the first MoE
    layer (`--recipe portable`, recovered); SRC may also be a dense model (default, a model directory or
    a .gguf) so that the baseline is exported the same way and at the same --type.
    """
    from moelab.engine.runtime.native_export import export_converted

    _quiet_transformers()
    with _engine_errors((OSError,)):
        info = export_converted(src, out, fmt, gguf_type=gguf_type, data_dir=get_settings().data_dir)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    if fmt == "gguf":
        click.echo(f"{info['architecture']} GGUF ({gguf_type}, {info['bytes'] / 2**20:.1f} MiB) written to {info['file']} "
                   f"(llama-cli -m {info['file']}; Ollama: ollama create NAME -f {Path(out) / 'Modelfile'})")
        if info.get("note"):
            click.echo(f"note: {info['note']}")
        return
    how = "trust_remote_code=True" if fmt == "moelab" else "trust_remote_code=False"
    click.echo(f"{info['model_type']} model written to {out} (load with AutoModelForCausalLM.from_pretrained, {how}); "
               f"model card: {Path(out) / 'README.md'}")


# --------------------------------------------------------------------------- probes


@main.group()
def probe() -> None:
    """Short looks at a model on one text."""


@probe.command("activation")
@click.option("--profile", "profile_dir", type=click.Path(path_type=Path), required=True,
              help="a profile directory: its dense model computes the activations")
@click.option("--layer", type=click.IntRange(min=0), required=True)
@click.option("--neuron", "neurons", type=click.IntRange(min=0), multiple=True, required=True,
              help="a neuron of the layer; repeat for more (at most 64)")
@click.option("--text", default=None, help="the text (at most 512 tokens)")
@click.option("--sample-source", default=None, help="builtin:NAME: a held-out sample of that set instead of --text")
@click.option("--sample", type=click.IntRange(min=0), default=0, show_default=True, help="which held-out sample")
@click.option("--json", "as_json", is_flag=True)
@click.option("--quiet", is_flag=True)
def probe_activation(profile_dir: Path, layer: int, neurons: tuple[int, ...], text: str | None, sample_source: str | None,
                     sample: int, as_json: bool, quiet: bool) -> None:
    """Each neuron's activation h = act(x W_gate) * (x W_up) on every token of a text (the profile's quantity)."""
    from moelab.engine.runs import heldout_sample, run_activation_probe

    if (text is None) == (sample_source is None):
        raise click.UsageError("give exactly one of --text or --sample-source builtin:NAME")
    cfg = get_settings()
    _quiet_transformers()
    with _progress(quiet) as progress:
        if text is None:
            text = heldout_sample(sample_source, sample, data_dir=cfg.data_dir)
        out = run_activation_probe(profile_dir, text=text, layer=layer, neurons=list(neurons), data_dir=cfg.data_dir,
                                   device=cfg.device, progress=progress)
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    click.echo("token  piece" + "".join(f"  {'n' + str(n):>10}" for n in out["neurons"]))
    for t, piece in enumerate(out["tokens"]):
        click.echo(f"{t:5d}  {piece!r:<16}" + "".join(f"  {a[t]:+10.4f}" for a in out["activations"]))
    for ref in out["reference"]:
        top = "unknown" if ref["top_value"] is None else f"{ref['top_value']:+.4f}"
        click.echo(f"  neuron {ref['neuron']}: profile's top h {top}, mean gate activation {ref['gate_mean']:+.4f}, rate {ref['rate']:.3f}")


# --------------------------------------------------------------------------- the running service's runs

NOTED = ("models", "calibration-sets", "profiles", "conversions", "evaluations", "finetunes", "probes", "activation-probes", "exports")


def _service() -> Any:
    """A client of the running service's API (MOELAB_API_URL, MOELAB_API_TOKEN), failing in words."""
    from moelab.api_client import ApiClient

    return ApiClient()


@main.group()
def runs() -> None:
    """The running service's evaluations, notes and tags (through its HTTP API: MOELAB_API_URL)."""


@runs.command("list")
@click.option("--tag", default=None)
@click.option("--method", default=None)
@click.option("--text", default=None, help="held-out text: builtin:NAME, a set id or name")
@click.option("--status", default=None, type=click.Choice(["queued", "running", "ready", "failed", "cancelled"]))
@click.option("--q", "words", default=None, help="words found in the id, the text, the notes or the tags")
@click.option("--json", "as_json", is_flag=True)
def runs_list(tag: str | None, method: str | None, text: str | None, status: str | None, words: str | None, as_json: bool) -> None:
    """Evaluations, newest first, filtered as the Evaluations page filters them."""
    from moelab.api_client import ApiError

    try:
        items = _service().evaluations(tag=tag, method=method, text=text, status=status, q=words)
    except ApiError as exc:
        raise _fail(exc) from exc
    if as_json:
        click.echo(json.dumps(items, indent=2, default=str))
        return
    for e in items:
        v = ((e.get("summary") or {}).get("variants") or {}).get("converted") or {}
        ratio = v.get("perplexity_ratio")
        click.echo(f"{e['id']}  {e['status']:<9} {e['conversion_id']}  {(e.get('params') or {}).get('source', '?'):<18} "
                   f"{'' if ratio is None else f'{ratio:.3f}x dense':<14} {','.join(e.get('tags') or [])}"
                   + (f"  # {e['notes']}" if e.get("notes") else ""))
    click.echo(f"{len(items)} evaluation(s)")


@runs.command("note")
@click.argument("collection", type=click.Choice(NOTED))
@click.argument("ident")
@click.option("--notes", default=None, help="the new notes ('' clears them)")
@click.option("--tag", "tags", multiple=True, help="a tag to add; repeat for more")
@click.option("--untag", "untags", multiple=True, help="a tag to take away; repeat for more")
def runs_note(collection: str, ident: str, notes: str | None, tags: tuple[str, ...], untags: tuple[str, ...]) -> None:
    """Set the notes of a stored resource and add or remove its tags."""
    from moelab.api_client import ApiError

    if notes is None and not tags and not untags:
        raise click.UsageError("nothing to change: give --notes, --tag or --untag")
    try:
        out = _service().set_notes(collection, ident, notes=notes, add_tags=list(tags) or None, remove_tags=list(untags) or None)
    except ApiError as exc:
        raise _fail(exc) from exc
    click.echo(f"{collection} {out['id']}: tags {', '.join(out['tags']) or '(none)'}" + (f"; notes: {out['notes']}" if out.get("notes") else ""))


# --------------------------------------------------------------------------- data


@main.group()
def data() -> None:
    """Calibration sets: list built-ins, inspect, save, install BIG-bench."""


@data.command("list")
def data_list() -> None:
    """List the built-in calibration sets."""
    from moelab.engine.data.builtin import BUILTIN_SETS

    for name, description in BUILTIN_SETS.items():
        click.echo(f"builtin:{name:<14} {description}")


@data.command("show")
@click.argument("spec")
@click.option("--samples", type=click.IntRange(min=1), default=None)
@click.option("--seed", type=int, default=0)
@click.option("--preview", type=click.IntRange(min=0), default=3, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def data_show(spec: str, samples: int | None, seed: int, preview: int, as_json: bool) -> None:
    """Show a calibration set's statistics and a few samples."""
    from moelab.engine.data.calibration import load_calibration

    with _engine_errors():
        cset = load_calibration(spec, samples=samples, seed=seed, data_dir=get_settings().data_dir)
    info = {"id": cset.id, "name": cset.name, "source": cset.source, "stats": cset.stats(), "preview": cset.preview(preview)}
    if as_json:
        click.echo(json.dumps(info, indent=2, ensure_ascii=False))
        return
    click.echo(f"{cset.id}  {cset.name}  ({len(cset.samples)} samples from {cset.source})")
    for label in ("task", "domain"):
        groups = info["stats"].get(f"{label}s") or {}
        if groups:
            click.echo(f"  by {label}: " + ", ".join(f"{k} {v['samples']}" for k, v in sorted(groups.items())))
    for p in info["preview"]:
        click.echo(f"  [{p.get('task')}/{p.get('domain')}] {p['text'][:120]!r}")


@data.command("build")
@click.argument("spec")
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--samples", type=click.IntRange(min=1), default=None)
@click.option("--seed", type=int, default=0)
def data_build(spec: str, out: Path, samples: int | None, seed: int) -> None:
    """Materialise a calibration set (parquet + JSON) so it can be reused by path."""
    from moelab.engine.data.calibration import load_calibration

    with _engine_errors():
        cset = load_calibration(spec, samples=samples, seed=seed, data_dir=get_settings().data_dir)
        cset.save(out)
    click.echo(f"{cset.id}: {len(cset.samples)} samples written to {out}")


@data.command("install")
@click.argument("name", type=click.Choice(["bigbench"]))
@click.option("--sdist", type=click.Path(exists=True, path_type=Path), default=None, help="use a downloaded bigbench-1.0.0.tar.gz")
def data_install(name: str, sdist: Path | None) -> None:
    """Install an optional data set (BIG-bench: ~358 MB download from PyPI)."""
    from moelab.engine.data.builtin import install_bigbench

    with _progress(extra=(OSError, RuntimeError)) as progress:
        where = install_bigbench(get_settings().data_dir, progress=progress.callback, sdist=sdist)
    click.echo(f"{name} installed at {where}; use --calib builtin:bigbench")


# --------------------------------------------------------------------------- models


@main.command("inspect")
@click.argument("spec", default="default")
@click.option("--trust-remote-code", is_flag=True)
@click.option("--quiet", is_flag=True, help="no progress bars")
def inspect_model(spec: str, trust_remote_code: bool, quiet: bool) -> None:
    """Print a model's layer structure (family, GLU layout, sizes) as JSON."""
    from moelab.engine.models import load_model

    cfg = get_settings()
    _quiet_transformers()
    with _progress(quiet) as progress:  # the first load of the default model dequantises it: a minute, on stderr
        adapter = load_model(spec, data_dir=cfg.data_dir, device="cpu", trust_remote_code=trust_remote_code or cfg.trust_remote_code,
                             progress=progress)
    click.echo(json.dumps(adapter.describe(), indent=2))


# --------------------------------------------------------------------------- service


@main.command()
@click.option("--host", default=None, help="address to bind (default: MOELAB_HOST or 127.0.0.1)")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="API port (default: MOELAB_PORT or 8000)")
@click.option("--no-worker", is_flag=True, help="do not start a Celery worker (run workers elsewhere)")
@click.option("--no-frontend", is_flag=True, help="do not start the Dash frontend")
@click.option("--workers", type=click.IntRange(1, 64), default=None,
              help="worker processes (default: MOELAB_WORKERS or 1); a conversion shares its layers with the idle ones")
@click.option("--insecure", is_flag=True,
              help="serve beyond loopback without MOELAB_API_TOKEN (also MOELAB_INSECURE=1): only when something else guards the ports")
def serve(host: str | None, port: int | None, no_worker: bool, no_frontend: bool, workers: int | None, insecure: bool) -> None:
    """Run everything: Redis (private, unless MOELAB_REDIS_URL is set), the API, a worker, the UI.

    A child that dies is restarted with back-off while the others keep running (a dead worker's
    job is failed at once, with the cause). Ctrl-C stops every child process cleanly, and they
    end with it even when it is killed. With MOELAB_API_TOKEN set the UI asks for the token too
    (a login page); without it, a --host beyond loopback is refused unless --insecure.
    """
    from .serve import serve as run_service

    cfg = get_settings()
    overrides = {k: v for k, v in (("host", host), ("port", port), ("workers", workers)) if v is not None}
    sys.exit(run_service(cfg.model_copy(update=overrides), worker=not no_worker, frontend=not no_frontend, insecure=insecure))


if __name__ == "__main__":  # pragma: no cover
    main()
