"""The neuron card's "activation on your text" markup: for a known activation vector, each token's chip
has the diverging colour of its value (white at 0, RdBu's red / blue ends at ± the scale, linear in
between, saturated beyond) and its value in the title; the scale is the profile's top |h| when known."""

from __future__ import annotations

from frontend.activation_view import activation_chips, activation_colour, activation_scale, activation_text
from frontend.token_view import contrast_ratio

RESULT = {"kind": "activation", "text": "a b c d e", "tokens": ["a", " b", " c", " d", " e"], "token_ids": [1, 2, 3, 4, 5],
          "layer": 2, "neurons": [7, 9], "activations": [[0.0, 1.0, -0.5, 4.0, None], [0.25, 0.5, 0.0, -0.25, 0.1]],
          "reference": [{"neuron": 7, "top_value": -2.0, "gate_mean": 0.1, "rate": 0.2},
                        {"neuron": 9, "top_value": None, "gate_mean": 0.0, "rate": 0.0}], "timings": {}}


def test_colours_are_diverging_around_zero():
    assert activation_colour(0.0, 2.0) == "rgb(255, 255, 255)"
    assert activation_colour(2.0, 2.0) == "rgb(178, 24, 43)" == activation_colour(9.0, 2.0)  # saturated beyond
    assert activation_colour(-2.0, 2.0) == "rgb(33, 102, 172)"
    assert activation_colour(1.0, 2.0) == "rgb(216, 140, 149)"  # halfway: (255 + 178) / 2 = 216.5, rounded half to even
    assert activation_colour(-1.0, 2.0) == "rgb(144, 178, 214)"
    assert activation_colour(None, 2.0) == "rgb(204, 204, 204)"


def test_chips_carry_each_tokens_value_and_colour():
    chips = activation_chips(RESULT, 0)  # scale: the profile's |top_value| = 2
    assert [c["piece"] for c in chips] == RESULT["tokens"] and [c["value"] for c in chips] == RESULT["activations"][0]
    assert [c["background"] for c in chips] == ["rgb(255, 255, 255)", "rgb(216, 140, 149)", "rgb(200, 217, 234)",
                                                "rgb(178, 24, 43)", "rgb(204, 204, 204)"]
    assert chips[1]["title"] == "' b': h = +1" and chips[2]["title"] == "' c': h = -0.5" and chips[4]["title"] == "' e': h unknown"
    assert all(contrast_ratio(c["background"], c["color"]) >= 4.5 for c in chips)
    # without a profile value the text's own largest |h| (0.5) is the scale
    assert activation_scale(RESULT["activations"][1], RESULT["reference"][1]) == 0.5
    assert activation_chips(RESULT, 1)[1]["background"] == "rgb(178, 24, 43)"


def test_markup_shows_every_token_with_its_title():
    div = activation_text(RESULT, 0)
    note, text = div.children
    assert "neuron 7" in note.children and "|h| = 2" in note.children and "profile's largest" in note.children
    assert [s.children for s in text.children] == RESULT["tokens"]
    assert [s.title for s in text.children] == [c["title"] for c in activation_chips(RESULT, 0)]
    assert text.children[3].style["backgroundColor"] == "rgb(178, 24, 43)"
