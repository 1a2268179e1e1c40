"""Refusals that come from the request's headers alone, before its body is read: a request without
the API token (a 49 MB upload is not read whole to answer 401). Against a live uvicorn over a raw
socket, so the body really is never sent."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from pydantic import SecretStr

from .conftest import _free_port

TOKEN = "early-s3cret"


@pytest.fixture(scope="module")
def live_port(settings) -> Iterator[int]:
    import uvicorn

    from backend.app import create_app

    guarded = settings.model_copy(update={"api_token": SecretStr(TOKEN), "max_upload_mb": 100.0})  # 49 MB is allowed
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(guarded), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield port
    server.should_exit = True
    thread.join(15)


def _send_head_of_upload(port: int, headers: str, wait_s: float) -> tuple[bytes, float]:
    """Declare a 49 MB multipart upload, send a few bytes of it, and read what comes back within ``wait_s``."""
    head = (f"POST /api/v1/calibration-sets/upload HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{headers}"
            "Content-Type: multipart/form-data; boundary=b0und\r\nContent-Length: 49000000\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        t0 = time.monotonic()
        sock.sendall(head + b"--b0und\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.txt\"\r\n\r\nfew bytes")
        got = b""
        try:
            while b"\r\n\r\n" not in got:
                piece = sock.recv(65536)
                if not piece:
                    break
                got += piece
        except socket.timeout:
            pass
        return got, time.monotonic() - t0


@pytest.mark.parametrize("headers", ["", "Authorization: Bearer wrong\r\n", "X-API-Token: wrong\r\n"],
                         ids=["no token", "wrong bearer", "wrong x-api-token"])
def test_an_upload_without_the_token_is_refused_before_its_body_is_read(live_port, headers):
    got, took = _send_head_of_upload(live_port, headers, wait_s=5)
    assert got.startswith(b"HTTP/1.1 401 "), got[:300]
    assert took < 2, took  # answered from the headers: the 49 MB never came
    assert b"www-authenticate: bearer" in got.lower()


def test_with_the_token_the_same_request_goes_on_to_read_its_body(live_port):
    """The control: past the token check the server waits for the declared body (no answer yet)."""
    got, took = _send_head_of_upload(live_port, f"Authorization: Bearer {TOKEN}\r\n", wait_s=1.5)
    assert got == b"" and took >= 1.4, (got[:300], took)


def test_health_stays_open_and_other_routes_need_the_token(live_port):
    import httpx

    base = f"http://127.0.0.1:{live_port}/api/v1"
    assert httpx.get(f"{base}/health").status_code == 200
    r = httpx.get(f"{base}/models")
    assert r.status_code == 401 and "MOELAB_API_TOKEN" in r.json()["detail"] and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert httpx.get(f"{base}/models", headers={"X-API-Token": TOKEN}).status_code == 200
