"""A worker's death read from the broker: its named Redis connection closes with its process.
Real Redis (the service tests' DB and a prefix of its own); no worker process needed."""

from __future__ import annotations

import time
import uuid

import redis

from moelab.store import liveness


def test_a_closed_named_connection_is_a_dead_worker_once_confirmed(redis_url):
    prefix = f"liveness-test-{uuid.uuid4().hex[:6]}:"
    observer = redis.Redis.from_url(redis_url)
    worker = liveness.client_for(redis_url, name=liveness.connection_name(prefix, "w1@host"))
    try:
        liveness.announce(worker, prefix, "w1@host", ttl_s=30)
        observer.set(f"{prefix}workers:old@host", str(time.time()), px=30_000)  # an older worker: a bare timestamp
        assert liveness.dead_workers(observer, prefix, {"w1@host", "old@host", "never@host"}) == set()

        worker.connection_pool.disconnect()  # what the kernel does to a killed process's sockets
        assert liveness.dead_workers(observer, prefix, {"w1@host"}) == set()  # first look: not yet confirmed
        time.sleep(liveness.CONFIRM_S)
        assert liveness.dead_workers(observer, prefix, {"w1@host", "old@host", "never@host"}) == {"w1@host"}

        liveness.announce(worker, prefix, "w1@host", ttl_s=30)  # back (reconnected, name set again): alive
        assert liveness.dead_workers(observer, prefix, {"w1@host"}) == set()
    finally:
        for key in observer.scan_iter(f"{prefix}*"):
            observer.delete(key)
        worker.close()
