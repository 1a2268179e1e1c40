"""The moelab web UI: a Dash multi-page app, served by waitress (``python -m frontend.app``, or
``waitress-serve --port 8050 frontend.app:server``; ``moelab serve`` runs the latter).

It talks to the API over HTTP only (``moelab.api_client``); settings come from
``moelab.settings`` (MOELAB_API_URL, MOELAB_HOST, MOELAB_FRONTEND_PORT). With MOELAB_API_TOKEN
set, every route asks for the token too (``frontend.auth``): a login page and a session cookie,
or the API's bearer header.
"""

from __future__ import annotations

from pathlib import Path

import dash
from dash import Dash, dcc, html

from moelab.settings import get_settings
from moelab.store.broker import broker_url
from moelab.store.liveness import client_for

def nav() -> list[tuple[str, str]]:
    """(name, path) of every page in its own ``order`` (``dash.register_page``): a new page joins the bar by registering."""
    pages = {p["path"]: p for p in dash.page_registry.values()}  # a module imported twice (tests) registers twice
    return [(p["name"], p["path"]) for p in sorted(pages.values(), key=lambda p: p["order"])]


def create_app() -> Dash:
    app = Dash(__name__, use_pages=True, pages_folder=str(Path(__file__).parent / "pages"),
               assets_folder=str(Path(__file__).parent / "assets"), suppress_callback_exceptions=True, title="moelab", update_title=None)
    from frontend import components  # noqa: F401  (registers the shared CSV callback)
    from frontend import downloads

    from frontend import auth

    settings = get_settings()
    token = settings.token()
    sessions = auth.RedisSessions(client_for(broker_url(settings)), settings.redis_prefix) if token else None
    auth.install(app.server, token, sessions)  # before any other route: one guard for every door
    downloads.register(app.server)

    logout = [html.A("Log out", href="/logout", className="nav logout", id="logout")] if token else []
    app.layout = html.Div([
        html.Header([html.Span("moelab", className="brand")]
                    + [dcc.Link(name, href=path, className="nav") for name, path in nav()] + logout),
        html.Main(dash.page_container),
    ])
    return app


app = create_app()
server = app.server

#: waitress threads: a zip download relayed from the API holds one for its whole length
THREADS = 8


def main() -> None:
    from waitress import serve

    s = get_settings()
    serve(server, host=s.host, port=s.frontend_port, threads=THREADS, ident="moelab")


if __name__ == "__main__":
    main()
