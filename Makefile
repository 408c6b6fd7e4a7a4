# Colibri: `make demo` runs the main job, `make test` runs every test.
# Both set up what they need first (scripts/setup.sh: apt-get + .venv).

PY := .venv/bin/python
CORE := firmware/colibri_core

.PHONY: setup demo test check lint engine engine-all c-tests firmware header measure clean fuzz \
        fuzz-smoke fuzz-checkpoints bench bench-q4 bench-exec libs install bench-riscv-insns bench-edge-mmap \
        bench-edge-mmap-full bench-edge-jitter bench-quant bench-hf-export bench-hf-export-full upstream-check \
        train-tiny-lm demo-lm evaluate-tiny-lm bench-edge-load bench-lm-threads bench-blocks bench-crc \
        bench-lm-open bench-lm bench-lm-setup bench-lm-gguf bench-lm-quick bench-lm-scale bench-lm-prefill bench-lm-gemm bench-lm-stream \
        bench-host-insns bench-pool

setup:
	./scripts/setup.sh

# The C engine: host library, sanitizer builds, the Cortex-M7, the AArch64 (NEON) and the RISC-V
# (RVV, and scalar rv64gc) libraries.
engine:
	$(MAKE) -C $(CORE)

engine-all:
	$(MAKE) -C $(CORE) all-variants

# The Linux libraries: libcolibri.a and libcolibri.so (host and aarch64), and their install
# (make install PREFIX=/usr/local [VARIANT=aarch64] [DESTDIR=]): docs/libcolibri.md.
libs:
	$(MAKE) -C $(CORE) host aarch64 shared-host shared-aarch64

install:
	$(MAKE) -C $(CORE) install $(if $(PREFIX),PREFIX=$(PREFIX)) $(if $(VARIANT),VARIANT=$(VARIANT))

c-tests: engine-all
	$(MAKE) -C tests/c VARIANT=host
	$(MAKE) -C tests/c VARIANT=asan
	$(MAKE) -C tests/c VARIANT=tsan
	$(MAKE) -C tests/c VARIANT=aarch64
	$(MAKE) -C tests/c VARIANT=riscv64
	$(MAKE) -C tests/c VARIANT=riscv64gc

# The runner firmware: QEMU's mps2-an500 (the test target) and the NUCLEO-H743ZI.
firmware: engine-all
	$(MAKE) -C firmware/runner BOARD=mps2_an500
	$(MAKE) -C firmware/runner BOARD=nucleo_h743zi

header: setup
	.venv/bin/colibri gen-header

# Every deterministic figure, measured (scripts/measure.py): rewrites docs/measured.md whole and README.md's
# headline table from it; tests/docs/test_docs_measured.py fails when the page is stale (docs/testing.md).
measure: setup firmware
	$(PY) scripts/measure.py

# The smart meter story: train (or reuse) the forecaster, quantise, boot the
# runner in QEMU, put the model on the board, forecast on target.
demo: setup firmware
	$(PY) examples/smart_meter/demo.py

# The tiny King James MoE language model (examples/tiny_lm): retrains it from scratch and
# overwrites the committed weights and metrics.json (tens of minutes on 1 core; CI never runs it,
# tests/lm/test_lm_tiny.py checks the committed model).
train-tiny-lm: setup
	$(PY) examples/tiny_lm/train.py --steps 1500 --seed 0

# The tiny King James model through the C engine: export it (cached in build/tiny_lm), then
# stream a greedy continuation of a KJV verse with `colibri generate`.
demo-lm: setup
	$(PY) examples/tiny_lm/demo.py

# Held-out perplexity per weight dtype, image and arena bytes, host decode tokens/s.
evaluate-tiny-lm: setup
	$(PY) examples/tiny_lm/evaluate.py

# The builds, the C drivers' compile and the CI-sized fuzz runs side by side on every core (they
# are independent once setup is done), each target's output kept together; then pytest on 2 workers.
NPROC := $(shell nproc 2>/dev/null || echo 2)
test: setup
	$(MAKE) -j$(NPROC) --output-sync=target c-tests firmware fuzz-smoke
	.venv/bin/pytest -n 2 --durations=25

# What a developer runs after each change: the host engine, the format, export and
# quantisation, the reference, the CLI and the bindings on the host, in a few minutes. It leaves out the
# tests pyproject.toml marks as slow or needing QEMU, a cross toolchain, a sanitizer build, MicroPython,
# cargo, PlatformIO or upstream trees; `make test` runs those too.
CHECK_MARKERS := not slow and not qemu and not cross and not sanitizer and not micropython and not rust \
                 and not platformio and not upstream
check: setup
	.venv/bin/pytest -n 2 -q -m "$(CHECK_MARKERS)" --durations=15

