#!/usr/bin/env bash
# Installs llama.cpp (through its PyPI bindings, pinned) into a venv in the cache dir.
# Usage: bash benches/compare/setup.sh        (takes ~10-20 min on 2 cores: it compiles llama.cpp)
set -euo pipefail
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/llama-graph/compare"
VENV="$CACHE/venv"
PY="${PYTHON:-python3}"
mkdir -p "$CACHE"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# Native build (AVX2/FMA as detected on this machine), like a user building llama.cpp locally.
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAMA_CURL=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
"$VENV/bin/python" -m pip install --no-cache-dir -v "llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION}" numpy psutil
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
