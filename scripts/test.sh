#!/usr/bin/env bash
# Install, then run the whole test-suite (real model, real data; no network needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# The browser tests (tests/frontend) drive Debian's Chromium through Playwright (never
# `playwright install`, which downloads a browser): install it once when it is missing.
if [ ! -x /usr/bin/chromium ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium chromium-driver
fi
# shellcheck disable=SC1091
. .venv/bin/activate
# Two pytest-xdist workers share the cores (tests/conftest.py gives each its share of the threads): much of the
# suite waits on processes, browsers and imports, which then overlap. The tests marked serial (tests/conftest.py:
# timing and browser tests) run alone afterwards. Exit status 5 (nothing selected, e.g. with -k) is not a failure.
status=0
python -m pytest tests -q -n "${MOELAB_TEST_WORKERS:-2}" --dist loadfile -m "not serial" "$@" || status=$?
[ "$status" -eq 5 ] && status=0
serial=0
python -m pytest tests -q -m serial "$@" || serial=$?
[ "$serial" -eq 5 ] && serial=0
[ "$status" -ne 0 ] && exit "$status"
exit "$serial"