# The style the tree is held to (CONTRIBUTING.md, "Style"): ruff's lint and format for Python, clang-format for
# the project's C (.clang-format names the folders). Not yet part of `make check`: the tree is formatted once, in
# a commit of its own, and only then can `check` call this.
C_SOURCES = git ls-files -z -- 'firmware/*.[ch]' 'boards/*.[ch]' 'micropython_module/*.[ch]' 'tests/c/*.[ch]' \
            'bench/*.[ch]' 'examples/*.[ch]'
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	$(C_SOURCES) | xargs -0 clang-format --dry-run --Werror

# Fuzzing (fuzz/README.md): the engine, the runner's frame handler and the
# C-vs-Python validator comparison, each for a stated number of executions.
FUZZ_RUNS ?= 1000000
SMOKE_RUNS ?= 100000

fuzz: setup
	$(MAKE) -C fuzz fuzz-all RUNS=$(FUZZ_RUNS)

fuzz-smoke: setup
	$(MAKE) -C fuzz fuzz-all RUNS=$(SMOKE_RUNS)

# The GGUF and safetensors readers' error paths (tests/export/test_export_checkpoint_fuzz.py, CI: 1000
# cases each): CHECKPOINT_CASES mutated files each, every one a written image or a one-line ColibriError.
# COLIBRI_FUZZ_SEED picks another sequence; a failing case is kept beside the run and named.
CHECKPOINT_CASES ?= 20000

fuzz-checkpoints: setup
	COLIBRI_FUZZ_CHECKPOINTS=$(CHECKPOINT_CASES) .venv/bin/pytest -n 2 -q -rP \
	  tests/export/test_export_checkpoint_fuzz.py

# Colibri beside PyTorch, ONNX Runtime, LiteRT and TFLM, one thread each (bench/bench.py):
# the bench extra is installed only here; build/bench/ gets the table's JSON and bench.png.
BENCH_CFLAGS := -std=c11 -Wall -Wextra -Werror -pedantic -O2 -D_POSIX_C_SOURCE=200809L -ffp-contract=off -fno-math-errno

build/bench/colibri_bench: bench/colibri_bench.c tests/c/colibri_common.h engine
	mkdir -p build/bench
	gcc $(BENCH_CFLAGS) -I$(CORE)/include $< $(CORE)/build/host/libcolibri.a -lm -o $@

# q4 against q8 and f32 on one wide layer, kernel calls alone (bench/q4_kernels.c): µs per call, batch 1 and 8.
build/bench/q4_kernels: bench/q4_kernels.c tests/c/colibri_rng.h engine
	mkdir -p build/bench
	gcc $(BENCH_CFLAGS) -I$(CORE)/include -I$(CORE)/src $< $(CORE)/build/host/libcolibri.a -lm -o $@

bench-q4: build/bench/q4_kernels
	./build/bench/q4_kernels

# The block form of int8 activations against f32 and per-row int8 activations on the expert layers of
# the 100 M-class Mixtral (bench/block_kernels.c): µs and weight GB/s per call, every x86 level, and
# the single-core read rate.
build/bench/block_kernels: bench/block_kernels.c engine
	mkdir -p build/bench
	gcc $(BENCH_CFLAGS) -I$(CORE)/include -I$(CORE)/src $< $(CORE)/build/host/libcolibri.a -lm -o $@

bench-blocks: build/bench/block_kernels
	./build/bench/block_kernels

