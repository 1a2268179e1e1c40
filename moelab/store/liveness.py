"""Worker presence in Redis: each worker refreshes a key with a TTL; the API lists them.

This answers "is any worker running?" (jobs stay queued without one); job liveness itself is
the job row's heartbeat, because the SQL store is the record of job state.

It also tells, within seconds, that a worker *process* died (killed, out of memory, crashed)
even when nothing supervises it: the worker keeps a Redis connection named after itself
(``CLIENT SETNAME``), and the kernel closes that socket the moment the process ends, whatever
state its threads were in. A worker whose presence key still stands (it announced itself less
than its TTL ago) but whose named connection is gone is dead: :func:`dead_workers`. A worker
stalled in a long C call keeps its socket, so a stall is never mistaken for a death; a worker
on a partitioned host keeps it too, and falls to the heartbeat timeout. Right after Redis
restarts every connection is gone, so nothing is concluded until the workers had time to
reconnect (``MIN_UPTIME_S``), and a connection must be missing on two looks ``CONFIRM_S`` apart
(a worker reconnecting after a network blip is not dead).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable

import redis

#: how often a worker refreshes its presence (and so reconnects its named connection after a Redis restart)
ANNOUNCE_S = 1.0
MIN_UPTIME_S = 5.0
CONFIRM_S = 1.0

#: connection name -> monotonic time it was first seen missing (per process: the API's, a worker's)
_missing_since: dict[str, float] = {}


def _key(prefix: str, worker: str = "*") -> str:
    return f"{prefix}workers:{worker}"


def connection_name(prefix: str, worker: str) -> str:
    """The Redis client name of a worker's presence connection (no spaces: CLIENT SETNAME refuses them)."""
    return f"{prefix}worker:{worker}".replace(" ", "_")


def announce(client: redis.Redis, prefix: str, worker: str, ttl_s: float) -> None:
    value = {"at": time.time(), "connection": connection_name(prefix, worker)}
    client.set(_key(prefix, worker), json.dumps(value), px=max(1000, int(ttl_s * 1000)))


def last_announced(client: redis.Redis, prefix: str, worker: str) -> float | None:
    """When ``worker`` last announced itself (epoch seconds), or None (never, or longer ago than its TTL)."""
    raw = client.get(_key(prefix, worker))
    try:
        return float(json.loads(raw)["at"]) if raw else None
    except (ValueError, KeyError, TypeError):
        return None


def withdraw(client: redis.Redis, prefix: str, worker: str) -> None:
    client.delete(_key(prefix, worker))


def alive(client: redis.Redis, prefix: str) -> list[str]:
    strip = len(_key(prefix, ""))
    return sorted(k.decode()[strip:] if isinstance(k, bytes) else k[strip:] for k in client.scan_iter(_key(prefix), count=100))


def dead_workers(client: redis.Redis, prefix: str, workers: Iterable[str]) -> set[str]:
    """Those of ``workers`` that announced a named connection which Redis no longer has."""
    workers = set(workers)
    if not workers:
        return set()
    try:
        if int(client.info("server").get("uptime_in_seconds", 0)) < MIN_UPTIME_S:
            return set()
        connected = {c.get("name") for c in client.client_list()}
    except redis.exceptions.ResponseError:  # CLIENT LIST refused (an ACL, a managed Redis): heartbeats only
        return set()
    now = time.monotonic()
    for stale in [n for n, t in _missing_since.items() if now - t > 300]:  # a dead worker's jobs were failed long ago
        del _missing_since[stale]
    dead = set()
    for worker in workers:
        raw = client.get(_key(prefix, worker))
        try:
            name = json.loads(raw)["connection"] if raw else None
        except (ValueError, KeyError, TypeError):  # an older worker's bare timestamp: no claim either way
            name = None
        if not name or name in connected:
            _missing_since.pop(name or "", None)
        elif now - _missing_since.setdefault(name, now) >= CONFIRM_S:
            dead.add(worker)
    return dead


def client_for(url: str, name: str | None = None) -> redis.Redis:
    """``name``: the connection's client name, set again on every reconnect (a worker's presence)."""
    return redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2, client_name=name)
