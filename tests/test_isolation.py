"""The suite keeps to its own directory (tests/isolation.py): every process it starts has its home, data dir
and caches under the suite's folder, and a run that writes into the user's real home fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REAL_HOME, REPO
from tests.isolation import changes, snapshot, suite_paths

CHILD = """
import json, os
from pathlib import Path
from huggingface_hub import constants
from moelab.settings import get_settings
print(json.dumps({"home": str(Path.home()), "data": str(get_settings().data_dir), "hf": constants.HF_HOME,
                  "moelab_vars": sorted(k for k in os.environ if k.startswith("MOELAB_") and not k.startswith("MOELAB_TEST_"))}))
"""


def test_this_process_and_its_children_keep_to_the_suites_directory():
    suite = suite_paths(REPO)
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, cwd=REPO)
    seen = json.loads(out.stdout)
    assert Path(seen["home"]) == suite["home"] and Path(seen["data"]) == suite["data"]
    assert Path(seen["hf"]).is_relative_to(suite["home"])
    # nothing from the user's shell points elsewhere; the suite's own: its data dir, its short speed protocol and
    # no kernel timing after a CLI profile
    assert seen["moelab_vars"] == ["MOELAB_DATA_DIR", "MOELAB_SPEED_DECODE_STEPS", "MOELAB_SPEED_PREFILL_TOKENS",
                                   "MOELAB_SPEED_REPEATS", "MOELAB_TIME_KERNELS"]
    assert Path.home() == suite["home"] and REAL_HOME != suite["home"]


def test_the_guard_names_what_a_run_created_changed_or_removed(tmp_path):
    home = tmp_path / "home"
    (home / ".cache" / "pip").mkdir(parents=True)
    (home / ".cache" / "pip" / "old").write_text("x")
    (home / ".pyenv" / "lib").mkdir(parents=True)
    (home / ".bashrc").write_text("# rc")
    before = snapshot(home)
    assert changes(before, snapshot(home)) == []
    (home / ".local" / "share" / "moelab").mkdir(parents=True)
    (home / ".local" / "share" / "moelab" / "moelab.db").write_text("rows")
    (home / ".cache" / "huggingface" / "hub").mkdir(parents=True)
    (home / ".cache" / "pip" / "old").write_text("longer")
    (home / ".triton").mkdir()
    (home / ".bashrc").unlink()
    (home / ".pyenv" / "lib" / "inside").write_text("a user's own tree is watched by its top-level name only")
    assert changes(before, snapshot(home)) == [
        "changed .cache/pip/old", "created .cache/huggingface", "created .cache/huggingface/hub", "created .local",
        "created .local/share", "created .local/share/moelab", "created .local/share/moelab/moelab.db",
        "created .triton", "removed .bashrc",
    ]


def test_a_run_that_writes_into_the_home_fails_and_says_where(tmp_path):
    """A nested pytest whose HOME is a fresh folder: its one test passes, yet the run fails on the guard."""
    home = tmp_path / "home"
    home.mkdir()
    leak = home / ".local" / "share" / "moelab" / "leak.txt"
    # a fresh run, not an xdist worker of this one (which would take the controller's home from the environment)
    drop = {"MOELAB_DATA_DIR", "MOELAB_TEST_REAL_HOME", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(HOME=str(home), MOELAB_TEST_LEAK_TO=str(leak), MOELAB_TEST_DATA_DIR=str(tmp_path / "suite" / "test-data"))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/fixtures/leak_probe.py"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert "1 passed" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 1, done.stdout
    assert f"the suite reached outside its directory, into {home}" in done.stdout
    assert "created .local/share/moelab/leak.txt" in done.stdout
    assert not (tmp_path / "suite" / "test-home" / ".local" / "share" / "moelab").exists()
