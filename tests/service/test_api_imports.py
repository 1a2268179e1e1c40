"""The API process never loads torch (PRODUCT.md: "the backend never runs torch in the request
path"): its import alone costs seconds and hundreds of MB, and a request that needed it would
be a model run in the wrong process."""

from __future__ import annotations

import json
import subprocess
import sys

from .helpers import REPO, env_for

PROBE = """
import json, sys
from fastapi.testclient import TestClient
import backend.app
from backend.app import create_app
from moelab.settings import Settings

after_import = sorted(m for m in ("torch", "transformers") if m in sys.modules)
with TestClient(create_app(Settings(_env_file=None))) as c:
    statuses = [c.get(path).status_code for path in ("/api/v1/health", "/api/v1/methods", "/api/v1/models",
                                                     "/api/v1/calibration-sets/builtins")]
print(json.dumps({"after_import": after_import, "statuses": statuses,
                  "after_requests": sorted(m for m in ("torch", "transformers") if m in sys.modules)}))
"""


def test_the_api_imports_and_answers_without_torch(service_config):
    out = subprocess.run([sys.executable, "-c", PROBE], env=env_for(service_config, MOELAB_API_TOKEN=""), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["after_import"] == [], f"importing backend.app loaded {seen['after_import']}"
    assert all(s < 500 for s in seen["statuses"]), seen
    assert seen["after_requests"] == [], f"answering requests loaded {seen['after_requests']}"
