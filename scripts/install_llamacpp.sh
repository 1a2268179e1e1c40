#!/usr/bin/env bash
# llama.cpp for the GGUF export and its tests: llama-cpp-python built from its PyPI sdist (which
# bundles llama.cpp, its converter convert_hf_to_gguf.py and gguf-py), and the converter and the
# gguf-py it is written against (newer than PyPI's gguf of the same version number) installed
# beside it. The build needs no network beyond PyPI (curl is off in its CMake) and
# takes several minutes on two cores, so the built wheels are cached: a second install is quick.
# Run by scripts/install.sh inside the activated .venv.
set -euo pipefail
VERSION=0.3.36
# built for this CPU (-march=native): the cache is keyed by the CPU's feature flags
CPU=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | sha256sum | cut -c1-12)
CACHE=${MOELAB_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/moelab/wheels/$CPU}
mkdir -p "$CACHE"
have() { ls "$CACHE"/$1 >/dev/null 2>&1; }
if ! have "llama_cpp_python-$VERSION-*.whl" || ! have "llama_cpp_scripts-*.whl" || ! have "gguf-*.whl"; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  python -m pip install -q "scikit-build-core>=0.9.2" "poetry-core>=1.0.0"
  python -m pip download -q --no-deps --no-binary :all: "llama_cpp_python==$VERSION" -d "$work"
  if ! have "llama_cpp_python-$VERSION-*.whl"; then
    # The shared library only: no llava/mtmd, tools, examples or tests (the bindings need none of
    # them). No AMX: a CPU may list AMX while its kernel or hypervisor does not grant the tiles
    # (seen here: q8_0 matmuls died with SIGILL); GCC keeps an explicit -mno-* over -march=native.
    CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" CXXFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
    CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" \
      CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
      python -m pip wheel -q --no-deps --no-build-isolation -w "$CACHE" "$work/llama_cpp_python-$VERSION.tar.gz"
  fi
  tar -xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work" "llama_cpp_python-$VERSION/vendor/llama.cpp"
  for pkg in vendor/llama.cpp vendor/llama.cpp/gguf-py; do
    python -m pip wheel -q --no-deps --no-build-isolation -w "$CACHE" "$work/llama_cpp_python-$VERSION/$pkg"
  done
fi
# The converter's own pins (transformers 4.57, torch 2.11) are not taken: it runs with this venv's.
# --force-reinstall: a wheel rebuilt at the same version (other build flags) must replace the installed one
python -m pip install -q --no-deps --force-reinstall "$CACHE"/llama_cpp_scripts-*.whl "$CACHE"/gguf-*.whl \
  "$CACHE"/llama_cpp_python-$VERSION-*.whl
python -m pip install -q "$CACHE"/llama_cpp_python-$VERSION-*.whl "sentencepiece>=0.2"
