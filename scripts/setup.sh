#!/usr/bin/env bash
# Installs what Colibri needs on a fresh Debian machine, idempotently:
# system packages with apt-get (only those missing), then the project and its
# test dependencies with pip into .venv at the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."

need_pkgs=()
have() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
# clang-16 + libclang-rt-16-dev: libFuzzer and the sanitizers for fuzz/ (make fuzz, make fuzz-smoke).
# gcc-aarch64-linux-gnu + libc6-dev-arm64-cross + qemu-user: the AArch64 NEON build and its
# C test drivers under qemu-aarch64 (tests/kernels/test_kernels_aarch64.py). pkgconf: colibri.pc (tests/edge/test_edge_libcolibri.py).
# gcc-riscv64-linux-gnu + libc6-dev-riscv64-cross: the sysroot and binutils of the RISC-V builds
# (compiled by clang-16: GCC 12 has no RVV intrinsics), run under qemu-riscv64 (tests/kernels/test_kernels_riscv.py).
# valgrind: callgrind counts the x86-64 kernels' instructions with and without the index bounds (bench/host_insns.py).
# time: GNU time, the peak RSS of the C processes `make bench-lm` compares (bench/lm_vs_llama_cpp.py).
# bible-kjv: the King James text (bible-kjv-text) and the `bible` program that decompresses it,
# the tiny language model's training and held-out text (examples/tiny_lm, tests/lm/test_lm_tiny.py).
for pkg in make gcc libc6-dev cmake gcc-arm-none-eabi libnewlib-arm-none-eabi qemu-system-arm \
           clang-16 libclang-rt-16-dev gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user pkgconf \
           gcc-riscv64-linux-gnu libc6-dev-riscv64-cross \
           bible-kjv bible-kjv-text time valgrind; do
    have "$pkg" || need_pkgs+=("$pkg")
done
# A Python with venv and headers: Debian's, unless the machine already has one.
if ! python3 -c 'import venv, ensurepip, sysconfig, os; assert os.path.exists(sysconfig.get_paths()["include"] + "/Python.h")' 2>/dev/null; then
    need_pkgs+=(python3 python3-venv python3-dev)
fi
if [ ${#need_pkgs[@]} -gt 0 ]; then
    echo "setup: installing system packages: ${need_pkgs[*]}"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${need_pkgs[@]}"
fi

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
stamp=.venv/.colibri-installed
# The dependencies: reinstalled when the project's description changes.
deps_hash=$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$deps_hash" ]; then
    echo "setup: installing Python packages into .venv"
    .venv/bin/pip install -q --upgrade pip
    # The build backend in the venv itself, so the binding can be rebuilt without build isolation.
    .venv/bin/pip install -q "setuptools>=77" wheel
    # torch is pinned: 2.13.0 is the CPU build; anything looser pulls a multi-GB CUDA build.
    .venv/bin/pip install -q "torch==2.13.0"
    .venv/bin/pip install -q -e ".[test,examples,gguf]"
    echo "$deps_hash" > "$stamp"
fi
# The bench's peers (make bench sets COLIBRI_BENCH=1): ONNX Runtime, LiteRT, TFLM and the
# converters, about 1 GB that `make test` does not need, so only when asked.
bench_stamp=.venv/.colibri-bench-installed
if [ "${COLIBRI_BENCH:-0}" = 1 ] && { [ ! -f "$bench_stamp" ] || [ "$(cat "$bench_stamp")" != "$deps_hash" ]; }; then
    echo "setup: installing the bench extra (ONNX Runtime, LiteRT, TFLM, converters) into .venv"
    .venv/bin/pip install -q --no-build-isolation -e ".[bench]"
    echo "$deps_hash" > "$bench_stamp"
fi
# The CPython binding: rebuilt (only it, a few seconds) whenever the engine or
# binding sources differ from those it was built from, e.g. after any C edit.
if ! .venv/bin/python scripts/source_hash.py check >/dev/null; then
    echo "setup: rebuilding the CPython binding (colibri.runtime._engine): its C sources changed"
    .venv/bin/pip install -q --no-build-isolation --no-deps -e .
    .venv/bin/python scripts/source_hash.py check
fi
# Rust (bindings/rust, tests/bindings/test_bindings_rust.py): not a Debian package here; the bindings need a
# toolchain with `cargo` (any channel; no crates from a registry). Reported, not installed.
if ! command -v cargo >/dev/null && [ ! -x "$HOME/.cargo/bin/cargo" ]; then
    echo "setup: cargo not found: tests/bindings/test_bindings_rust.py will be skipped. Install Rust with rustup:"
    echo "       curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y"
fi
