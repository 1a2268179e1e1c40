"""frontend.auth without a server: the session cookie's signature and expiry, the login's
redirect target, and a UI without a token left open (the live guard: tests/service/test_ui_guard.py)."""

from __future__ import annotations

import time

from flask import Flask

from frontend.auth import COOKIE, _safe_next, install, make_session, token_matches, valid_session


def test_a_session_is_signed_for_its_token_and_ends():
    now = time.time()
    value = make_session("tok", now=now, ttl_s=60)
    assert valid_session("tok", value, now=now + 59)
    assert not valid_session("tok", value, now=now + 61)  # expired
    assert not valid_session("tok2", value, now=now)  # a new token ends every session
    expires, sig = value.split(".")
    assert not valid_session("tok", f"{int(expires) + 1}.{sig}", now=now)  # a longer life is not signed
    for junk in (None, "", ".", "abc.def", f"{expires}.", f"-1.{sig}"):
        assert not valid_session("tok", junk, now=now)
    assert "tok" not in value


def test_tokens_compare_exactly():
    assert token_matches("tok", "tok") and not token_matches("tok", "tok ") and not token_matches("tok", None)
    assert not token_matches("tok", "")


def test_login_only_sends_people_back_to_this_server():
    assert _safe_next("/neurons?layer=2") == "/neurons?layer=2"
    for target in (None, "", "https://evil.example/", "//evil.example/x", "/\\evil.example", "neurons"):
        assert _safe_next(target) == "/"


def _app(token: str | None) -> Flask:
    app = Flask(__name__)
    app.add_url_rule("/", "index", lambda: "page")
    app.add_url_rule("/_dash-layout", "layout", lambda: "{}")
    install(app, token)
    return app


def test_without_a_token_nothing_is_guarded():
    client = _app(None).test_client()
    assert client.get("/").status_code == 200 and client.get("/_dash-layout").status_code == 200
    assert client.get("/login").status_code == 404  # no login page either


def test_with_a_token_the_cookie_from_the_login_form_opens_the_doors():
    client = _app("tok").test_client()
    assert client.get("/").status_code == 303 and client.get("/_dash-layout").status_code == 401
    r = client.post("/login", data={"token": "tok", "next": "/"})
    assert r.status_code == 303 and r.headers["Location"] == "/"
    cookie = r.headers["Set-Cookie"]
    assert cookie.startswith(f"{COOKIE}=") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert client.get("/").status_code == 200 and client.get("/_dash-layout").status_code == 200
    client.get("/logout")
    assert client.get("/").status_code == 303
