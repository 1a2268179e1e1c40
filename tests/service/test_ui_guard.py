"""The UI guarded like the API: a real ``moelab serve`` with MOELAB_API_TOKEN set. Every page, a
download and Dash's endpoints (layout, dependencies, a callback that reads the API) are refused
without the token (303 to /login for pages, 401 for the rest), and open after logging in through
the login form in headless Chromium, or with the API's bearer header; a wrong token opens nothing."""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from frontend.app import nav
from frontend.auth import COOKIE, make_session

from .conftest import _free_port
from .helpers import REPO, env_for, wait_job

TOKEN = f"ui-guard-{secrets.token_hex(12)}"
#: every page of the app, a deep link with a query, and a path no page has (Dash answers it too)
PAGES = [path for _, path in nav()] + ["/neurons?profile=pr-none&layer=0", "/no-such-page"]
DOWNLOAD = "/download/conversions/cv-0000000000.zip"  # no such conversion: past the guard, the API says 404


def _refresh_callback() -> dict:
    """The body Dash's renderer POSTs to /_dash-update-component for the workspace's refresh (which
    calls the API's health, lists and jobs with the server's token)."""
    outputs = [("ws-lists", "children"), ("ws-health", "children"), ("ws-model", "options"), ("ws-set", "options"),
               ("ws-builtin", "options"), ("ws-start", "children"), ("ws-eval-conversion", "options"),
               ("ws-eval-source", "options"), ("ws-shown", "data")]
    inputs = [("ws-poll", "n_intervals", 1), ("ws-created", "children", None), ("ws-deleted", "children", None),
              ("ws-cancelled", "children", None), ("ws-exported", "children", None), ("ws-refusal", "data", None)]
    return {
        "output": ".." + "...".join(f"{i}.{p}" for i, p in outputs) + "..",
        "outputs": [{"id": i, "property": p} for i, p in outputs],
        "inputs": [{"id": i, "property": p, "value": v} for i, p, v in inputs],
        "changedPropIds": ["ws-poll.n_intervals"],
        "state": [{"id": "ws-shown", "property": "data", "value": None}],
    }


@pytest.fixture(scope="module")
def guarded(service_config, worker, tmp_path_factory) -> Iterator[dict[str, str]]:
    """``moelab serve --no-worker`` with a token, on free loopback ports, the service fixtures' Redis, store and
    worker; with one calibration set built through its API, whose zip the UI relays (``calib`` in the dict)."""
    logs = tmp_path_factory.mktemp("ui-guard-logs")
    api_port, ui_port = _free_port(), _free_port()
    env = env_for(service_config, MOELAB_HOST="127.0.0.1", MOELAB_PORT=str(api_port), MOELAB_FRONTEND_PORT=str(ui_port),
                  MOELAB_API_TOKEN=TOKEN)
    env.pop("MOELAB_API_URL", None)
    log = logs / "serve.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "moelab.cli", "serve", "--no-worker"], env=env, cwd=REPO,
                                stdout=fh, stderr=subprocess.STDOUT)
    ui = f"http://127.0.0.1:{ui_port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"moelab serve exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the UI did not answer:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{ui}/login", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        api = f"http://127.0.0.1:{api_port}/api/v1"
        with httpx.Client(base_url=f"http://127.0.0.1:{api_port}", timeout=30,
                          headers={"Authorization": f"Bearer {TOKEN}"}) as client:
            created = client.post("/api/v1/calibration-sets", json={"source": "builtin", "name": "mixed", "samples": 4})
            assert created.status_code == 202, created.text
            job = wait_job(client, created.json()["job_id"])
            assert job["state"] == "succeeded", job
        yield {"ui": ui, "api": api, "calib": created.json()["id"], "log": str(log)}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _refused(client: httpx.Client, calib: str) -> None:
    for path in PAGES:
        r = client.get(path)
        assert r.status_code == 303, (path, r.status_code, r.text[:200])
        assert r.headers["location"].startswith("/login?next=%2F"), r.headers["location"]
    for path in (DOWNLOAD, f"/download/calibration-sets/{calib}.zip", "/_dash-layout", "/_dash-dependencies"):
        r = client.get(path)
        assert r.status_code == 401, (path, r.status_code, r.text[:200])
    r = client.post("/_dash-update-component", json=_refresh_callback())
    assert r.status_code == 401, r.text[:200]
    assert "ws-health" not in r.text


def test_without_the_token_every_ui_door_is_shut(guarded):
    with httpx.Client(base_url=guarded["ui"], timeout=30) as anonymous:
        _refused(anonymous, guarded["calib"])
        assert anonymous.get("/login").status_code == 200  # the one page a stranger sees
        assert anonymous.get("/login").headers["server"] == "moelab"  # served by waitress (--ident)


