"""Downstream accuracy through lm-evaluation-harness, as the papers judge conversions (CM Table 2, EW's and
D2M's task tables): any moelab model (dense, converted, a baseline swapped into the dense model, before or
after fine-tuning) is served to the harness through its own ``HFLM`` wrapper, and the harness's task
registry, few-shot sampling and scoring are used as they are.

Tasks come from three places: lm-eval's registry, moelab's built-in tasks (``lm_tasks/``: YAMLs over text
the project installs, so they run offline), and a user's directory of task YAMLs (``task_dir``, passed as
lm-eval's include path). Offline by default: a task whose data is neither installed nor cached fails before
any model runs, with a message naming it and how to make it available.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch-free at import: the API checks task names with this module
    from torch import nn

BUILTIN_TASK_DIR = Path(__file__).with_name("lm_tasks")
#: moelab's own tasks: what ``moelab tasks`` lists first, and what runs anywhere.
BUILTIN_TASKS = ("moelab_chat_qa", "moelab_lastword", "moelab_math_qa", "moelab_humaneval", "moelab_bigbench_mc")
#: Built-in tasks whose data is an optional download (``moelab data install bigbench``).
NEEDS_INSTALL = {"moelab_bigbench_mc": "moelab data install bigbench"}
#: The built-in calibration set each built-in task's text comes from: whether a conversion was calibrated in the
#: task's domain is this set against its calibration set's domains.
BUILTIN_TASK_DOMAINS = {"moelab_chat_qa": "builtin:chat", "moelab_lastword": "builtin:literature",
                        "moelab_math_qa": "builtin:math", "moelab_humaneval": "builtin:code_problems",
                        "moelab_bigbench_mc": "builtin:bigbench"}
#: The harness's metrics kept in an evaluation record (each with its ``_stderr``), in this order of preference.
METRICS = ("acc", "acc_norm", "pass@1", "exact_match", "perplexity", "word_perplexity")


def headline_metric(metrics: dict[str, Any] | None) -> str | None:
    """The metric a table shows for a task: the first of ``METRICS`` the record holds a value of."""
    return next((k for k in METRICS if (metrics or {}).get(k) is not None), None)


class TaskError(ValueError):
    """A task that cannot run here: unknown, or its data is not reachable. The message says what to do."""


@dataclass(frozen=True)
class TaskRequest:
    """What to run: task names, few-shot examples (None: each task's own default), items per task
    (None: all), a user's directory of task YAMLs, and whether the harness may download data."""

    tasks: tuple[str, ...]
    num_fewshot: int | None = None
    limit: int | None = None
    task_dir: Path | None = None
    online: bool = False
    batch_size: int = 8
    data_dir: Path | None = None  # moelab's data dir: where optional task data (BIG-bench) is installed

    def describe(self) -> dict[str, Any]:
        return {"tasks": list(self.tasks), "num_fewshot": self.num_fewshot, "limit": self.limit,
                "task_dir": str(self.task_dir) if self.task_dir else None}


@lru_cache(maxsize=8)
def _task_manager(task_dir: str | None, data_dir: str | None, registry: bool = True) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(BUILTIN_TASK_DIR), *([task_dir] if task_dir else [])], include_defaults=registry,
                       metadata={"data_dir": data_dir} if data_dir else None)


def task_manager(task_dir: Path | None = None, data_dir: Path | None = None, registry: bool = True) -> Any:
    """lm-eval's TaskManager over moelab's built-in tasks, ``task_dir`` and (``registry``) lm-eval's own thousands,
    whose index takes seconds to build; ``data_dir`` reaches the built-in tasks' data functions as metadata (where
    BIG-bench is installed)."""
    if task_dir is not None and not Path(task_dir).is_dir():
        raise TaskError(f"task directory {task_dir} does not exist: give a directory of lm-eval task YAMLs")
    return _task_manager(str(Path(task_dir).resolve()) if task_dir else None, str(data_dir) if data_dir else None, registry)


def manager_for(names: Sequence[str], task_dir: Path | None = None, data_dir: Path | None = None) -> Any:
    """The smallest TaskManager that knows every task of ``names``: moelab's built-in ones and ``task_dir``'s alone
    when they hold them all (indexed in milliseconds), else one over lm-eval's registry too (some 6 s to index, paid
    by every process that evaluates a built-in task if it were always built)."""
    narrow = task_manager(task_dir, data_dir, registry=False)
    if set(names) <= set(narrow.all_tasks):
        return narrow
    return task_manager(task_dir, data_dir)


def list_tasks(task_dir: Path | None = None, registry: bool = True) -> list[dict[str, Any]]:
    """Every task a run can name: moelab's built-in ones first (offline), then a user's (``task_dir``),
    then (``registry``) lm-eval's registry (their data must be in the HF cache, or ``online``). Without the registry
    nothing indexes lm-eval's own tasks: the API's default answer takes milliseconds, not the index's seconds."""
    out = [{"name": n, "source": "builtin", "offline": True, "domain": BUILTIN_TASK_DOMAINS[n],
            **({"needs": NEEDS_INSTALL[n]} if n in NEEDS_INSTALL else {})} for n in BUILTIN_TASKS]
    if not registry and task_dir is None:
        return out
    manager = task_manager(task_dir, registry=registry)
    user = set()
    if task_dir is not None:
        user = {n for n, e in manager.task_index.items() if e.yaml_path and Path(e.yaml_path).resolve().is_relative_to(Path(task_dir).resolve())}
    out += [{"name": n, "source": "task_dir", "offline": True, "domain": None} for n in sorted(user)]
    out += [{"name": n, "source": "lm-eval", "offline": False, "domain": None} for n in manager.all_subtasks
            if n not in BUILTIN_TASKS and n not in user]
    return out


