"""The fan-out leader never waits for a layer nobody will build (real Redis, no worker processes).

CI once hung here: the leader was still building its own layers when a helper was killed; by the
time it looked, the helper's presence key had lapsed, so the named-connection check had nothing to
compare against and the leader waited for the helper's layer forever."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest
import redis

from moelab.store import liveness
from moelab.engine.core.params import ConversionError
from moelab.engine.core.partition import LayerExperts, save_layer_experts
from moelab.engine.progress import Progress
from workers.fanout import LayerFanOut, _Claims, _keys, _layer_file

LAYERS = [0, 1, 2, 3]


def _experts(layer: int) -> LayerExperts:
    return LayerExperts(layer=layer, shared=np.arange(2), routed=np.arange(4).reshape(2, 2), top_k=1, router="centroid")


@pytest.fixture
def fanout(redis_url, tmp_path):
    client = redis.Redis.from_url(redis_url)
    prefix = f"moelab-test-{uuid.uuid4().hex[:8]}:"
    leader = LayerFanOut(client, prefix, "job-x", "leader@h", tmp_path / "scratch", spec={}, helpers=0,
                         send_helper=lambda: None)
    yield leader, client, prefix
    leader.close()
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)


def _lead(leader: LayerFanOut, build_one) -> list[LayerExperts]:
    """The leader's whole layer loop, in a daemon thread: a regression hangs there, not the suite."""
    out: dict = {}

    def run() -> None:
        try:
            out["built"] = leader(LAYERS, build_one, Progress())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "the leader is still waiting for a layer nobody builds"
    if "error" in out:
        raise out["error"]
    return out["built"]


def _build_while(action):
    """A ``build_one`` that runs ``action`` before the leader's first own layer (a helper claims meanwhile)."""
    state = {"ran": False}

    def build_one(layer: int) -> LayerExperts:
        if not state["ran"]:
            state["ran"] = True
            action()
        return _experts(layer)

    return build_one


def test_a_helper_whose_presence_lapsed_holding_a_layer_fails_the_job(fanout):
    leader, client, prefix = fanout
    leader.start(LAYERS)

    def helper_claims_then_vanishes():
        liveness.announce(client, prefix, "helper@h", ttl_s=1)
        assert _Claims(client, _keys(prefix, "job-x"), "helper@h").next() is not None
        time.sleep(1.5)  # the helper died and its presence (TTL 1 s) lapsed while the leader built its own layers

    t0 = time.monotonic()
    with pytest.raises(ConversionError, match=r"worker helper@h died while building layer\(s\) 1 .*retry"):
        _lead(leader, _build_while(helper_claims_then_vanishes))
    assert time.monotonic() - t0 < 5


def test_a_live_helper_holding_a_layer_is_waited_for(fanout, redis_url):
    leader, client, prefix = fanout
    leader.start(LAYERS)
    presence = liveness.client_for(redis_url, name=liveness.connection_name(prefix, "helper@h"))
    presence.ping()  # the helper's named connection is open: it is alive
    claimed: list[int] = []

    def helper_claims_and_builds():
        liveness.announce(client, prefix, "helper@h", ttl_s=5)
        claimed.append(_Claims(client, _keys(prefix, "job-x"), "helper@h").next())
        save_layer_experts(_experts(claimed[0]), _layer_file(leader.scratch, claimed[0]))

    built = _lead(leader, _build_while(helper_claims_and_builds))
    presence.close()
    assert [e.layer for e in built] == LAYERS and claimed == [1]


def test_layers_the_broker_lost_fail_the_job_instead_of_hanging(fanout):
    leader, client, prefix = fanout
    leader.start(LAYERS)

    def redis_loses_the_keys():
        client.delete(*_keys(prefix, "job-x").values())  # e.g. a Redis restart without persistence

    with pytest.raises(ConversionError, match=r"layer\(s\) 1, 2, 3 .* neither built, queued nor held"):
        _lead(leader, _build_while(redis_loses_the_keys))


def test_a_layer_claimed_while_the_leader_looks_is_never_called_lost(fanout, redis_url):
    """A claim moves a layer from the queue to the owners in one step; the leader reads both in one
    transaction too. (CI once failed a browser test's conversion: the leader read the owners, a helper
    claimed a layer, then the leader read the queue and saw the layer in neither.)"""
    leader, client, prefix = fanout
    layers = list(range(400))
    leader.start(layers)
    presence = liveness.client_for(redis_url, name=liveness.connection_name(prefix, "helper@h"))
    presence.ping()
    liveness.announce(client, prefix, "helper@h", ttl_s=30)
    claims = _Claims(redis.Redis.from_url(redis_url), _keys(prefix, "job-x"), "helper@h")

    def helper() -> None:
        while (layer := claims.next()) is not None:
            save_layer_experts(_experts(layer), _layer_file(leader.scratch, layer))

    thread = threading.Thread(target=helper, daemon=True)
    thread.start()
    checks = 0
    while thread.is_alive():
        leader._check_helpers(layers)  # raises "neither built, queued nor held" on a torn read
        checks += 1
    presence.close()
    assert checks > 10
