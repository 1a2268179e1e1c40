"""The API client turns every failure into a sentence a person can act on."""

from __future__ import annotations

import httpx
import pytest

from moelab.api_client import ApiClient, ApiError


def _client(handler) -> ApiClient:
    return ApiClient(base_url="http://api.test/api/v1", token="", transport=httpx.MockTransport(handler))


def test_detail_of_4xx_is_the_message():
    c = _client(lambda req: httpx.Response(422, json={"detail": "alpha_min (0.8) must not exceed alpha_max (0.5)"}))
    with pytest.raises(ApiError) as err:
        c.allocation_preview("pr-1", alpha_min=0.8, alpha_max=0.5)
    assert err.value.status == 422 and str(err.value) == "alpha_min (0.8) must not exceed alpha_max (0.5)"  # no protocol words


def test_fastapi_validation_list_and_non_json_bodies():
    c = _client(lambda req: httpx.Response(422, json={"detail": [{"loc": ["query", "layer"], "msg": "must be ≥ 0"}]}))
    with pytest.raises(ApiError, match="layer: must be ≥ 0"):
        c.activations("pr-1", layer=-1)
    c = _client(lambda req: httpx.Response(502, text="Bad gateway"))
    with pytest.raises(ApiError, match="HTTP 502: Bad gateway"):
        c.health()


def test_unreachable_api_and_query_building():
    seen = {}

    def handler(req: httpx.Request) -> httpx.Response:
        seen["url"] = str(req.url)
        return httpx.Response(200, json={"sets": []})

    _client(handler).conversion_routing("conv-1", ["ev-a", "ev-b"])
    assert seen["url"] == "http://api.test/api/v1/conversions/conv-1/charts/routing?variant=converted&evaluation_id=ev-a&evaluation_id=ev-b"

    def refuse(req):
        raise httpx.ConnectError("refused")

    with pytest.raises(ApiError, match="not reachable.*moelab serve"):
        _client(refuse).profiles()


def test_delete_cascade_query_and_archive_refusal_before_streaming():
    seen = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append((req.method, str(req.url)))
        if req.url.path.endswith("/archive"):
            return httpx.Response(409, json={"detail": "conversion conv-1 has no artifact: its job job-1 is running"})
        return httpx.Response(200, json={"deleted": [], "cancelled_jobs": [], "artifacts_removed": 0})

    c = _client(handler)
    c.delete("calibration-sets", "cal-1")
    c.delete("calibration-sets", "cal-1", cascade=True)
    assert seen == [("DELETE", "http://api.test/api/v1/calibration-sets/cal-1"),
                    ("DELETE", "http://api.test/api/v1/calibration-sets/cal-1?cascade=true")]
    with pytest.raises(ApiError, match="cannot delete"):
        c.delete("jobs", "job-1")  # a job is cancelled, not deleted
    with pytest.raises(ApiError, match="its job job-1 is running") as err:
        c.archive("conversions", "conv-1")  # refused at once, not as a broken download
    assert err.value.status == 409

    c = _client(lambda req: httpx.Response(200, content=b"PK" + b"x" * 10))
    assert b"".join(c.archive("conversions", "conv-1", chunk=4)) == b"PK" + b"x" * 10