@contextlib.contextmanager
def _datasets_offline(offline: bool) -> Iterator[None]:
    """``datasets`` reads its offline switch at import: set it for the run, as HF_HUB_OFFLINE=1 would."""
    import datasets.config as cfg

    saved = cfg.HF_HUB_OFFLINE
    cfg.HF_HUB_OFFLINE = offline or saved
    try:
        yield
    finally:
        cfg.HF_HUB_OFFLINE = saved


def unknown_tasks(names: Sequence[str], task_dir: Path | None = None, data_dir: Path | None = None) -> list[str]:
    """The names among ``names`` that no registry (built-in, ``task_dir``, lm-eval's) knows. Torch-free."""
    known = set(manager_for(names, task_dir, data_dir).all_tasks)
    return [n for n in names if n not in known]


def load_tasks(request: TaskRequest) -> dict[str, Any]:
    """``{name: lm-eval Task}`` with their data loaded, one task at a time so a failure names its task.
    Raised before any model runs: TaskError (unknown task, unreachable data)."""
    if not request.tasks:
        raise TaskError("no tasks given: name at least one (moelab tasks lists them)")
    manager = manager_for(request.tasks, request.task_dir, request.data_dir)
    unknown = unknown_tasks(request.tasks, request.task_dir, request.data_dir)
    if unknown:
        raise TaskError(f"unknown task(s) {', '.join(unknown)}: `moelab tasks` lists the tasks (built-in, lm-eval's, "
                        "and those of --task-dir)")
    loaded: dict[str, Any] = {}
    _quiet_harness()
    with _datasets_offline(not request.online), contextlib.redirect_stdout(sys.stderr):
        for name in request.tasks:
            try:
                built = manager.load([name])
            except Exception as exc:  # noqa: BLE001 -- the harness raises whatever its dataset loader raised
                reason = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
                if name in NEEDS_INSTALL:
                    raise TaskError(f"task {name!r} needs its data installed: run `{NEEDS_INSTALL[name]}`") from exc
                raise TaskError(
                    f"task {name!r} cannot load its data here ({reason}): put its dataset in the Hugging Face cache "
                    "(HF_HOME) on a machine with network, or allow downloads (--online), or use a built-in task "
                    f"({', '.join(BUILTIN_TASKS)})") from exc
            loaded.update(built["tasks"])
    return loaded


def _quiet_harness() -> None:
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _metrics(entry: dict[str, Any]) -> dict[str, float | None]:
    """``{"acc": .., "acc_stderr": .., ...}`` from one task's entry of lm-eval's results (keys ``acc,none``)."""
    out: dict[str, float | None] = {}
    for metric in METRICS:
        key = f"{metric},none"
        if key in entry:
            value = entry[key]
            out[metric] = float(value) if value is not None else None
            err = entry.get(f"{metric}_stderr,none")
            out[f"{metric}_stderr"] = float(err) if isinstance(err, (int, float)) and math.isfinite(err) else None
    return out


def run_tasks(model: "nn.Module", tokenizer: Any, request: TaskRequest, tasks: dict[str, Any] | None = None,
              ) -> dict[str, dict[str, Any]]:
    """lm-eval's scores of ``model`` on the requested tasks: ``{task: {"acc": .., "acc_stderr": .., "n": ..}}``.

    ``tasks``: from ``load_tasks`` (load once, score several models). The model is served through lm-eval's
    ``HFLM`` as it is (its device and dtype); a swapped-MLP baseline is served while its swap is in place."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    tasks = tasks if tasks is not None else load_tasks(request)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=request.batch_size)
    was_training = model.training
    model.eval()
    try:  # the harness prints (e.g. "bootstrapping for stddev") to stdout, which a CLI's --json keeps for its JSON
        with _datasets_offline(not request.online), contextlib.redirect_stdout(sys.stderr):
            res = simple_evaluate(model=lm, tasks=list(tasks.values()), num_fewshot=request.num_fewshot,
                                  limit=request.limit, log_samples=False, bootstrap_iters=1000,
                                  task_manager=manager_for(request.tasks, request.task_dir, request.data_dir), verbosity="ERROR")
    finally:
        model.train(was_training)
    out: dict[str, dict[str, Any]] = {}
    for name in tasks:
        entry = res["results"].get(name, {})
        n = res.get("n-samples", {}).get(name, {})
        out[name] = {**_metrics(entry), "n": int(n.get("effective", 0)) if n else None,
                     "num_fewshot": res.get("n-shot", {}).get(name)}
    return out


def task_table(tasks: dict[str, dict[str, dict[str, Any]]], variants: Sequence[str] | None = None,
               fmt: str = "markdown") -> str:
    """A paper-style table of an evaluation's ``tasks`` (``{task: {variant: metrics}}``): one row per model,
    one column per task, the task's first metric (acc, else pass@1 …) in percent ± its stderr."""
    names = list(tasks)
    rows = list(variants) if variants else list(dict.fromkeys(v for t in tasks.values() for v in t))

    def cell(task: str, variant: str) -> str:
        m = tasks[task].get(variant)
        metric = headline_metric(m)
        if metric is None:
            return ""
        if metric.endswith("perplexity"):
            return f"{m[metric]:.2f}"
        err = m.get(f"{metric}_stderr")
        return f"{100 * m[metric]:.1f}" + (f" ± {100 * err:.1f}" if err is not None else "")

    header = ["model", *names]
    body = [[v, *(cell(t, v) for t in names)] for v in rows]
    if fmt == "csv":
        import csv
        import io

        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows([header, *body])
        return buf.getvalue()
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines) + "\n"
