"""The GPU decode kernels (``moelab_triton``) checked where CI runs: Triton's interpreter executes the same kernels on
CPU tensors (``TRITON_INTERPRET=1``, read when the kernels are built, so in a child process), and their output is the
reference loop's for both activations, every combine, one to eight tokens, and sizes that leave partial blocks and
several reduction splits. Where the kernels do not apply, ``triton`` runs the torch ``gather`` kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moelab.engine.runtime import moelab_triton
from moelab.engine.runtime.moelab_moe import MoeFFN

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not moelab_triton.available(), reason="triton is not installed (the test extra has it)")

CHILD = r"""
import json, sys, torch
from moelab.engine.runtime.moelab_moe import MoeFFN
from moelab.engine.runtime import moelab_triton
assert moelab_triton.interpreted()
out = []
for act, combine, d, m, E, k, shared in json.loads(sys.argv[1]):
    torch.manual_seed(len(out))
    mod = MoeFFN({"kind": "moe", "d_model": d, "act": act, "d_shared": shared, "n_routed": E, "expert_size": m,
                  "top_k": k, "router": "ridge", "combine": combine}).eval()
    mod.reset_parameters(1.0)
    for tokens in (1, 3, 8):
        x = torch.randn(tokens, d)
        with torch.no_grad():
            mod.experts_impl = "loop"
            ref = mod(x)
            mod.experts_impl = "triton"
            chosen = mod.experts.resolve_impl(x, torch.zeros(tokens, k, dtype=torch.long), False)
            got = mod(x)
        out.append({"case": [act, combine, d, m, E, k, tokens], "kernel": chosen,
                    "rel_err": float((got - ref).abs().max() / ref.abs().max())})
print(json.dumps(out))
"""

CASES = [
    ["silu", "sum", 40, 12, 6, 2, 8],  # one block each way
    ["silu", "weighted", 200, 100, 5, 3, 0],  # partial blocks; d split over several programs
    ["gelu_pytorch_tanh", "normalized", 130, 70, 7, 4, 16],
    ["silu", "scaled", 96, 24, 16, 5, 0],
]


def test_the_interpreted_kernels_equal_the_reference_loop():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(CASES)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == 3 * len(CASES)
    for r in results:
        assert r["kernel"] == "triton", r
        assert r["rel_err"] < 1e-5, r


@pytest.mark.parametrize("change", ["down_keep", "gate_mass", "cpu"])
def test_where_the_kernels_do_not_apply_triton_runs_gather(change):
    """Outside the interpreter a CPU call, a ``down_keep`` below 1 (a GPU GEMV gains nothing from skipping scattered
    rows) and the gate-mass router (its gate activations are handed in) take ``gather``, and give the loop's output."""
    spec = {"kind": "moe", "d_model": 32, "d_shared": 8, "n_routed": 8, "expert_size": 16, "top_k": 3,
            "router": "gate_mass" if change == "gate_mass" else "ridge", "combine": "sum",
            **({"down_keep": 0.5} if change == "down_keep" else {})}
    mod = MoeFFN(spec).eval()
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(3))
    assert not moelab_triton.usable(mod.experts, x, None if change != "gate_mass" else x)
    with torch.no_grad():
        mod.experts_impl = "loop"
        ref = mod(x)
        mod.experts_impl = "triton"
        assert mod.experts.resolve_impl(x, torch.zeros(2, 3, dtype=torch.long), False) == "gather"
        torch.testing.assert_close(mod(x), ref, rtol=1e-5, atol=1e-5)
