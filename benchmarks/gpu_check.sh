#!/bin/bash
# The GPU checks of one lent machine, in one go (docs/contributing.md, "GPU tests"):
#   1. the pinned llama.cpp built with CUDA and shared libraries, its ggml installed (skipped when installed);
#   2. pydflash built against that ggml (PYDFLASH_USE_SYSTEM_GGML): one CUDA ggml for both engines;
#   3. `pytest -m gpu -s`, then bench_moe.py and bench_tree.py on the GPU (-ngl -1) against llama.cpp.
#
#   bash benchmarks/gpu_check.sh [OUT]      # logs in OUT (default build/gpu-check)
#
# Environment: LLAMA_SRC (the unpacked llama.cpp tree; default: vendor/ggml/fetch.py's), CUDA_ARCH (default 90),
# GGML_PREFIX (the ggml install, default OUT/ggml-cuda), LLAMA_BUILD (its build folder, default OUT/llama-cuda),
# LIMIT (seconds for the whole run, default 570: each stage stops at its share so that what ran is logged).
# On 16 cores step 1 took 216 s, step 2 22 s (an H200, 2026-11-26).
# python3 needs what `pip install --no-build-isolation` of this project needs (scikit-build-core, pybind11, gguf,
# ...); on a machine that cannot download, bring their wheels.
set -u
OUT=${1:-build/gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
T0=$(date +%s)
LIMIT=${LIMIT:-570}
ts() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/stages.txt"; }
budget() { local b=$(( LIMIT - ($(date +%s) - T0) - $1 )); [ $b -lt 30 ] && b=30; echo $b; }
L=${LLAMA_SRC:-$(python3 vendor/ggml/fetch.py llama.cpp | tail -1)}
P=${GGML_PREFIX:-$OUT/ggml-cuda}
BUILD=${LLAMA_BUILD:-$OUT/llama-cuda}
ts "start: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null), $(nproc) cores"
if [ ! -f "$P/lib/cmake/ggml/ggml-config.cmake" ]; then
    ts "llama.cpp + ggml (CUDA)"
    # (AMX tile instructions fault on the machines this project runs on: benchmarks/peer.py)
    NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cmake -S "$L" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_CUDA=ON \
        -DCMAKE_INSTALL_LIBDIR=lib -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DGGML_RPC=ON -DGGML_OPENMP=OFF \
        -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
        "-DCMAKE_C_FLAGS=$NOAMX" "-DCMAKE_CXX_FLAGS=$NOAMX" > "$OUT/build-peer.log" 2>&1 \
    && cmake --build "$BUILD" --target ggml ggml-rpc llama-completion llama-speculative-simple \
        >> "$OUT/build-peer.log" 2>&1 \
    && cmake --install "$BUILD/ggml" --prefix "$P" >> "$OUT/build-peer.log" 2>&1 \
    || { ts "llama.cpp build failed"; tail -30 "$OUT/build-peer.log"; exit 1; }
fi
ts "pydflash against $P"
PYDFLASH_GGML_DIR="$L/ggml" CMAKE_ARGS="-DPYDFLASH_USE_SYSTEM_GGML=ON -Dggml_DIR=$P/lib/cmake/ggml" \
    python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build-ours.log" 2>&1 \
    || { ts "pydflash build failed"; tail -30 "$OUT/build-ours.log"; exit 1; }
ts "pytest -m gpu"
timeout "$(budget 240)" python3 -m pytest -m gpu -s -q -p no:cacheprovider tests/test_gpu.py 2>&1 \
    | tee "$OUT/pytest-gpu.log" | grep -v "^E  " | tail -40
export PYDFLASH_PEER_BUILD=$BUILD
ts "bench_moe (qwen35moe q4mix)"
timeout "$(budget 100)" python3 benchmarks/bench_moe.py --pairs realistic --types q4mix --archs qwen35moe \
    --tables 2 --threads 8 -ngl -1 --cache-dir "$OUT/inflated" --n-prompts 6 2>&1 | grep -v Writing \
    | tee "$OUT/bench-moe.log" | tail -16
ts "bench_tree (qwen35 q4mix)"
timeout "$(budget 5)" python3 benchmarks/bench_tree.py --pairs realistic --kinds q4mix --archs qwen35 \
    --threads 8 -ngl -1 --cache-dir "$OUT/inflated" --n-prompts 6 --engines "plain,chain 4,chain 8,tree 16,auto" \
    2>&1 | grep -v Writing | tee "$OUT/bench-tree.log" | tail -14
ts "done"
