"""What the layer-similarity page says is what a Dense2MoE conversion does: its outline, its
sentence and its designer link follow the engine's ``choose_fusion`` for the page's δ, n*, l*.

The page's callback runs against an API answering through the real route code
(``layer_similarity_payload``: the generated Dense2MoE parameter model, the engine's preview) on a
profile's S_L / S_M; no server, no browser (tests/frontend/test_browser.py covers those).
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

import httpx
import numpy as np
import pytest

import frontend.app  # noqa: F401  (instantiates the Dash app: the page modules register with it)
from backend.routes.charts import layer_similarity_payload
from backend.schemas import METHOD_PARAMS
from moelab.api_client import ApiClient
from frontend.pages import designer, layers as page
from moelab.engine.methods import REGISTRY
from moelab.engine.methods.dense2moe import Dense2MoEParams, choose_fusion

PROFILE = "pr-0123456789abcdef"


def similarities(L: int = 12, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Like a real model's: similarity falls with the span, MLP inputs faster than outputs, some noise."""
    rng = np.random.default_rng(seed)
    n = np.abs(np.subtract.outer(np.arange(L), np.arange(L)))
    s_l = 1 - 0.02 * n - rng.uniform(0, 0.02, (L, L))
    s_m = 1 - 0.05 * n - rng.uniform(0, 0.04, (L, L))
    s_l, s_m = (s_l + s_l.T) / 2, (s_m + s_m.T) / 2
    np.fill_diagonal(s_l, 1.0)
    np.fill_diagonal(s_m, 1.0)
    return s_l, s_m


S_L, S_M = similarities()


class Profile:
    manifest = {"n_layers": len(S_L), "d_ffn": [96] * len(S_L)}
    path = PROFILE

    def similarity(self, kind: str) -> np.ndarray:
        return {"outputs": S_L, "mlp_inputs": S_M}[kind]


def handler(request: httpx.Request) -> httpx.Response:
    path = request.url.path
    if path.endswith("/methods"):
        return httpx.Response(200, json={"items": [m.describe() for m in REGISTRY.values()]})
    if path.endswith(("/profiles", "/models")):
        return httpx.Response(200, json={"items": [{"id": PROFILE, "status": "ready", "name": "p"}]})
    if path == f"/api/v1/profiles/{PROFILE}/charts/layer-similarity":
        query = METHOD_PARAMS["dense2moe"].model_validate(dict(request.url.params))
        return httpx.Response(200, json=layer_similarity_payload(PROFILE, Profile(), query).model_dump(mode="json"))
    return httpx.Response(404, json={"detail": f"no route {path}"})


@pytest.fixture(autouse=True)
def fake_api(monkeypatch):
    client = ApiClient(base_url="http://api.test/api/v1", token="", transport=httpx.MockTransport(handler))
    for module in (page, designer):
        monkeypatch.setattr(module, "api", lambda: client)
    monkeypatch.setattr("moelab.api_client.api", lambda: client)  # profile_picker imports it at call time
    return client


def outlined(fig) -> tuple[int, int] | None:
    """(first, last) layer of the outlined block and checks the marked cell is its corner pair."""
    shapes = {s.name: s for s in fig.layout.shapes}
    if not shapes:
        return None
    block, pair = shapes["fusion"], shapes["fusion-pair"]
    lo, hi = round(block.x0 + 0.5), round(block.x1 - 0.5)
    assert (block.y0, block.y1) == (block.x0, block.x1)
    assert (pair.x0, pair.x1, pair.y0, pair.y1) == (hi - 0.5, hi + 0.5, lo - 0.5, lo + 0.5)
    return lo, hi


def components(node):
    """Every Dash component of a layout tree."""
    yield node
    kids = getattr(node, "children", None)
    for child in kids if isinstance(kids, (list, tuple)) else [kids]:
        if child is not None and not isinstance(child, (str, int, float)):
            yield from components(child)


def designer_params(href: str) -> Dense2MoEParams:
    """The Dense2MoE parameters the designer's controls hold when opened at ``href`` (its own URL parsing)."""
    url = urlparse(href)
    assert url.path == "/designer"
    tree = designer.layout(**{k: v[-1] for k, v in parse_qs(url.query).items()})
    by_id = {str(c.id): c for c in components(tree) if getattr(c, "id", None) is not None}
    assert by_id[f"{designer.N}-method"].value == "dense2moe"
    values = {c.id["name"]: c.value for c in components(tree)
              if isinstance(getattr(c, "id", None), dict) and c.id.get("type") == designer.PARAM and c.id["method"] == "dense2moe"}
    return Dense2MoEParams(**values)


@pytest.mark.parametrize("delta,n_fused,layer", [(0.3, 5, None), (0.25, 3, None), (0.1, 0, None), (0.5, 0, None),
                                                   (0.3, 4, 2), (0.35, 5, 6)])
def test_the_outline_is_the_engines_choice(delta, n_fused, layer):
    sl, sm, _, _, text, error, search, href = page._update(PROFILE, delta, n_fused, layer)
    fixed_n = n_fused or None
    expected = choose_fusion(S_L, S_M, delta, Dense2MoEParams().max_fused, layer, fixed_n)
    lo, hi = expected.layer, expected.layer + expected.n_fused
    assert outlined(sl) == outlined(sm) == (lo, hi)
    pruned = f"blocks {lo + 1}–{hi}" if hi > lo + 1 else f"block {hi}"
    assert f"fuses {pruned} into block {lo} (l* = {lo}, n* = {hi - lo}" in text
    assert f"S_L[{lo}, {hi}] = {expected.s_layer:.4f}" in text
    if layer is None or fixed_n is None:
        assert f"ranked {expected.rank + 1} of {len(expected.candidates)} spans" in text
        assert f"{1 - expected.s_mlp:.4f} < δ = {delta:g}" in text
    assert not error.children
    # the designer opened from the link holds the same parameters, so its preview is this fusion
    params = designer_params(href)
    assert (params.delta, params.n_fused, params.layer) == (delta, n_fused, layer)
    plan = REGISTRY["dense2moe"].preview(Profile(), params)["fusion"]
    assert (plan["layer"], plan["n_fused"]) == (expected.layer, expected.n_fused)
    assert parse_qs(search.lstrip("?"))["delta"] == [str(delta)]


def test_the_choices_differ_so_the_comparison_means_something():
    picks = {(d, n): page._update(PROFILE, d, n, None)[0] for d, n in [(0.3, 5), (0.1, 0), (0.25, 3)]}
    assert len({outlined(f) for f in picks.values()}) == 3


def test_defaults_are_the_engines_and_refusals_are_said_in_words():
    tree = page.layout(profile=PROFILE)
    found = {c.id.split("-", 1)[1]: c.value for c in components(tree)
             if getattr(c, "id", None) in (f"{page.N}-delta", f"{page.N}-n_fused", f"{page.N}-layer")}
    d = Dense2MoEParams()
    assert found == {"delta": d.delta, "n_fused": d.n_fused, "layer": d.layer}
    # δ below every 5-block span's MLP-input distance: nothing is outlined, the refusal says which δ would admit one
    sl, sm, _, _, text, error, _, href = page._update(PROFILE, 0.01, 5, None)
    assert outlined(sl) is None and outlined(sm) is None
    assert "would admit it" in error.children and "spans of fewer blocks than n_fused=5" in error.children
    assert "Nothing outlined" in text and "refused" in text
    assert "method=dense2moe" in href and "delta=0.01" in href
