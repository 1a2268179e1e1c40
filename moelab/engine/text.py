"""Text every store can keep: what a JSON parser accepts is wider than what SQL, parquet or UTF-8 files hold.

Two things a JSON string may carry that a store refuses later (a late failure instead of a clear refusal):

* a NUL character (``\\u0000``): PostgreSQL's text and JSONB columns reject it;
* a lone UTF-16 surrogate (``\\ud800`` escaped without its pair): not a Unicode scalar, so it cannot be
  encoded as UTF-8 (hashing, SQLite, parquet and every file write fail on it).
"""

from __future__ import annotations

from typing import Any


def text_problem(value: str) -> str | None:
    """What makes ``value`` unstorable, in words with the position, or None when it is fine."""
    at = value.find("\x00")
    if at >= 0:
        return f"holds a NUL character (\\u0000) at position {at}; remove it"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"holds a lone UTF-16 surrogate (\\u{ord(value[exc.start]):04x}) at position {exc.start}, which is not "
                "Unicode text; remove it or give the full pair")
    return None


def first_text_problem(value: Any, where: str = "") -> str | None:
    """The first string anywhere in ``value`` (dict keys and values, lists) that :func:`text_problem`
    refuses, as ``'field.path: why'``; None when every string is storable."""
    if isinstance(value, str):
        problem = text_problem(value)
        return f"{where or 'value'}: {problem}" if problem else None
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            found = first_text_problem(key, path) if isinstance(key, str) else None
            found = found or first_text_problem(item, path)
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = first_text_problem(item, f"{where}[{i}]" if where else f"[{i}]")
            if found:
                return found
    return None
