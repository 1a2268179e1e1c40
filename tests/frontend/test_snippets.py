"""Neuron-card rendering (pure functions of the card JSON): which tokens are highlighted, with
which colour and value, and the per-task bars."""

from __future__ import annotations

import pytest

from frontend import figures as F
from frontend import snippets as S

CARD = {
    "profile_id": "pr-1", "layer": 1, "neuron": 7, "d_ffn": 96, "cv": 0.8123, "cv_basis": "task", "mean": 0.01, "abs_mean": 0.01,
    "std": 0.0081, "rate": 0.125, "groups": ["code", "math"], "group_means": [0.02, None], "top_tokens": 2,
    "note": "top 2 tokens by |h|",
    "top": [
        {"rank": 0, "token": 5, "sample": 0, "position": 5, "value": 2.0, "task": "code", "domain": None, "group": "code",
         "snippet": [{"token": 4, "position": 4, "piece": "def", "value": None, "top": False},
                     {"token": 5, "position": 5, "piece": " f", "value": 2.0, "top": True},
                     {"token": 6, "position": 6, "piece": "\n", "value": -1.0, "top": False}]},
        {"rank": 1, "token": 6, "sample": 0, "position": 6, "value": -1.0, "task": "code", "domain": None, "group": "code",
         "snippet": [{"token": 6, "position": 6, "piece": "\n", "value": -1.0, "top": True}]},
    ],
}


def _spans(component):
    return [c for c in component.children if getattr(c, "className", "").startswith("tok")]


def test_only_known_tokens_are_highlighted_with_value_and_sign_colour():
    first = S.snippet(CARD["top"][0], scale=2.0, label="layer 1 · neuron 7")
    head, text = first.children
    assert "#1 · h = 2 · code" in head.children
    plain, centre, other = _spans(text)
    assert plain.className == "tok" and not getattr(plain, "title", None)
    assert centre.className == "tok hl centre" and centre.children == " f"
    assert centre.title.startswith("layer 1 · neuron 7: h = 2 ") and getattr(centre, "data-value") == "2.0"
    assert centre.style["backgroundColor"] == "rgba(220, 38, 38, 0.900)"  # positive, full strength
    assert other.style["backgroundColor"] == "rgba(37, 99, 235, 0.525)"  # negative, half of max |h|
    assert other.children == "⏎ "


def test_card_without_top_tokens_says_why_and_stats_line():
    old = {**CARD, "top": [], "top_tokens": 0, "note": "profile predates top tokens (or was made with top_tokens=0): re-profile to see them"}
    assert "re-profile" in S.snippets(old).children
    assert len(S.snippets(CARD).children) == 3
    assert S.card_title(CARD) == "layer 1 · neuron 7"
    stats = S.card_stats(CARD)
    assert "CV 0.8123 across tasks" in stats and "among a token's top-K |h| on 12.5% of tokens" in stats
    assert "mean gate activation act(x·W_gate) " in stats and "snippets show h = act(x·W_gate)·(x·W_up)" in stats  # which is which


def test_card_profile_bars_are_the_group_means():
    fig = F.neuron_card_profile(CARD)
    assert list(fig.data[0].x) == ["code", "math"]
    assert fig.data[0].y[0] == pytest.approx(0.02) and fig.data[0].y[1] != fig.data[0].y[1]  # None → NaN, no bar
    assert "Per-task profile: layer 1 · neuron 7" in fig.layout.title.text