@pytest.mark.parametrize("how", ["wrong bearer", "cookie of another token", "tampered cookie", "expired cookie",
                                 "signed cookie of a session the server never opened"])
def test_a_wrong_token_or_forged_session_opens_nothing(guarded, how):
    headers, cookies = {}, {}
    if how == "wrong bearer":
        headers["Authorization"] = f"Bearer {TOKEN}x"
    elif how == "cookie of another token":
        cookies[COOKIE] = make_session("some-other-token")
    elif how == "tampered cookie":
        sid, expires, sig = make_session(TOKEN).split(".")
        cookies[COOKIE] = f"{sid}.{int(expires) + 3600}.{sig}"  # a longer life, same signature
    elif how == "expired cookie":
        cookies[COOKIE] = make_session(TOKEN, now=time.time() - 7200, ttl_s=3600)
    else:  # well signed (someone who knows the token could sign one) but never logged in: not live on the server
        cookies[COOKIE] = make_session(TOKEN)
    with httpx.Client(base_url=guarded["ui"], timeout=30, headers=headers, cookies=cookies) as client:
        _refused(client, guarded["calib"])
        r = client.post("/login", data={"token": TOKEN[:-1], "next": "/"})
        assert r.status_code == 401 and "not the server" in r.text and COOKIE not in r.headers.get("set-cookie", "")


def _opened(client: httpx.Client, calib: str) -> None:
    for path in PAGES:
        r = client.get(path)
        assert r.status_code == 200 and "_dash-config" in r.text, (path, r.status_code, r.text[:300])
    assert client.get("/_dash-layout").status_code == 200
    assert client.get("/_dash-dependencies").status_code == 200
    r = client.post("/_dash-update-component", json=_refresh_callback())
    assert r.status_code == 200, r.text[:500]
    health = r.json()["response"]["ws-health"]["children"]
    assert "API http" in str(health), r.text[:500]  # the callback ran and reached the API with the server's token
    r = client.get(f"/download/calibration-sets/{calib}.zip")
    assert r.status_code == 200 and r.content[:2] == b"PK", (r.status_code, r.text[:300])  # the zip, relayed from the API
    r = client.get(DOWNLOAD)
    assert r.status_code == 404 and "no conversion with id" in r.text, (r.status_code, r.text[:300])  # the relay's answer


def test_the_bearer_header_opens_every_door(guarded):
    with httpx.Client(base_url=guarded["ui"], timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        _opened(client, guarded["calib"])


def test_logging_in_through_the_form_in_chromium_opens_every_door(guarded, browser):
    ui = guarded["ui"]
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.goto(f"{ui}/neurons?layer=1")
    assert page.url.startswith(f"{ui}/login?next="), page.url  # redirected, with where it was going
    page.fill("#token", "not-the-token")
    with page.expect_navigation():
        page.click("#login")
    assert "/login" in page.url and page.locator(".error").inner_text() == "That is not the server's token."
    assert not context.cookies()

    page.goto(f"{ui}/neurons?layer=1")
    page.fill("#token", TOKEN)
    with page.expect_navigation():
        page.click("#login")
    assert page.url == f"{ui}/neurons?layer=1", page.url  # back where it was going
    cookie = next(c for c in context.cookies() if c["name"] == COOKIE)
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict", cookie
    assert TOKEN not in cookie["value"]

    page.goto(f"{ui}/")  # the workspace's refresh callback runs through /_dash-update-component
    page.locator("#ws-health").filter(has_text="API http").wait_for()
    # the browser's cookie opens the other doors too (the context's requests carry it)
    _opened(_CookieClient(context.request, ui), guarded["calib"])

    copied = cookie["value"]
    with httpx.Client(base_url=ui, timeout=30, cookies={COOKIE: copied}) as elsewhere:  # the cookie copied to another client
        assert elsewhere.get("/").status_code == 200
        with page.expect_navigation():
            page.click("#logout")
        assert page.url.startswith(f"{ui}/login"), page.url
        assert not [c for c in context.cookies() if c["name"] == COOKIE]
        page.goto(f"{ui}/")
        assert page.url.startswith(f"{ui}/login"), page.url
        _refused(elsewhere, guarded["calib"])  # logout ended the session on the server: the copy opens nothing
    context.close()


class _CookieClient:
    """The few httpx.Client calls `_opened` makes, through Playwright's APIRequestContext (the page's cookies)."""

    def __init__(self, request, base: str) -> None:
        self.request, self.base = request, base

    def get(self, path: str) -> httpx.Response:
        r = self.request.get(self.base + path, max_redirects=0)
        return httpx.Response(r.status, content=r.body())

    def post(self, path: str, json: dict) -> httpx.Response:
        r = self.request.post(self.base + path, data=json, headers={"Content-Type": "application/json"}, max_redirects=0)
        return httpx.Response(r.status, text=r.text())
