"""The UI's one door: with ``MOELAB_API_TOKEN`` set, every route of the frontend's server asks for it.

The Dash app calls the API with the server's token (``moelab.api_client``), so without a guard
of its own the UI port would hand everything the token protects (pages, callbacks that read
samples or cascade-delete, ``/download/…`` relays) to whoever reaches it. :func:`install` puts
one ``before_request`` check in front of every route of the Flask server:

* a request passes with ``Authorization: Bearer <token>`` (as the API takes it), or with the
  session cookie the login page sets: ``<session id>.<expiry>.<hmac-sha256>``, signed with a key
  derived from the token, so it cannot be forged, ends after :data:`SESSION_S`, and every session
  ends when the token changes. The session also has to be live on the server (:class:`RedisSessions`:
  a login adds it, a logout deletes it), so a copied cookie stops working the moment its owner logs
  out. The cookie is HttpOnly and SameSite=Strict (Secure behind HTTPS);
* ``/login`` (GET: a form; POST: the token, compared in constant time) and ``/logout`` (ends the
  session on the server, clears the cookie) are open, and so are the static ``/assets/``;
* anything else without credentials: page requests are redirected (303) to
  ``/login?next=<where they were going>``; downloads, Dash's ``/_dash-*`` endpoints (layout,
  dependencies, callbacks, component bundles) and every non-GET request get 401.

Without a token the server stays open, as the API does.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import secrets
import time
from typing import Any
from urllib.parse import quote

from flask import Flask, Response, redirect, request
from redis.exceptions import RedisError

COOKIE = "moelab_session"
SESSION_S = 12 * 3600  # a login lasts this long
PUBLIC_PATHS = ("/login", "/logout", "/favicon.ico")
PUBLIC_PREFIXES = ("/assets/",)
#: paths a browser does not navigate to: refused with 401 instead of a redirect to the login page
API_LIKE_PREFIXES = ("/_dash-", "/download/", "/_reload-hash", "/_favicon")


def _key(token: str) -> bytes:
    return hmac.new(token.encode(), b"moelab-ui-session-v1", hashlib.sha256).digest()


class RedisSessions:
    """The UI's live sessions, in the Redis the service already runs on (shared by every frontend process):
    ``{prefix}ui-session:<id>`` exists from login to logout, and expires with its cookie."""

    def __init__(self, client: Any, prefix: str = "moelab:") -> None:
        self.client, self.prefix = client, prefix

    def _key(self, sid: str) -> str:
        return f"{self.prefix}ui-session:{sid}"

    def add(self, sid: str, ttl_s: int) -> None:
        self.client.set(self._key(sid), "1", ex=max(1, ttl_s))

    def alive(self, sid: str) -> bool:
        return bool(self.client.exists(self._key(sid)))

    def remove(self, sid: str) -> None:
        self.client.delete(self._key(sid))


def _sign(token: str, sid: str, expires: str) -> str:
    return hmac.new(_key(token), f"{sid}.{expires}".encode(), hashlib.sha256).hexdigest()


def make_session(token: str, now: float | None = None, ttl_s: int = SESSION_S, sid: str | None = None) -> str:
    """A session cookie value for ``token`` (a new random session id unless ``sid``), valid for ``ttl_s``
    seconds from ``now``; it opens doors only while the session is live in the server's store."""
    sid = sid or secrets.token_hex(16)
    expires = str(int(now if now is not None else time.time()) + ttl_s)
    return f"{sid}.{expires}.{_sign(token, sid, expires)}"


def session_id(token: str, value: str | None, now: float | None = None) -> str | None:
    """The session id of ``value`` when it is an unexpired cookie signed for ``token``, else None."""
    sid, _, rest = (value or "").partition(".")
    expires, _, sig = rest.partition(".")
    if not sid.isalnum() or not expires.isdigit() or not sig:
        return None
    if int(expires) < (now if now is not None else time.time()):
        return None
    return sid if hmac.compare_digest(sig.encode(), _sign(token, sid, expires).encode()) else None


