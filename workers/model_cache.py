"""A small per-worker cache of loaded models, so consecutive jobs on one model skip the load.

The engine's ``run_*`` functions take a ``loader`` (dense models) and, where they read a conversion,
a ``load_converted``; the worker passes :func:`cached_load_model` and :func:`cached_load_converted`.
The cache holds at most ``MOELAB_MODEL_CACHE_SIZE`` models and ``MOELAB_MODEL_CACHE_MEMORY`` bytes of
their weights, the least recently used leaving first. A job *checks out* a cached
model (it is removed from the cache while in use, so two threads never share one) and gives it
back when it ends cleanly, only if the job left it unchanged: profiling and evaluation restore
the model (hooks removed, MLPs swapped back); conversion rewrites it in place, so a conversion
job never gives its model back.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger("moelab.worker")

Key = tuple[Any, ...]


def weight_bytes(item: Any) -> int:
    """Bytes of the parameters and buffers of a model (an ``nn.Module``, or an adapter's ``.model``)."""
    module = getattr(item, "model", item)
    tensors = [*module.parameters(), *module.buffers()] if hasattr(module, "parameters") else []
    return sum(t.numel() * t.element_size() for t in tensors)


class ModelCache:
    def __init__(self, size: int, max_bytes: int | None = None) -> None:
        self.size, self.max_bytes = size, max_bytes
        self._items: OrderedDict[Key, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: Key) -> Any | None:
        with self._lock:
            item = self._items.pop(key, None)
        return None if item is None else item[0]

    def give(self, key: Key, adapter: Any) -> None:
        """Keep ``adapter``; the least recently used leave while the cache holds more than its size or
        its bytes. A model larger than the whole budget is not kept."""
        if self.size <= 0:
            return
        nbytes = weight_bytes(adapter)
        if self.max_bytes is not None and nbytes > self.max_bytes:
            return
        with self._lock:
            self._items[key] = (adapter, nbytes)
            self._items.move_to_end(key)
            while len(self._items) > self.size or (self.max_bytes is not None and self.nbytes > self.max_bytes):
                self._items.popitem(last=False)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self._items.values())

    def keys(self) -> list[Key]:
        with self._lock:
            return list(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


CACHE = ModelCache(1)
_local = threading.local()


def _key(spec: str, data_dir: Path, device: str, dtype: str, trust_remote_code: bool) -> Key:
    from moelab.engine.models import resolve_device, resolve_dtype

    dev = resolve_device(device)
    return (spec, str(Path(data_dir).resolve()), str(dev), str(resolve_dtype(dtype, dev)), bool(trust_remote_code))


def _checked_out(key: Key, what: str, load: Callable[[], Any], on_hit: Callable[[], None] = lambda: None) -> Any:
    """The cached model under ``key`` when a job scope (``job_models``) allows it, else ``load()``; either
    way recorded as the job's, to be given back when it ends cleanly."""
    checked_out = getattr(_local, "checked_out", None)
    model = CACHE.take(key) if checked_out is not None else None
    if model is not None:
        log.info("%s from the worker cache", what)
        on_hit()
    else:
        model = load()
    if checked_out is not None:
        checked_out.append((key, model))
    return model


def cached_load_model(spec: str = "default", *, data_dir: Path, device: str = "auto", dtype: str = "auto",
                      trust_remote_code: bool = False, progress: Any = None, **kwargs: Any) -> Any:
    """Drop-in for ``moelab.engine.models.load_model`` that reuses a cached model when allowed."""
    from moelab.engine.models import load_model
    from moelab.engine.progress import NO_PROGRESS

    progress = progress or NO_PROGRESS
    return _checked_out(
        _key(spec, data_dir, device, dtype, trust_remote_code), f"model {spec}",
        lambda: load_model(spec, data_dir=data_dir, device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                           progress=progress, **kwargs),
        on_hit=lambda: progress.update("load model", 1, 1))


def _converted_key(conversion_dir: Path) -> Key:
    """A conversion's directory and the times its record and weights were written: a conversion re-run in
    place (its directory replaced whole) is loaded afresh."""
    d = Path(conversion_dir).resolve()
    stamps = tuple(p.stat().st_mtime_ns for p in sorted(d.glob("*.safetensors")) + [d / "config.json"] if p.exists())
    return ("conversion", str(d), stamps)


def cached_load_converted(conversion_dir: Path) -> Any:
    """Drop-in for ``moelab.engine.runtime.export.load_exported`` that reuses a cached converted model."""
    from moelab.engine.runtime.export import load_exported

    return _checked_out(_converted_key(conversion_dir), f"conversion {Path(conversion_dir).name}",
                        lambda: load_exported(conversion_dir))


@contextmanager
def job_models(give_back: bool) -> Iterator[None]:
    """Scope of one job: models it loads may come from the cache; on clean exit they return to it
    when ``give_back`` (the job does not modify its model)."""
    _local.checked_out = []
    try:
        yield
        if give_back:
            for key, adapter in _local.checked_out:
                CACHE.give(key, adapter)
    finally:
        _local.checked_out = None


def install(size: int, max_bytes: int | None = None) -> None:
    """Size the cache: ``size`` models (0 disables it) of at most ``max_bytes`` in all."""
    CACHE.size, CACHE.max_bytes = size, max_bytes
