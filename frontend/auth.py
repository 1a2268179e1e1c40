"""The UI's one door: with ``MOELAB_API_TOKEN`` set, every route of the frontend's server asks for it.

The Dash app calls the API with the server's token (``frontend.api_client``), so without a guard
of its own the UI port would hand everything the token protects (pages, callbacks that read
samples or cascade-delete, ``/download/…`` relays) to whoever reaches it. :func:`install` puts
one ``before_request`` check in front of every route of the Flask server:

* a request passes with ``Authorization: Bearer <token>`` (as the API takes it), or with the
  session cookie the login page sets: ``<expiry>.<hmac-sha256>``, signed with a key derived from
  the token, so it cannot be forged, ends after :data:`SESSION_S`, and every session ends when
  the token changes. The cookie is HttpOnly and SameSite=Strict (Secure behind HTTPS);
* ``/login`` (GET: a form; POST: the token, compared in constant time) and ``/logout`` (clears
  the cookie) are open, and so are the static ``/assets/``;
* anything else without credentials: page requests are redirected (303) to
  ``/login?next=<where they were going>``; downloads, Dash's ``/_dash-*`` endpoints (layout,
  dependencies, callbacks, component bundles) and every non-GET request get 401.

Without a token the server stays open, as the API does.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import time
from urllib.parse import quote

from flask import Flask, Response, redirect, request

COOKIE = "moelab_session"
SESSION_S = 12 * 3600  # a login lasts this long
PUBLIC_PATHS = ("/login", "/logout", "/favicon.ico")
PUBLIC_PREFIXES = ("/assets/",)
#: paths a browser does not navigate to: refused with 401 instead of a redirect to the login page
API_LIKE_PREFIXES = ("/_dash-", "/download/", "/_reload-hash", "/_favicon")


def _key(token: str) -> bytes:
    return hmac.new(token.encode(), b"moelab-ui-session-v1", hashlib.sha256).digest()


def make_session(token: str, now: float | None = None, ttl_s: int = SESSION_S) -> str:
    """A session cookie value for ``token``, valid for ``ttl_s`` seconds from ``now``."""
    expires = int(now if now is not None else time.time()) + ttl_s
    sig = hmac.new(_key(token), str(expires).encode(), hashlib.sha256).hexdigest()
    return f"{expires}.{sig}"


def valid_session(token: str, value: str | None, now: float | None = None) -> bool:
    """Whether ``value`` is an unexpired session cookie signed for ``token``."""
    if not value:
        return False
    expires_text, _, sig = value.partition(".")
    if not expires_text.isdigit() or not sig:
        return False
    if int(expires_text) < (now if now is not None else time.time()):
        return False
    expected = hmac.new(_key(token), expires_text.encode(), hashlib.sha256).hexdigest()
    return hmac.compare_digest(sig.encode(), expected.encode())


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


def install(server: Flask, token: str | None) -> None:
    """Guard every route of ``server`` with ``token``; nothing changes when it is None or empty."""
    if not token:
        return

    def authorized() -> bool:
        given = _bearer(request.headers.get("Authorization"))
        if given is not None:
            return token_matches(token, given)
        return valid_session(token, request.cookies.get(COOKIE))

    def guard() -> Response | None:
        path = request.path
        if path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES) or authorized():
            return None
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
        response.set_cookie(COOKIE, make_session(token), max_age=SESSION_S, path="/", httponly=True,
                            samesite="Strict", secure=request.is_secure)
        return response

    def logout() -> Response:
        response = redirect("/login", code=303)
        response.delete_cookie(COOKIE, path="/", httponly=True, samesite="Strict", secure=request.is_secure)
        return response

    server.add_url_rule("/login", "moelab_login", login, methods=["GET", "POST"])
    server.add_url_rule("/logout", "moelab_logout", logout, methods=["GET", "POST"])
