"""torch's OpenMP threads spin briefly (``moelab/openmp.py``): ``import moelab`` sets ``GOMP_SPINCOUNT`` unless the user
did, and every process moelab starts (the CLI, the API, the Celery workers) imports moelab before torch, which is when
libgomp reads it. What the spin buys on a shared machine is measured by ``tests/benchmarks/bench_busy_machine.py``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moelab.openmp import SPIN_COUNT
from tests.conftest import REPO


def _python(args: list[str], **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    return subprocess.run([sys.executable, *args], env={**base, **env}, cwd=REPO, capture_output=True, text=True, check=True)


def test_import_sets_the_spin_and_keeps_the_users():
    show = ["-c", "import os, moelab; print(os.environ['GOMP_SPINCOUNT'])"]
    assert _python(show).stdout.strip() == SPIN_COUNT
    assert _python(show, GOMP_SPINCOUNT="77").stdout.strip() == "77"
    assert int(SPIN_COUNT) < 300_000  # libgomp's own default, which the setting exists to undercut


@pytest.mark.parametrize("entry", ["moelab.cli", "workers.celery_app", "backend.app"])
def test_each_entry_point_imports_moelab_before_torch(entry):
    """``-X importtime`` lists a module when its import finishes: moelab's line before torch's first means libgomp, which
    torch loads, started with the spin set."""
    lines = _python(["-X", "importtime", "-c", f"import {entry}, torch"]).stderr.splitlines()
    names = [line.rsplit("|", 1)[-1].strip() for line in lines if "|" in line]
    assert "moelab" in names and "torch" in names
    first_torch = min(i for i, n in enumerate(names) if n == "torch" or n.startswith("torch."))
    assert names.index("moelab") < first_torch, (entry, names[first_torch - 3: first_torch + 1])
