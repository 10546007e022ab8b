#!/bin/bash
# The GPU checks of one lent machine, in one go (docs/contributing.md, "GPU tests"):
#   1. the pinned llama.cpp built with CUDA and shared libraries, its ggml installed (skipped when installed);
#   2. pydflash built against that ggml (PYDFLASH_USE_SYSTEM_GGML): one CUDA ggml for both engines;
#   3. `pytest -m gpu -s`, then on the GPU (-ngl -1) against llama.cpp: bench_moe.py (qwen35moe), bench_tree.py
#      (qwen35, its DFlash and its DFlash2 drafter) and bench_proposers.py (qwen35 with its MTP head).
#
#   bash benchmarks/gpu_check.sh [OUT]      # logs in OUT (default build/gpu-check)
#
# Environment: LLAMA_SRC (the unpacked llama.cpp tree; default: vendor/ggml/fetch.py's), CUDA_ARCH (default 90),
# GGML_PREFIX (the ggml install, default OUT/ggml-cuda; one built ahead skips step 1: docs/contributing.md),
# LLAMA_BUILD (its build folder, default OUT/llama-cuda; without bin/llama-speculative-simple our rows only),
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
export LD_LIBRARY_PATH="$P/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # (an installed ggml has no RPATH)
ts "pydflash against $P"
PYDFLASH_GGML_DIR="$L/ggml" CMAKE_ARGS="-DPYDFLASH_USE_SYSTEM_GGML=ON -Dggml_DIR=$P/lib/cmake/ggml" \
    python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build-ours.log" 2>&1 \
    || { ts "pydflash build failed"; tail -30 "$OUT/build-ours.log"; exit 1; }
ts "pytest -m gpu"
timeout "$(budget 170)" python3 -m pytest -m gpu -s -q -p no:cacheprovider tests/test_gpu.py 2>&1 \
    | tee "$OUT/pytest-gpu.log" | grep -v "^E  " | tail -40
export PYDFLASH_PEER_BUILD=$BUILD
PEER=()
[ -x "$BUILD/bin/llama-speculative-simple" ] || { ts "no llama.cpp in $BUILD/bin: ours only"; PEER=(--skip-peer); }
ts "bench_moe (qwen35moe q4mix)"
timeout "$(budget 120)" python3 benchmarks/bench_moe.py --pairs realistic --types q4mix --archs qwen35moe \
    --tables 2 --threads 8 -ngl -1 --cache-dir "$OUT/inflated" --n-prompts 6 --engines "chain 4,chain 8,auto" \
    "${PEER[@]}" 2>&1 | grep -v Writing | tee "$OUT/bench-moe.log" | tail -12
ts "bench_tree (qwen35 q4mix)"
timeout "$(budget 80)" python3 benchmarks/bench_tree.py --pairs realistic --kinds q4mix --archs qwen35 \
    --threads 8 -ngl -1 --cache-dir "$OUT/inflated" --n-prompts 6 --engines "plain,chain 4,chain 8,tree 16,auto" \
    "${PEER[@]}" 2>&1 | grep -v Writing | tee "$OUT/bench-tree.log" | tail -14
ts "bench_tree (qwen35 q4mix, DFlash2)"
timeout "$(budget 40)" python3 benchmarks/bench_tree.py --pairs realistic --kinds q4mix --archs qwen35 \
    --threads 8 -ngl -1 --cache-dir "$OUT/inflated" --n-prompts 6 --engines "plain,chain 4,chain 8,auto" \
    --draft tests/data/pairs/qwen35-dflash2-q8_0.gguf "${PEER[@]}" 2>&1 | grep -v Writing \
    | tee "$OUT/bench-tree-dflash2.log" | tail -12
ts "bench_proposers (qwen35 q4mix with its MTP head)"
timeout "$(budget 3)" python3 benchmarks/bench_proposers.py --pairs mtp --archs qwen35 --workloads code -ngl -1 \
    --threads 8 --cache-dir "$OUT/inflated" --n-prompts 3 --engines "mtp chain,mtp auto,dflash auto,all auto" \
    "${PEER[@]}" 2>&1 | grep -v Writing | tee "$OUT/bench-mtp.log" | tail -20
ts "done"
