#!/usr/bin/env bash
# llama.cpp, the peer of `make bench-lm` (bench/lm_vs_llama_cpp.py), built from the source that PyPI's
# llama-cpp-python sdist vendors: that sdist is one pinned download through pip, and it carries the
# converter (convert_hf_to_gguf.py with its gguf-py) of the same commit as the engine.
#
#   ./scripts/llama_cpp_setup.sh          (or: make bench-lm-setup)
#
# Leaves build/llama.cpp/src (the vendored tree) and build/llama.cpp/build/bin/{llama-bench,
# llama-quantize,llama-simple}. Idempotent: does nothing when the binaries are there; remove
# build/llama.cpp to start again. On 2 cores the build takes 10-15 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.36
ROOT=build/llama.cpp
SRC=$ROOT/src
BIN=$ROOT/build/bin
TARGETS=(llama-bench llama-quantize llama-simple)
JOBS=${JOBS:-2}

built() { for t in "${TARGETS[@]}"; do [ -x "$BIN/$t" ] || return 1; done; }
if built && [ -f "$SRC/convert_hf_to_gguf.py" ]; then
    echo "llama.cpp: already built in $BIN"
    exit 0
fi
command -v cmake >/dev/null || { echo "llama.cpp: cmake not found (scripts/setup.sh installs it)" >&2; exit 1; }
PIP=".venv/bin/python -m pip"
.venv/bin/python -m pip --version >/dev/null 2>&1 || PIP="python3 -m pip"

mkdir -p "$ROOT"
sdist=$ROOT/llama_cpp_python-$VERSION.tar.gz
if [ ! -f "$sdist" ]; then
    echo "llama.cpp: downloading the llama-cpp-python $VERSION sdist from PyPI"
    $PIP download -q --no-deps --no-binary llama-cpp-python --dest "$ROOT" "llama-cpp-python==$VERSION"
fi
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    rm -rf "$ROOT/unpack" "$SRC"
    mkdir -p "$ROOT/unpack"
    tar -xzf "$sdist" -C "$ROOT/unpack"
    mv "$ROOT/unpack/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
    rm -rf "$ROOT/unpack"
    # The vendored tree's .git is a gitlink to a repository the sdist does not ship: CMake's version
    # probe would fail on it, so it goes aside and the build is named after the sdist instead.
    if [ -e "$SRC/.git" ]; then mv "$SRC/.git" "$SRC/.git-dangling"; fi
fi
# GGML_NATIVE=ON builds for this CPU, as Colibri's kernels pick this CPU's level at run time, but without
# AMX: a virtual machine may list the AMX flags without enabling their register state, and there the
# first tile instruction traps (SIGILL in llama.cpp's Q8_0/Q4_0 matrix kernels on the machine this was
# written on). Colibri has no AMX kernels, so both engines then use the same instruction sets.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$SRC" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
      -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
      -DGGML_BLAS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=ON \
      -DLLAMA_BUILD_COMMIT="llama-cpp-python-$VERSION" -DLLAMA_BUILD_NUMBER=0 >/dev/null
nice cmake --build "$ROOT/build" -j"$JOBS" --target "${TARGETS[@]}"
built
echo "llama.cpp: built in $BIN"
