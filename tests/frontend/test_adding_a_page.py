"""docs/development.md, "Adding a UI page", done as a contributor would: a module that registers itself with
``dash.register_page`` joins the bar in its own order and is served at its path, with no other file edited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PAGE = '''
"""A page added by the test."""
import dash
from dash import html

dash.register_page(__name__, path="/added", name="Added page", order=12, layout=html.Div("hello from a new page", id="added"))
'''

#: in a process of its own: a second app would re-register every page's callbacks in this one
CHECK = '''
import importlib, json
import dash
import frontend.app as app

before = app.nav()
importlib.import_module("added_page")
fresh = app.create_app()
header = fresh.layout.children[0]
print(json.dumps({
    "before": before, "after": app.nav(),
    "links": [[c.children, c.href] for c in header.children if isinstance(c, dash.dcc.Link)],
    "status": fresh.server.test_client().get("/added").status_code,
    "layout": dash.page_registry["added_page"]["layout"].children,
}))
'''


def test_a_page_module_that_registers_joins_the_bar_and_is_served(tmp_path):
    (tmp_path / "added_page.py").write_text(PAGE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert ["Added page", "/added"] not in seen["before"]
    assert seen["after"] == [*seen["before"], ["Added page", "/added"]]  # order 12: after the Playground (11)
    assert seen["links"] == seen["after"]  # the bar is the registry, in order
    assert seen["status"] == 200 and seen["layout"] == "hello from a new page"
