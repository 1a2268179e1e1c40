"""A conversion's per-layer work shared with idle workers.

Given a profile, each layer's experts (clustering, router) are independent of the other layers'
(``core.slicing.partition_layers``), so the worker running a conversion job (the *leader*) lets
every other live worker build some of them:

1. it publishes the layers to build in Redis (a list, ``todo``) with what a helper needs to
   build one (``spec``: profile, parameters, model) and sends one ``moelab.convert_layers``
   message per other live worker to the ``gpu`` queue;
2. every participant, the leader included, takes layers off the list (a Lua ``LPOP`` + owner
   record: each layer is built once, and who holds it is known) and writes each result to
   ``layer-<i>.safetensors`` in a temporary sibling of the conversion's directory (atomically);
3. once the list is empty the leader waits for the files of the layers others hold, then loads
   them in layer order and goes on as in a single-process conversion (fitting, slicing, export):
   the export is the same whichever worker built which layer.

With one worker the leader builds every layer itself; a helper message that runs after the
conversion ended finds no ``spec`` and does nothing. A helper that fails a layer records why and
the leader fails the job with it; a helper process that dies holding a layer (its named broker
connection closed, ``moelab.store.liveness``) fails the job naming the layer and the worker
within seconds. The leader's own progress step is where a cancel lands; removing the keys then
tells helpers to stop after their current layer.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from moelab.store import liveness
from moelab.engine.atomic import temporary_sibling
from moelab.engine.core.params import ConversionError
from moelab.engine.core.partition import LayerExperts, load_layer_experts, save_layer_experts
from moelab.engine.progress import Progress

log = logging.getLogger("moelab.worker")

KEY_TTL_S = 86_400  # keys of a leader that died unnoticed do not stay forever
POLL_S = 0.2

#: pop the next layer and record its owner in one step (a helper dying in between would orphan it)
_CLAIM = """
local layer = redis.call('LPOP', KEYS[1])
if layer then redis.call('HSET', KEYS[2], layer, ARGV[1]) end
return layer
"""


def _keys(prefix: str, job_id: str) -> dict[str, str]:
    base = f"{prefix}fanout:{job_id}:"
    return {name: base + name for name in ("spec", "todo", "owner", "error")}


def scratch_dir(conversions_root: Path, conversion_id: str) -> Path:
    """Where the layers of one conversion are collected: a temporary sibling of the conversion owned
    by this (the leader's) process, so a start-up cleanup removes it once the leader is gone."""
    return temporary_sibling(conversions_root / conversion_id, "layers")


def _layer_file(scratch: Path, layer: int) -> Path:
    return scratch / f"layer-{layer}.safetensors"


class _Claims:
    def __init__(self, client: redis.Redis, keys: dict[str, str], worker: str) -> None:
        self.client, self.keys, self.worker = client, keys, worker
        self._claim = client.register_script(_CLAIM)

    def next(self) -> int | None:
        raw = self._claim(keys=[self.keys["todo"], self.keys["owner"]], args=[self.worker])
        return None if raw is None else int(raw)


class LayerFanOut:
    """A ``core.slicing.LayerMap`` that shares the layers with ``helpers`` other workers.

    ``spec``: what a helper needs (``profile`` path, ``params`` dict, model ``source``,
    ``trust_remote_code``); ``send_helper()`` queues one ``moelab.convert_layers`` message.
    """

    def __init__(self, client: redis.Redis, prefix: str, job_id: str, worker: str, scratch: Path,
                 spec: dict[str, Any], helpers: int, send_helper: Callable[[], None]) -> None:
        self.client, self.prefix, self.job_id, self.worker = client, prefix, job_id, worker
        self.keys = _keys(prefix, job_id)
        self.scratch, self.spec, self.helpers, self.send_helper = scratch, spec, helpers, send_helper
        self.layers: list[int] | None = None  # published by ``start``

    def __enter__(self) -> "LayerFanOut":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self, layers: list[int]) -> None:
        """Publish the layers and call the helpers. The job does it before it loads its own model,
        so helpers (whose model is usually cached) build layers while the leader is still loading."""
        if self.layers == layers:
            return
        self.layers = list(layers)
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.scratch.mkdir(parents=True)
        self._publish(layers)
        for _ in range(min(self.helpers, len(layers) - 1)):
            self.send_helper()

    def close(self) -> None:
        """Withdraw the layers (helpers stop after their current one) and remove the scratch files."""
        self.client.delete(*self.keys.values())
        shutil.rmtree(self.scratch, ignore_errors=True)

    def __call__(self, layers: list[int], build_one: Callable[[int], LayerExperts], progress: Progress) -> list[LayerExperts]:
        self.start(layers)
        total = len(layers)
        try:
            claims = _Claims(self.client, self.keys, self.worker)
            progress.update("cluster experts", 0, total)
            while (layer := claims.next()) is not None:
                save_layer_experts(build_one(layer), _layer_file(self.scratch, layer))
                self._check_helpers(layers)  # between own layers too: a dead helper fails the job early
                progress.update("cluster experts", self._done(layers), total)
            while (done := self._done(layers)) < total:  # layers other workers hold
                self._check_helpers(layers)
                progress.update("cluster experts", done, total)  # a cancel lands here too
                time.sleep(POLL_S)
            self._check_helpers(layers)
            built_by = {int(k): v.decode() for k, v in self.client.hgetall(self.keys["owner"]).items()}
            helped = sorted({w for w in built_by.values() if w != self.worker})
            if helped:
                log.info("conversion job %s: %d of %d layers built by %s", self.job_id,
                         sum(w != self.worker for w in built_by.values()), total, ", ".join(helped))
            return [load_layer_experts(_layer_file(self.scratch, i)) for i in layers]
        finally:
            self.close()

    def _publish(self, layers: list[int]) -> None:
        pipe = self.client.pipeline()
        pipe.delete(*self.keys.values())
        pipe.set(self.keys["spec"], json.dumps({**self.spec, "scratch": str(self.scratch)}), ex=KEY_TTL_S)
        pipe.rpush(self.keys["todo"], *layers)
        pipe.expire(self.keys["todo"], KEY_TTL_S)
        pipe.execute()

    def _done(self, layers: list[int]) -> int:
        return sum(_layer_file(self.scratch, i).is_file() for i in layers)

    def _check_helpers(self, layers: list[int]) -> None:
        """Raise with the reason when a helper failed a layer, or when a layer not built yet has no
        live worker building it: its holder died (named connection closed), its holder stopped
        announcing itself (a death the leader, busy with its own layers, noticed only after the
        presence key lapsed), or nobody holds it and it is not queued (Redis lost the keys)."""
        error = self.client.get(self.keys["error"])
        if error:
            raise ConversionError(error.decode())
        # Files first, then the queue and the owners in one transaction: a claim moves a layer from the
        # queue to the owners atomically, so reading the two apart could see it in neither ("lost").
        missing = [i for i in layers if not _layer_file(self.scratch, i).is_file()]
        pipe = self.client.pipeline(transaction=True)
        pipe.lrange(self.keys["todo"], 0, -1)
        pipe.hgetall(self.keys["owner"])
        todo, owned = pipe.execute()
        queued = {int(v) for v in todo}
        owners = {int(k): v.decode() for k, v in owned.items()}
        retry = f"re-run the job with POST /api/v1/jobs/{self.job_id}/retry"
        lost = [i for i in missing if i not in owners and i not in queued]
        if lost:
            raise ConversionError(f"layer(s) {', '.join(map(str, lost))} of this conversion are neither built, queued nor "
                                  f"held by a worker (the broker lost the conversion's keys, e.g. Redis restarted); {retry}")
        holders = {owners[i] for i in missing if i in owners and owners[i] != self.worker}
        present = set(liveness.alive(self.client, self.prefix))
        dead = {w for w in holders if w not in present} | liveness.dead_workers(self.client, self.prefix, holders)
        if dead:
            held = sorted(i for i in missing if owners.get(i) in dead)
            raise ConversionError(
                f"worker {', '.join(sorted(dead))} died while building layer(s) {', '.join(map(str, held))} of this "
                f"conversion (killed, out of memory or crashed; its log says which); {retry}"
            )

