"""docs/development.md, "Adding a router kind", done as a contributor would: one class in
``moelab_routers.py`` and its entry in ``ROUTERS`` reach the runtime, its cost count, the methods'
``router`` choices, the API (``GET /methods``, ``POST /conversions``' schema), the CLI and the
designer's router dropdown, with no other file edited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: in a process of its own: the kind must be in ``ROUTERS`` before the methods read their choices,
#: as it is when a contributor writes it into the module
CHECK = '''
import json, math
import torch
import moelab.engine.runtime.moelab_routers as R


class UpCentroidRouter(R.Router):
    """s_e = x · mean of expert e's up rows (a test kind)."""

    name = "up_centroid"
    any_partition = True
    native_refusal = "scores from the up rows, not a stock gate"

    def parameters(self, E, d):
        return {"router_up_centroid": (E, d)}

    def macs(self, d, E, m):
        return E * d, 3 * d * m

    def scores(self, block, x):
        return x @ block.router_up_centroid.t(), None

    def init(self, E, d, gate_rows, up_rows, given):
        return {"router_up_centroid": up_rows.mean(dim=1)}


# what the contributor's edit of the module amounts to: the class and its entry in ROUTERS
R.ROUTERS["up_centroid"] = UpCentroidRouter()
R.PARTITION_ROUTERS = tuple(n for n, k in R.ROUTERS.items() if k.any_partition)

import click
import frontend.app  # noqa: F401  (the Dash app: page modules register with it)
from backend.routes.methods import list_methods
from backend.schemas import ConversionCreate
from frontend.pages.designer import method_panel
from moelab.cli import convert
from moelab.engine.core.allocation import layer_plan, plan_macs
from moelab.engine.core.slicing import moe_from_dense

methods = {m.name: m.model_dump() for m in list_methods().items}
choices = {name: next(p["choices"] for p in m["params"] if p["name"] == "router")
           for name, m in methods.items() if any(p["name"] == "router" for p in m["params"])}
body = ConversionCreate(method="expertweaver", profile_id="p", expertweaver={"router": "up_centroid"}).engine_params()


def dropdowns(node):
    if getattr(node, "options", None) is not None and isinstance(getattr(node, "id", None), dict):
        yield node.id["name"], list(node.options)
    kids = getattr(node, "children", None)
    for kid in kids if isinstance(kids, list) else [kids] if kids is not None else []:
        yield from dropdowns(kid)


panel = dict(dropdowns(method_panel(methods["cmoe"], {"router": "up_centroid"}, True)))
torch.manual_seed(0)
d, m, E, shared = 16, 4, 4, 8
gate, up, down = torch.randn(shared + E * m, d), torch.randn(shared + E * m, d), torch.randn(d, shared + E * m)
block = moe_from_dense(gate, up, down, "silu", torch.arange(shared), torch.arange(shared, shared + E * m).reshape(E, m),
                       2, "up_centroid", "weighted")
x = torch.randn(5, d)
with torch.no_grad():
    scores, _ = block.router(x)
    out = block(x)
expected = x @ up[shared:].reshape(E, m, d).mean(1).t()
row = layer_plan(0, shared + E * m, math.nan, m, shared // m, shared % m, E, 2)
print(json.dumps({
    "choices": choices, "body": body, "panel": panel.get("router"),
    "cli": list(next(p for p in convert.params if p.name == "router").type.choices),
    "keys": sorted(k for k in block.state_dict() if "router" in k), "finite": bool(torch.isfinite(out).all()),
    "scores": bool(torch.allclose(scores, expected, atol=1e-5)),
    "macs": [plan_macs(row, "up_centroid", d, "weighted"), block.active_param_count()],
}))
'''


def test_a_router_kind_is_one_class_and_one_entry(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "MOELAB_DATA_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    # every partition method offers it beside its own router, through the API and the CLI
    assert "up_centroid" in seen["choices"]["expertweaver"] and "up_centroid" in seen["choices"]["cmoe"]
    assert seen["choices"]["expertweaver"][0] == "centroid" and seen["choices"]["cmoe"][0] == "representative"
    assert seen["body"]["router"] == "up_centroid" and "up_centroid" in seen["cli"]
    # the designer's router dropdown lists it, and shows it chosen from the URL
    assert "up_centroid" in seen["panel"]
    # the runtime keeps its parameter on the block and counts its scoring like the plan does
    assert seen["keys"] == ["router_up_centroid"] and seen["scores"] and seen["finite"]
    assert seen["macs"][0] == seen["macs"][1]
