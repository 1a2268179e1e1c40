"""The README is a front door (at most 150 lines) and every relative link in it and in docs/ resolves.

A link is ``[text](target)`` (images too), a reference definition ``[label]: target``, or an HTML
``href``/``src`` attribute, outside code blocks and code spans. External targets (``http:``,
``https:``, ``mailto:``) are skipped; any other target is a path relative to the file that holds
it and must exist. A ``#fragment`` (same page, or into a Markdown file) must name one of that
file's headings, slugged as GitHub does (lowercase, punctuation removed except ``-``
and ``_``, spaces to ``-``, ``-1``, ``-2`` … on repeats).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 150

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"  # [text], one level of nested brackets allowed
    r"\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"  # (target: <…> or balanced parentheses
    r"(?:\s+[\"'(][^)]*)?\s*\)"  # optional "title")
)
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.M)
HTML_ATTR = re.compile(r"<[a-zA-Z][^>]*?\s(?:href|src)\s*=\s*[\"']([^\"']*)[\"']", re.S)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ftp: …


def strip_code(markdown: str) -> str:
    """The text without fenced code blocks and code spans: a link inside code is not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", markdown))


def link_targets(markdown: str) -> list[str]:
    """Every link target in a Markdown text, in order (angle brackets removed)."""
    text = strip_code(markdown)
    found = [m.group(1) for m in INLINE_LINK.finditer(text)]
    found += [m.group(1) for m in REFERENCE_DEF.finditer(text)]
    found += [m.group(1) for m in HTML_ATTR.finditer(text)]
    return [t[1:-1] if t.startswith("<") and t.endswith(">") else t for t in found]


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: inline links reduced to their text, lowercase, everything but
    letters, digits, ``_``, ``-`` and spaces removed, spaces turned into ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in "_- ")
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """The anchors of every heading of a Markdown text (repeats numbered as GitHub does)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for m in HEADING.finditer(FENCE.sub("", markdown)):
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _shown(path: Path) -> str:
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


def broken_links(path: Path) -> list[str]:
    """What is wrong with the relative links of one Markdown file (empty when every one resolves)."""
    problems = []
    text = path.read_text(encoding="utf-8")
    for target in link_targets(text):
        if not target or EXTERNAL.match(target):
            continue
        if target.startswith("#"):  # an anchor on the same page
            if unquote(target[1:]).lower() not in anchors(text):
                problems.append(f"{_shown(path)}: {target} -> no such heading on this page")
            continue
        file_part, _, fragment = target.partition("#")
        resolved = (path.parent / unquote(file_part)).resolve()
        if not resolved.exists():
            problems.append(f"{_shown(path)}: {target} -> {_shown(resolved)} does not exist")
            continue
        if fragment and resolved.suffix == ".md" and resolved.is_file():
            if unquote(fragment).lower() not in anchors(resolved.read_text(encoding="utf-8")):
                problems.append(f"{_shown(path)}: {target} -> no heading '#{fragment}' in {_shown(resolved)}")
    return problems


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def test_docs_exist_and_readme_links_them():
    assert DOCS.is_dir() and (DOCS / "README.md").is_file(), "docs/ and its index docs/README.md are the reference"
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in link_targets(README.read_text(encoding="utf-8"))
              if t and not t.startswith("#") and not EXTERNAL.match(t)}
    unlinked = [p.relative_to(REPO).as_posix() for p in sorted(DOCS.rglob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_readme_is_a_front_door():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; the reference belongs in docs/"
    # .ci/run runs "exactly the README's test command", and scripts/run.sh is the documented way in.
    text = "\n".join(lines)
    assert "bash scripts/run.sh" in text and "bash scripts/test.sh" in text


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(path: Path):
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_checker_catches_broken_links(tmp_path: Path):
    """The parser finds every kind of link, skips code, and a missing file or heading is reported."""
    sample = (
        "# Title\n\n## Two words, here (too)\n\nSee [a](other.md), [b](missing.md#x), ![c](img.svg \"title\"),\n"
        "[d](other.md#no-such-heading), [e](other.md#second-part), [f](#local), [g](https://example.com/x),\n"
        "[i](#two-words-here-too), "
        "<a href=\"gone/dir/\">h</a>, `[not](a-link.md)`.\n\n[ref]: ./also-missing.txt\n\n"
        "```\n[inside](a/code/block.md)\n```\n"
    )
    assert link_targets(sample) == ["other.md", "missing.md#x", "img.svg", "other.md#no-such-heading",
                                    "other.md#second-part", "#local", "https://example.com/x", "#two-words-here-too",
                                    "./also-missing.txt", "gone/dir/"]
    assert "two-words-here-too" in anchors(sample)
    assert github_slug("MIDAS (MI §3.2, Alg. 1)") == "midas-mi-32-alg-1"
    assert github_slug("Recovery fine-tuning (`moelab finetune`)") == "recovery-fine-tuning-moelab-finetune"
    assert anchors("# A\n## A\n") == {"a", "a-1"}

    (tmp_path / "other.md").write_text("# Other\n\n## Second part\n", encoding="utf-8")
    (tmp_path / "img.svg").write_text("<svg/>", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(sample, encoding="utf-8")
    problems = broken_links(page)
    assert len(problems) == 5, problems
    assert any("#local" in p for p in problems)
    assert any("missing.md#x" in p for p in problems)
    assert any("no-such-heading" in p for p in problems)
    assert any("also-missing.txt" in p for p in problems)
    assert any("gone/dir/" in p for p in problems)
    assert not any("second-part" in p or "img.svg" in p or "https" in p or "two-words" in p for p in problems)


def test_every_setting_is_documented():
    """docs/settings.md names every MOELAB_ variable moelab/settings.py reads."""
    from moelab.settings import Settings

    text = (DOCS / "settings.md").read_text(encoding="utf-8")
    missing = [f"MOELAB_{name.upper()}" for name in Settings.model_fields if f"`MOELAB_{name.upper()}`" not in text]
    assert not missing, f"settings missing from docs/settings.md: {missing}"
