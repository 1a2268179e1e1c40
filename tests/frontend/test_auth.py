"""frontend.auth without a server: the session cookie's signature and expiry, the login's
redirect target, and a UI without a token left open (the live guard: tests/service/test_ui_guard.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from flask import Flask

from frontend.auth import COOKIE, RedisSessions, _safe_next, install, make_session, session_id, token_matches
from tests.service.conftest import redis_url  # noqa: F401  (a fixture)


def test_a_session_is_signed_for_its_token_and_ends():
    now = time.time()
    value = make_session("tok", now=now, ttl_s=60)
    sid = session_id("tok", value, now=now + 59)
    assert sid and value.startswith(f"{sid}.")
    assert session_id("tok", value, now=now + 61) is None  # expired
    assert session_id("tok2", value, now=now) is None  # a new token ends every session
    sid, expires, sig = value.split(".")
    assert session_id("tok", f"{sid}.{int(expires) + 1}.{sig}", now=now) is None  # a longer life is not signed
    assert session_id("tok", f"{'0' * 32}.{expires}.{sig}", now=now) is None  # nor another session's id
    for junk in (None, "", ".", "..", "abc.def", f"{expires}.{sig}", f"{sid}.{expires}.", f"{sid}.-1.{sig}"):
        assert session_id("tok", junk, now=now) is None
    assert "tok" not in value and make_session("tok", now=now) != make_session("tok", now=now)  # a new id each login


def test_tokens_compare_exactly():
    assert token_matches("tok", "tok") and not token_matches("tok", "tok ") and not token_matches("tok", None)
    assert not token_matches("tok", "")


def test_login_only_sends_people_back_to_this_server():
    assert _safe_next("/neurons?layer=2") == "/neurons?layer=2"
    for target in (None, "", "https://evil.example/", "//evil.example/x", "/\\evil.example", "neurons"):
        assert _safe_next(target) == "/"


@pytest.fixture
def sessions(redis_url) -> Iterator[RedisSessions]:  # noqa: F811
    """The live-session store on the suite's Redis, under a prefix of this test's own (removed after)."""
    client = redis.Redis.from_url(redis_url)
    store = RedisSessions(client, prefix=f"moelab-test-auth-{uuid.uuid4().hex[:8]}:")
    yield store
    for key in client.scan_iter(f"{store.prefix}*"):
        client.delete(key)


def _app(token: str | None, sessions: RedisSessions | None = None) -> Flask:
    app = Flask(__name__)
    app.add_url_rule("/", "index", lambda: "page")
    app.add_url_rule("/_dash-layout", "layout", lambda: "{}")
    install(app, token, sessions)
    return app


def test_without_a_token_nothing_is_guarded():
    client = _app(None).test_client()
    assert client.get("/").status_code == 200 and client.get("/_dash-layout").status_code == 200
    assert client.get("/login").status_code == 404  # no login page either


def test_with_a_token_the_cookie_from_the_login_form_opens_the_doors(sessions):
    client = _app("tok", sessions).test_client()
    assert client.get("/").status_code == 303 and client.get("/_dash-layout").status_code == 401
    r = client.post("/login", data={"token": "tok", "next": "/"})
    assert r.status_code == 303 and r.headers["Location"] == "/"
    cookie = r.headers["Set-Cookie"]
    assert cookie.startswith(f"{COOKIE}=") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert client.get("/").status_code == 200 and client.get("/_dash-layout").status_code == 200
    client.get("/logout")
    assert client.get("/").status_code == 303


def test_logout_ends_the_session_on_the_server_for_every_copy_of_the_cookie(sessions):
    app = _app("tok", sessions)
    mine, theirs = app.test_client(), app.test_client()
    value = mine.post("/login", data={"token": "tok", "next": "/"}).headers["Set-Cookie"].split(";")[0].split("=", 1)[1]
    sid = session_id("tok", value)
    assert sessions.alive(sid) and 0 < sessions.client.ttl(sessions._key(sid)) <= 12 * 3600  # ends with the cookie
    theirs.set_cookie(COOKIE, value)
    assert theirs.get("/").status_code == 200
    mine.get("/logout")
    assert not sessions.alive(sid)
    assert theirs.get("/").status_code == 303 and theirs.get("/_dash-layout").status_code == 401


def test_a_guarded_ui_needs_its_session_store_and_says_when_it_is_gone():
    with pytest.raises(ValueError, match="session store"):
        _app("tok")
    down = RedisSessions(redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5))  # nothing listens there
    client = _app("tok", down).test_client()
    client.set_cookie(COOKIE, make_session("tok"))
    r = client.get("/")
    assert r.status_code == 503 and "MOELAB_REDIS_URL" in r.get_data(as_text=True)
    assert client.get("/", headers={"Authorization": "Bearer tok"}).status_code == 200  # the bearer needs no store