# The engine's CRC-32 against zlib's (bench/crc_bench.c): MB/s of the microcontroller build's nibble loop
# and of the Linux build's slicing-by-8 (COLIBRI_CRC_SLICING), the same colibri_image.c built both ways.
build/bench/crc_bench_%: bench/crc_bench.c $(CORE)/src/colibri_image.c engine
	mkdir -p build/bench
	gcc $(BENCH_CFLAGS) -DCOLIBRI_CRC_SLICING=$* -I$(CORE)/include -I$(CORE)/src bench/crc_bench.c \
	  $(CORE)/src/colibri_image.c $(filter-out %/colibri_image.o,$(wildcard $(CORE)/build/host/obj/*.o)) -lz -lm -o $@

bench-crc: build/bench/crc_bench_0 build/bench/crc_bench_1
	./build/bench/crc_bench_0
	./build/bench/crc_bench_1

# Opening model files (issue 27, bench/lm_open.py): open time, RSS growth and time to the first output of a
# token model and a feature model of ~100-400 MB, warm and cold page cache (posix_fadvise DONTNEED), by
# default (structure at open, payloads on first use) against verify="full"; prefetch-ahead on and off.
bench-lm-open: setup
	$(PY) bench/lm_open.py

# Instructions per multiply-accumulate of the meter and edge models' linear layers under
# qemu-riscv64 (counted by a TCG plugin): RVV at VLEN 128 and 256 vs the scalar rv64gc build.
bench-riscv-insns: setup
	$(PY) bench/riscv_insns.py

# What the index bounds cost the x86-64 kernels (docs/threading.md): the edge model's instructions per
# forward under valgrind's callgrind, the library as shipped against its nobounds build.
bench-host-insns: setup
	$(PY) bench/host_insns.py

# What one parallel loop of posix/colibri_pool costs beyond its work (bench/pool_bench.c, docs/threading.md
# "The pool"): decode-sized loops (44 and 8 tasks of 3 us, 2 workers) back to back, median and best of 15.
build/bench/pool_bench: bench/pool_bench.c engine
	mkdir -p build/bench
	gcc $(BENCH_CFLAGS) -I$(CORE)/include -I$(CORE)/posix $< $(CORE)/build/host/libcolibri.a -lm -pthread -o $@

bench-pool: build/bench/pool_bench
	./build/bench/pool_bench 2 44 3000 2000 15
	./build/bench/pool_bench 2 8 3000 2000 15

# Parallel experts (colibri_forward_ex + posix/colibri_pool) against one thread, edge model, batch 1/8/64.
bench-exec:
	$(PY) bench/exec_bench.py

# Token models' prefill (64 tokens in one call) and decode tok/s, one thread, per dtype with and without
# INT8_BLOCKS (bench/lm_prefill.py; exports cached in build/bench/lm_prefill/). BASELINE=DIR (a host_tools
# directory of another checkout, its binding built) measures it beside this one, alternating.
bench-lm-prefill: setup
	$(PY) bench/lm_prefill.py $(if $(BASELINE),--engine $(BASELINE) --engine host_tools)

# The linear kernels at prefill batch sizes (1, 16, 64 tokens) on the 100 M-class Mixtral's layers, per
# dtype and activation form, AVX2 and the best x86 level (bench/lm_gemm.c): MAC/ns of thread CPU time.
build/bench/lm_gemm: bench/lm_gemm.c engine
	mkdir -p build/bench
	gcc $(BENCH_CFLAGS) -I$(CORE)/include -I$(CORE)/src $< $(CORE)/build/host/libcolibri.a -lm -o $@

bench-lm-gemm: build/bench/lm_gemm
	./build/bench/lm_gemm

# One token's pass over expert-sized matrices read from memory (96 of each dtype, 1408x512), GB/s per dtype
# beside the core's plain read rate: whether the decode kernels keep up with memory on this CPU.
bench-lm-stream: build/bench/lm_gemm
	./build/bench/lm_gemm --stream

# Token models on threads (colibri_lm_forward_ex + posix/colibri_pool): decode and prefill tok/s at 1 and
# 2 workers, a random 148 M-parameter Mixtral (f32, q8) and the tiny King James model; exports are cached.
bench-lm-threads: setup
	$(PY) bench/lm_threads.py

# Colibri beside llama.cpp on MoE language models (issue 23, bench/lm_vs_llama_cpp.py, docs/benchmarks.md
# "make bench-lm"): logits against Hugging Face, decode and prefill tok/s at 1 and 2 threads, peak RSS of a C
# process on each side, file bytes, King James perplexity; table on stdout, chart in build/bench-lm/bench_lm.png.
# bench-lm-setup installs the bench extra and builds llama.cpp from the llama-cpp-python sdist (10-15 min on 2
# cores, once: build/llama.cpp). bench-lm-quick is the CI-sized run (the tiny model, few tokens).
bench-lm-setup: setup
	COLIBRI_BENCH=1 ./scripts/setup.sh
	./scripts/llama_cpp_setup.sh

bench-lm: bench-lm-setup
	$(PY) bench/lm_vs_llama_cpp.py

bench-lm-quick: bench-lm-setup
	$(PY) bench/lm_vs_llama_cpp.py --quick

# The 7 B-parameter scenario (issue 27, bench/lm_scale.py, docs/benchmarks.md "make bench-lm-scale"): a random
# Mixtral (hidden 2048, 24 layers, 8 experts x 5632, 7.0 B parameters) streamed to bf16 shards, exported by
# Colibri (q4, q8) and llama.cpp (Q4_0, Q8_0), each decoding 64 tokens from a cold cache in a memory cgroup of
# 4 GiB, 3 GiB and none, 1 and 2 threads; prints the disk it needs first (~45 GB; refuses when short), then each
# run and the issue's targets. Hours on 2 cores; files kept in build/bench-lm-scale/7b, reused by a rerun.
bench-lm-scale: bench-lm-setup
	nice $(PY) bench/lm_scale.py

# Colibri's GGUF import (colibri export model.gguf) on llama.cpp's own F32/F16/Q8_0/Q4_0 files (Q8_0/Q4_0
# llama-quantize --pure) of the bench's random models, against llama.cpp on the same file: max |dlogit|.
bench-lm-gguf: bench-lm-setup
	$(PY) bench/lm_vs_llama_cpp.py --gguf-import --models mixtral,qwen2moe,olmoe,tiny

# Mapped model files (issue 11, bench/edge_mmap.py): open and first output from a cold page cache,
# resident bytes and major faults per token with and without MADV_WILLNEED, and peak RSS against ONNX
# Runtime on the same weights (external-data ONNX; needs the bench extra). ~400 MB; -full ~1.6 GB.
bench-edge-mmap: setup
	$(PY) bench/edge_mmap.py

bench-edge-mmap-full: setup
	$(PY) bench/edge_mmap.py --layers 4 --experts 128

# colibri_edge under load (issue 25): 16 clients for 10 s, three times each at 0%, 25% and 50% hostile (garbage, silent,
# slow reader, slow writer, idle); p50/p99 of the well-behaved clients, their answers checked bit for bit,
# the service's RSS and fds over time, and whether it stayed up.
bench-edge-load: setup
	$(PY) bench/edge_load.py --repeat 3

# Latency jitter (p50/p99 per token) with and without mlock of the most used experts, without and under
# memory pressure (a cgroup v2, else v1, whose memory limit is below the model size; skipped, saying why,
# where there is none: bench/edge_jitter.py --cgroup DIR takes a delegated one), with and without
# MADV_WILLNEED. ~50 MB model: the random router's near-uniform routing, then a Zipf-like one (--skew 0.3,
# the hottest quarter of the experts taking most calls) where pinning them has something to win.
bench-edge-jitter: setup
	$(PY) bench/edge_jitter.py
	$(PY) bench/edge_jitter.py --skew 0.3

# A Hugging Face folder exported streamed vs in memory (issue 26, bench/hf_export.py): peak RSS (/usr/bin/time -v)
# and wall time of each, and the images compared byte for byte. A random Mixtral written shard by shard:
# ~600 MB f32 (hidden 512, 8 layers, 8 experts x 1408, GQA 8/2, vocab 4096); -full the issue's 2.3 GB folder
# (hidden 1024, 8 experts x 2816, 500 MB shards), streamed f32, q8 and q4 only (in memory it needs >10 GB), and
# where make bench-lm-setup built llama.cpp, its convert_hf_to_gguf.py (F32) + llama-quantize (Q8_0, Q4_0) beside.
# Seconds per weight matrix of quantize_q4 (the streamed export's cost at q4) and quantize_q8: an expert of the
# 2.3 GB folder (2816x1024) and of the 7 B model (5632x2048), beside the clip search's readable form (bench/quant_speed.py).
bench-quant: setup
	$(PY) bench/quant_speed.py --spec

bench-hf-export: setup
	$(PY) bench/hf_export.py --dtype q8 --dtype f32

bench-hf-export-full: setup
	$(PY) bench/hf_export.py --hidden 1024 --intermediate 2816 --shard-mb 500 --dtype f32 --dtype q8 --dtype q4 --no-in-memory \
		$(if $(wildcard build/llama.cpp/build/bin/llama-quantize),--llama-cpp)

bench: build/bench/colibri_bench firmware
	COLIBRI_BENCH=1 ./scripts/setup.sh
	$(PY) bench/bench.py

# Against upstream trees no registry has (docs/testing.md, "Upstream checks"): the FreeRTOS example
# built and run in QEMU on each kernel (':'-separated paths), the MicroPython module as a user C
# module of the unix and qemu ports and as a .mpy in the unix port built from that tree.
#   make upstream-check FREERTOS_KERNEL_PATH=/src/FreeRTOS-Kernel[:...] MICROPYTHON_PATH=/src/micropython
upstream-check:
	@test -n "$(FREERTOS_KERNEL_PATH)$(MICROPYTHON_PATH)" || { echo "set FREERTOS_KERNEL_PATH and/or MICROPYTHON_PATH (docs/testing.md, Upstream checks)" >&2; exit 1; }
	$(MAKE) setup
	FREERTOS_KERNEL_PATH="$(FREERTOS_KERNEL_PATH)" MICROPYTHON_PATH="$(MICROPYTHON_PATH)" \
	  .venv/bin/pytest -v -rs -n 2 --dist loadfile tests/target/test_target_freertos.py tests/micropython/test_micropython_upstream.py

clean:
	$(MAKE) -C $(CORE) clean
	$(MAKE) -C tests/c clean
	rm -rf firmware/runner/build
	rm -rf build *.egg-info host_tools/*.egg-info
