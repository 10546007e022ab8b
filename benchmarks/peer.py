#!/usr/bin/env python3
"""Build and locate the peer: upstream llama.cpp from the same pinned source distribution as our ggml.

    python benchmarks/peer.py build     # configures and builds the tools below (CPU, ~11 min on 2 cores)
    python benchmarks/peer.py path      # prints the folder holding the binaries

Used by the benchmarks and by the slow compatibility tests (which skip when the peer is not built).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD_DIR = Path(os.environ.get("PYDFLASH_PEER_BUILD", ROOT / "build" / "llama.cpp-peer"))
# AMX tile instructions fault on the machines this project runs on (cpuid reports them, ldtilecfg segfaults in
# ggml's AMX matmul, in llama.cpp and in our build alike): compile them out of the peer so that both engines
# use ggml's CPU_REPACK kernels (pydflash skips the AMX buffer type at run time).
NO_AMX = ["-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
          "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"] if platform.machine() in ("x86_64", "AMD64") else []
TARGETS = ["llama-simple", "llama-completion", "llama-speculative-simple", "llama-bench", "llama-quantize"]


def source_dir() -> Path:
    out = subprocess.run([sys.executable, str(ROOT / "vendor" / "ggml" / "fetch.py"), "llama.cpp"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def bin_dir() -> Path:
    return BUILD_DIR / "bin"


def binary(name: str) -> Path | None:
    path = bin_dir() / name
    return path if path.exists() else None


def build(jobs: int | None = None) -> Path:
    src = source_dir()
    subprocess.run(["cmake", "-S", str(src), "-B", str(BUILD_DIR), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_NATIVE=ON", *NO_AMX], check=True)
    cmd = ["cmake", "--build", str(BUILD_DIR), "--target", *TARGETS]
    if jobs:
        cmd += ["-j", str(jobs)]
    subprocess.run(cmd, check=True)
    return bin_dir()


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "path"
    if what == "build":
        print(build())
    elif what == "path":
        print(bin_dir())
    else:
        raise SystemExit("usage: peer.py [build|path]")


if __name__ == "__main__":
    main()
