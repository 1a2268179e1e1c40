"""The API's request plumbing under concurrency: the thread pool is the configured size, and the
session dependency (``async def`` to avoid thread hops) still commits what a handler left pending."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import anyio.to_thread
from sqlalchemy import select

from backend.app import create_app
from backend.deps import get_session
from moelab.settings import Settings
from moelab.store.db import Database, Model


def _settings(tmp_path, **kw) -> Settings:
    return Settings(_env_file=None, data_dir=tmp_path, redis_url="redis://127.0.0.1:6379/13",
                    redis_prefix="moelab-test-threads:", **kw)


def _run(coro):
    # A thread of its own: the browser tests' Playwright keeps an event loop running in the main thread.
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def test_lifespan_sizes_the_thread_pool_from_settings(tmp_path):
    app = create_app(_settings(tmp_path, api_threads=3))

    async def tokens_inside() -> float:
        async with app.router.lifespan_context(app):
            return anyio.to_thread.current_default_thread_limiter().total_tokens

    assert _run(tokens_inside()) == 3


def test_session_dependency_commits_pending_writes_and_rolls_back_on_error(tmp_path):
    db = Database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    db.init()
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(db=db)))

    async def handler(model_id: str, fail: bool) -> None:
        deps = get_session(request)
        session = await deps.__anext__()
        session.add(Model(id=model_id, name=model_id, source="default", kind="default", params={}))
        if fail:
            try:
                await deps.athrow(RuntimeError("handler failed"))
            except RuntimeError:
                return
        try:
            await deps.__anext__()
        except StopAsyncIteration:
            pass

    _run(handler("mod-kept", fail=False))
    _run(handler("mod-dropped", fail=True))
    with db.session() as s:
        assert s.scalars(select(Model.id)).all() == ["mod-kept"]
    db.dispose()
