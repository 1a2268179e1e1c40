"""The neuron card endpoint through HTTP against the profile's own stored files (downloaded
through the artifact endpoint): the numbers it shows are the stored ones, and each snippet is
centred on the stored top token with the tokenizer's text for it."""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest
from safetensors.numpy import load as load_safetensors


def _file(client, profile_id: str, name: str) -> bytes:
    r = client.get(f"/api/v1/artifacts/profiles/{profile_id}/files/{name}")
    assert r.status_code == 200, r.text
    return r.content


@pytest.fixture(scope="module")
def stored(client, profile_id):
    return {
        "neurons": pd.read_parquet(io.BytesIO(_file(client, profile_id, "neurons.parquet"))),
        "tokens": pd.read_parquet(io.BytesIO(_file(client, profile_id, "tokens.parquet"))),
        "samples": pd.read_parquet(io.BytesIO(_file(client, profile_id, "samples.parquet"))),
        "top": load_safetensors(_file(client, profile_id, "top_tokens.safetensors")),
        "stats": load_safetensors(_file(client, profile_id, "stats.safetensors")),
    }


@pytest.mark.parametrize("layer, neuron", [(0, 0), (1, 5), (2, 95)])
def test_card_numbers_are_the_stored_ones(client, profile_id, stored, tiny_llama, layer, neuron):
    from transformers import AutoTokenizer

    card = client.get(f"/api/v1/profiles/{profile_id}/neurons/{layer}/{neuron}")
    assert card.status_code == 200, card.text
    card = card.json()
    row = stored["neurons"].query("layer == @layer and neuron == @neuron").iloc[0]
    assert (card["layer"], card["neuron"], card["d_ffn"], card["cv_basis"]) == (layer, neuron, 96, "task")
    for key in ("cv", "mean", "abs_mean", "std", "rate"):
        assert card[key] == pytest.approx(float(row[key]), rel=1e-6), key
    gm = stored["stats"][f"layers.{layer}.group_means"][:, neuron]
    assert card["group_means"] == pytest.approx(gm.tolist(), rel=1e-6) and len(card["groups"]) == 6

    values, tokens = stored["top"][f"layers.{layer}.value"][neuron], stored["top"][f"layers.{layer}.token"][neuron]
    assert card["top_tokens"] == 8 and [t["token"] for t in card["top"]] == tokens.tolist()
    assert [t["value"] for t in card["top"]] == pytest.approx(values.tolist(), rel=1e-6)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    table, samples = stored["tokens"], stored["samples"]
    for t in card["top"]:
        centre = [s for s in t["snippet"] if s["top"]]
        assert len(centre) == 1 and centre[0]["token"] == t["token"] and centre[0]["value"] == pytest.approx(t["value"])
        stored_row = table.iloc[t["token"]]
        assert (stored_row["sample"], stored_row["position"]) == (t["sample"], t["position"])
        assert centre[0]["piece"] == tok.decode([int(stored_row["token_id"])])  # the stored id's own text
        assert t["task"] == samples.iloc[t["sample"]]["task"]
        # the window: 12 before … 4 after, clipped to the sample, consecutive tokens of that sample
        idx = [s["token"] for s in t["snippet"]]
        n = int(samples.iloc[t["sample"]]["n_tokens"])
        assert idx == list(range(t["token"] - min(12, t["position"]), t["token"] + min(4, n - 1 - t["position"]) + 1))
        ids = table.iloc[idx]["token_id"].tolist()
        assert [s["piece"] for s in t["snippet"]] == [tok.decode([i]) for i in ids]
        if not any("\ufffd" in s["piece"] for s in t["snippet"]):  # a character split over byte-level tokens decodes alone as U+FFFD
            assert "".join(s["piece"] for s in t["snippet"]) == tok.decode(ids)
        # values only at the neuron's top tokens
        for s in t["snippet"]:
            assert (s["value"] is not None) == (s["token"] in tokens.tolist())


def test_card_refusals_name_the_valid_range(client, profile_id):
    base = f"/api/v1/profiles/{profile_id}/neurons"
    r = client.get("/api/v1/profiles/pr-0000000000000000/neurons/0/0")
    assert r.status_code == 404 and "no profile with id 'pr-0000000000000000'" in r.json()["detail"]
    r = client.get(f"{base}/3/0")
    assert r.status_code == 422 and "profile has 3 layers, use 0 … 2 (got 3)" in r.json()["detail"]
    r = client.get(f"{base}/1/96")
    assert r.status_code == 422 and "layer 1 has 96 neurons, use 0 … 95 (got 96)" in r.json()["detail"]
    r = client.get(f"{base}/1/-1")
    assert r.status_code == 422 and "use 0 … 95" in r.json()["detail"]
    assert client.get(f"{base}/1/x").status_code == 422
