"""Worker presence in Redis: each worker refreshes a key with a TTL; the API lists them.

This answers "is any worker running?" (jobs stay queued without one); job liveness itself is
the job row's heartbeat, because the SQL store is the record of job state.
"""

from __future__ import annotations

import time

import redis


def _key(prefix: str, worker: str = "*") -> str:
    return f"{prefix}workers:{worker}"


def announce(client: redis.Redis, prefix: str, worker: str, ttl_s: float) -> None:
    client.set(_key(prefix, worker), str(time.time()), px=max(1000, int(ttl_s * 1000)))


def withdraw(client: redis.Redis, prefix: str, worker: str) -> None:
    client.delete(_key(prefix, worker))


def alive(client: redis.Redis, prefix: str) -> list[str]:
    strip = len(_key(prefix, ""))
    return sorted(k.decode()[strip:] if isinstance(k, bytes) else k[strip:] for k in client.scan_iter(_key(prefix), count=100))


def client_for(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
