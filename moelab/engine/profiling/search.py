"""Neuron search over one stored profile: filters on the per-neuron statistics, set-specificity
against another profile (``compare``) and the text of each neuron's stored top tokens.

"Neurons of layer 5 with CV ≥ 2 that fire on fewer than 1 % of tokens", "neurons specific to the
code set (d ≥ 1.5 against the literature profile)", "neurons whose top tokens contain ``def``":
one vectorised mask over all neurons of the profile, then a sort and a page. numpy and pandas
only (the API runs it in its own process, without torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from .compare import ProfileComparison
    from .store import StoredProfile

SortKey = Literal["cv", "rate", "mean", "abs_mean", "std", "specificity", "layer"]
SORT_KEYS: tuple[str, ...] = ("cv", "rate", "mean", "abs_mean", "std", "specificity", "layer")
MAX_LIMIT = 500
MAX_TOKEN_CHARS = 64


class SearchError(ValueError):
    """A search that cannot be answered as asked; the message says which filter to change and how."""


@dataclass(frozen=True)
class NeuronQuery:
    """Filters (None: not filtered), order and page of a neuron search. Ranges are inclusive."""

    layer: int | None = None
    cv_min: float | None = None
    cv_max: float | None = None
    rate_min: float | None = None
    rate_max: float | None = None
    min_specificity: float | None = None
    max_specificity: float | None = None
    token: str | None = None
    case_sensitive: bool = False
    #: "token": a top token whose text is ``token`` (surrounding spaces aside: " def" is the word def); "substring":
    #: any top token containing it ("def" then finds "default" and "undefined" too)
    match: Literal["token", "substring"] = "token"
    sort: SortKey | None = None  # None: specificity when compared against another profile, else cv
    descending: bool = True
    offset: int = 0
    limit: int = 50

    def sort_key(self, compared: bool) -> str:
        return self.sort or ("specificity" if compared else "cv")

    def check(self, n_layers: int, compared: bool, has_top_tokens: bool) -> None:
        """SearchError naming the filter when the query contradicts itself or the profile."""
        if self.layer is not None and not 0 <= self.layer < n_layers:
            raise SearchError(f"layer: the profile has {n_layers} layers, use 0 … {n_layers - 1} (got {self.layer})")
        for name, lo, hi in (("cv", self.cv_min, self.cv_max), ("rate", self.rate_min, self.rate_max),
                             ("specificity", self.min_specificity, self.max_specificity)):
            if lo is not None and hi is not None and lo > hi:
                raise SearchError(f"{name}: the lower bound ({lo:g}) is above the upper bound ({hi:g}); swap them")
        for name, value in (("rate_min", self.rate_min), ("rate_max", self.rate_max)):
            if value is not None and not 0 <= value <= 1:
                raise SearchError(f"{name}: an activation rate is a fraction of tokens in [0, 1] (got {value:g})")
        wants_vs = self.min_specificity is not None or self.max_specificity is not None or self.sort == "specificity"
        if wants_vs and not compared:
            raise SearchError("specificity needs a second profile to compare with: add vs=<profile id> "
                              "(a profile of the same model on other text)")
        if self.token is not None:
            if not self.token.strip():
                raise SearchError("token: give some text to look for in the neurons' top tokens (got only whitespace)")
            if len(self.token) > MAX_TOKEN_CHARS:
                raise SearchError(f"token: at most {MAX_TOKEN_CHARS} characters (got {len(self.token)})")
            if not has_top_tokens:
                raise SearchError("token: this profile keeps no top tokens (made before them or with top_tokens=0); "
                                  "re-profile to search by token text")
        if self.sort is not None and self.sort not in SORT_KEYS:
            raise SearchError(f"sort: one of {', '.join(SORT_KEYS)} (got {self.sort!r})")
        if not 1 <= self.limit <= MAX_LIMIT:
            raise SearchError(f"limit: 1 … {MAX_LIMIT} results a page (got {self.limit})")
        if self.offset < 0:
            raise SearchError(f"offset: ≥ 0 (got {self.offset})")


@dataclass(frozen=True)
class NeuronTable:
    """Every neuron of a profile as flat arrays in (layer, neuron) order (neurons.parquet's columns)."""

    layer: np.ndarray
    neuron: np.ndarray
    columns: dict[str, np.ndarray]

    @classmethod
    def of(cls, profile: StoredProfile) -> NeuronTable:
        table = profile.neurons.sort_values(["layer", "neuron"], kind="stable")  # written so; the order is what matters
        cols = {c: table[c].to_numpy(dtype=np.float64) for c in ("cv", "rate", "mean", "abs_mean", "std")}
        return cls(table["layer"].to_numpy(dtype=np.int64), table["neuron"].to_numpy(dtype=np.int64), cols)


@dataclass(frozen=True)
class TopTokenIndex:
    """Every neuron's stored top tokens ([neurons, K] global token index, -1 empty; same order as
    ``NeuronTable``) and every calibration token's text: what a token-text filter reads."""

    tokens: np.ndarray
    pieces: pd.Series

    @classmethod
    def of(cls, profile: StoredProfile) -> TopTokenIndex:
        rows = [profile.top_tokens(i)[1] for i in range(profile.n_layers)]
        dtype = np.int32 if len(profile.tokens) < 2**31 else np.int64  # half the memory, kept per profile by the API
        return cls(np.concatenate(rows).astype(dtype), profile.tokens["piece"].astype("string"))

    def matching(self, text: str, case_sensitive: bool, match: str = "token") -> tuple[np.ndarray, np.ndarray]:
        """(per neuron: does any top token match ``text``; per calibration token: does it). ``match``: "token" (the
        token's text, spaces around it aside, is ``text``) or "substring" (it contains ``text``)."""
        if match == "token":
            pieces, want = self.pieces.str.strip(), text.strip()
            if not case_sensitive:
                pieces, want = pieces.str.casefold(), want.casefold()
            hit = (pieces == want).fillna(False).to_numpy(dtype=bool)
        else:
            hit = self.pieces.str.contains(text, case=case_sensitive, regex=False).fillna(False).to_numpy(dtype=bool)
        valid = self.tokens >= 0
        per_slot = np.where(valid, hit[np.where(valid, self.tokens, 0)], False)
        return per_slot.any(axis=1), hit

    def pieces_of(self, row: int, hit: np.ndarray) -> list[str]:
        """The matching top tokens' texts of neuron ``row`` (NeuronTable order), strongest first, each once."""
        out: list[str] = []
        for tok in self.tokens[row].tolist():
            if tok >= 0 and hit[tok]:
                piece = str(self.pieces.iloc[tok])
                if piece not in out:
                    out.append(piece)
        return out


@dataclass
class SearchResult:
    total: int
    sort: str
    items: list[dict[str, Any]]


def _in_range(values: np.ndarray, lo: float | None, hi: float | None) -> np.ndarray:
    keep = np.ones(values.shape, dtype=bool)
    if lo is not None:
        keep &= values >= lo
    if hi is not None:
        keep &= values <= hi
    return keep


def search_neurons(table: NeuronTable, query: NeuronQuery, comparison: ProfileComparison | None = None,
                   top: TopTokenIndex | None = None) -> SearchResult:
    """The page of neurons passing every filter of ``query``, sorted by ``query.sort`` (NaN last), with
    ``total`` the number passing. ``comparison``: this profile as A against the ``vs`` profile as B
    (specificity = its d); ``top``: needed for a token filter. Call ``query.check`` first."""
    d = np.concatenate([lay.d for lay in comparison.layers]).astype(np.float64) if comparison is not None else None
    keep = _in_range(table.columns["cv"], query.cv_min, query.cv_max) & _in_range(table.columns["rate"], query.rate_min, query.rate_max)
    if query.layer is not None:
        keep &= table.layer == query.layer
    if d is not None:
        keep &= _in_range(d, query.min_specificity, query.max_specificity)
    hit = None
    if query.token is not None and top is not None:
        match, hit = top.matching(query.token, query.case_sensitive, query.match)
        keep &= match
    rows = np.flatnonzero(keep)
    key_name = query.sort_key(d is not None)
    key = {"specificity": d, "layer": table.layer.astype(np.float64)}.get(key_name, table.columns.get(key_name))
    values = key[rows]
    signed = -values if query.descending else values
    # NaN last whatever the direction, then (layer, neuron) for equal values: the order is stable across pages
    order = np.lexsort((rows, np.nan_to_num(signed, nan=0.0), np.isnan(values)))
    page = rows[order][query.offset:query.offset + query.limit]
    items = []
    for r in page.tolist():
        item: dict[str, Any] = {"layer": int(table.layer[r]), "neuron": int(table.neuron[r])}
        item |= {c: float(v[r]) for c, v in table.columns.items()}
        item["specificity"] = float(d[r]) if d is not None else None
        item["tokens"] = top.pieces_of(r, hit) if hit is not None and top is not None else None
        items.append(item)
    return SearchResult(total=int(rows.size), sort=key_name, items=items)
