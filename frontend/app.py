"""The moelab web UI: a Dash multi-page app (``python -m frontend.app``).

It talks to the API over HTTP only (``frontend.api_client``); settings come from
``moelab.settings`` (MOELAB_API_URL, MOELAB_HOST, MOELAB_FRONTEND_PORT).
"""

from __future__ import annotations

from pathlib import Path

import dash
from dash import Dash, dcc, html

from moelab.settings import get_settings

NAV = [("Workspace", "/"), ("Calibration sets", "/calibration"), ("Neuron explorer", "/neurons"),
       ("Layer similarity", "/layers"), ("Conversion designer", "/designer"), ("Fine-tune", "/finetune"), ("Routing explorer", "/routing"),
       ("Token routing", "/tokens"), ("Compare conversions", "/compare"), ("Playground", "/playground")]


def create_app() -> Dash:
    app = Dash(__name__, use_pages=True, pages_folder=str(Path(__file__).parent / "pages"),
               assets_folder=str(Path(__file__).parent / "assets"), suppress_callback_exceptions=True, title="moelab", update_title=None)
    from frontend import components  # noqa: F401  (registers the shared CSV callback)
    from frontend import downloads

    downloads.register(app.server)

    app.layout = html.Div([
        html.Header([html.Span("moelab", className="brand")]
                    + [dcc.Link(name, href=path, className="nav") for name, path in NAV]),
        html.Main(dash.page_container),
    ])
    return app


app = create_app()
server = app.server

if __name__ == "__main__":
    s = get_settings()
    app.run(host=s.host, port=s.frontend_port, debug=False)