def help_build_layers(client: redis.Redis, prefix: str, job_id: str, worker: str,
                      load_dense: Callable[[dict[str, Any]], Any]) -> int:
    """A helper's side: build layers of conversion job ``job_id`` until none is left; returns how
    many it built. ``load_dense(spec)``: the dense model (the worker's model cache)."""
    from moelab.engine.core.slicing import build_one_layer
    from moelab.engine.methods import get_method, params_from_dict
    from moelab.engine.profiling.store import StoredProfile

    keys = _keys(prefix, job_id)
    raw = client.get(keys["spec"])
    if raw is None or not client.llen(keys["todo"]):
        return 0  # the conversion ended, or others took every layer: nothing to do
    spec = json.loads(raw)
    params = params_from_dict(spec["params"])
    plan_for, layer_builder = get_method(params.method).partition  # type: ignore[attr-defined, misc]
    profile = StoredProfile.open(spec["profile"])
    # Load before claiming: the leader never waits for a helper's model load, only for its layers.
    build_one = build_one_layer(load_dense(spec), plan_for(profile, params), layer_builder(profile, params))
    claims = _Claims(client, keys, worker)
    built = 0
    scratch = Path(spec["scratch"])
    while (layer := claims.next()) is not None:
        try:
            experts = build_one(layer)
            if not scratch.is_dir():  # the leader gave up (cancelled, failed) meanwhile
                return built
            save_layer_experts(experts, _layer_file(scratch, layer))
        except Exception as exc:
            if not scratch.is_dir():
                return built  # the leader ended while this layer was built: nobody waits for it
            client.set(keys["error"], f"layer {layer} failed on worker {worker}: {type(exc).__name__}: {exc}", ex=KEY_TTL_S)
            raise
        built += 1
    return built
