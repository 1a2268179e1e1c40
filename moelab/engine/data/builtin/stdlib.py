"""Python standard library: code (``builtin:code``) and prose from its docstrings (``builtin:prose``).

Both share their unit key (``stdlib:<top-level module>``): a module is held out for both, because
stdlib code contains its own docstrings."""

from __future__ import annotations

import ast
import functools
import os
import random
import sysconfig
from pathlib import Path
from typing import Iterator

from ..sets import Sample, chunk_text
from .packing import MAX_CHARS, MIN_CHARS, TARGET_CHARS, Built, Units, _round_robin_generators, _trim, unit_split

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