def token_matches(token: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def _safe_next(target: str | None) -> str:
    """Only a path on this server (no ``//host`` or ``/\\host``): no open redirect through ``next``."""
    if not target or not target.startswith("/") or target.startswith(("//", "/\\")):
        return "/"
    return target


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>moelab: log in</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body {{ font-family: system-ui, sans-serif; background: #f5f6f8; margin: 0; }}
form {{ max-width: 360px; margin: 12vh auto; background: #fff; padding: 28px; border-radius: 8px;
        box-shadow: 0 1px 4px rgba(0,0,0,.12); display: flex; flex-direction: column; gap: 12px; }}
h1 {{ font-size: 1.3rem; margin: 0 0 4px; }}
input, button {{ font-size: 1rem; padding: 8px; }}
.error {{ color: #b00020; margin: 0; }}
.hint {{ color: #555; font-size: .85rem; margin: 0; }}
</style></head>
<body><form method="post" action="/login">
<h1>moelab</h1>
<p class="hint">This server asks for its API token (MOELAB_API_TOKEN).</p>
{error}
<label for="token">API token</label>
<input id="token" name="token" type="password" autocomplete="current-password" autofocus required>
<input type="hidden" name="next" value="{next}">
<button id="login" type="submit">Log in</button>
</form></body></html>
"""


def _login_page(next_path: str, error: str = "", status: int = 200) -> Response:
    body = _PAGE.format(next=html.escape(next_path, quote=True),
                        error=f'<p class="error" role="alert">{html.escape(error)}</p>' if error else "")
    return Response(body, status=status, mimetype="text/html",
                    headers={"Cache-Control": "no-store", "X-Frame-Options": "DENY"})


def install(server: Flask, token: str | None, sessions: RedisSessions | None = None) -> None:
    """Guard every route of ``server`` with ``token``; nothing changes when it is None or empty.
    ``sessions`` keeps the live sessions (required with a token)."""
    if not token:
        return
    if sessions is None:
        raise ValueError("a guarded UI needs a session store (RedisSessions)")

    def authorized() -> bool:
        given = _bearer(request.headers.get("Authorization"))
        if given is not None:
            return token_matches(token, given)
        sid = session_id(token, request.cookies.get(COOKIE))
        return sid is not None and sessions.alive(sid)

    def guard() -> Response | None:
        path = request.path
        try:
            if path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES) or authorized():
                return None
        except RedisError as exc:
            return Response(f"the UI's session store (Redis, MOELAB_REDIS_URL) is not reachable ({type(exc).__name__}); "
                            "start Redis or check the URL, then reload", status=503, mimetype="text/plain")
        if request.method not in ("GET", "HEAD") or path.startswith(API_LIKE_PREFIXES):
            return Response("authentication required: log in at /login or send Authorization: Bearer <MOELAB_API_TOKEN>",
                            status=401, mimetype="text/plain", headers={"WWW-Authenticate": 'Bearer realm="moelab"'})
        target = request.full_path.rstrip("?") if request.query_string else path
        return redirect(f"/login?next={quote(target, safe='')}", code=303)

    # first in line: before Dash's own hooks, so nothing of the app runs for a stranger
    server.before_request_funcs.setdefault(None, []).insert(0, guard)

    def login() -> Response:
        if request.method == "GET":
            return _login_page(_safe_next(request.args.get("next")))
        next_path = _safe_next(request.form.get("next"))
        if not token_matches(token, request.form.get("token", "")):
            time.sleep(0.3)  # slows guessing; the token is the real defence
            return _login_page(next_path, "That is not the server's token.", status=401)
        response = redirect(next_path, code=303)
        value = make_session(token)
        sessions.add(value.split(".", 1)[0], SESSION_S)
        response.set_cookie(COOKIE, value, max_age=SESSION_S, path="/", httponly=True,
                            samesite="Strict", secure=request.is_secure)
        return response

    def logout() -> Response:
        sid = session_id(token, request.cookies.get(COOKIE))
        if sid is not None:  # ended here, not only in this browser: a copy of the cookie opens nothing after this
            sessions.remove(sid)
        response = redirect("/login", code=303)
        response.delete_cookie(COOKIE, path="/", httponly=True, samesite="Strict", secure=request.is_secure)
        return response

    server.add_url_rule("/login", "moelab_login", login, methods=["GET", "POST"])
    server.add_url_rule("/logout", "moelab_logout", logout, methods=["GET", "POST"])
