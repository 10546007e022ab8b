"""PYDFLASH_USE_SYSTEM_GGML (docs/building.md, "ggml"): pydflash built against an installed ggml of the pinned
version (the pinned llama.cpp tree's ggml, shared, for the CPU, installed into a temporary prefix) loads that
ggml's libraries and computes what the default build (one static ggml inside the extension) computes. Slow: two
builds, 2.5 minutes on 2 cores."""

from __future__ import annotations

import json
import os
import platform
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import pydflash

from export_pairs import pair_file, prompt_rows  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sys.platform != "linux", reason="ldd, and the build steps as written, are Linux's")]

ROOT = Path(__file__).resolve().parents[1]
# (AMX tile instructions fault on the machines this project runs on: benchmarks/peer.py)
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if platform.machine() in ("x86_64", "AMD64") else ""
GENERATE = """
import json, sys
import pydflash
from pydflash import _core
m = pydflash.Model(sys.argv[1], draft_model_path=sys.argv[2], spec_mode="chain", n_ctx=512, n_threads=2)
print(json.dumps({"module": _core.__file__, "tokens": m.generate(sys.argv[3], max_tokens=32).tokens}))
"""


def _run(cmd, **kw) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert res.returncode == 0, " ".join(map(str, cmd)) + "\n" + (res.stdout + res.stderr)[-4000:]


def _install_ggml(llama_cpp_dir: Path, build: Path, prefix: Path) -> Path:
    _run(["cmake", "-S", str(llama_cpp_dir), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
          "-DBUILD_SHARED_LIBS=ON", "-DGGML_RPC=ON", "-DGGML_OPENMP=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
          "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
          "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_COMMON=OFF", f"-DCMAKE_C_FLAGS={NO_AMX}",
          f"-DCMAKE_CXX_FLAGS={NO_AMX}"])
    _run(["cmake", "--build", str(build), "--target", "ggml", "ggml-rpc"])
    _run(["cmake", "--install", str(build / "ggml"), "--prefix", str(prefix)])
    return next(prefix.glob("lib*/cmake/ggml"))  # lib or lib64, as GNUInstallDirs has it


def test_a_build_against_an_installed_ggml_loads_it_and_gives_the_default_builds_tokens(tmp_path, llama_cpp_dir):
    ggml_dir = _install_ggml(llama_cpp_dir, tmp_path / "ggml-build", tmp_path / "ggml")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
          "-C", "cmake.define.PYDFLASH_USE_SYSTEM_GGML=ON", "-C", f"cmake.define.ggml_DIR={ggml_dir}",
          "-C", f"build-dir={tmp_path / 'build'}", "-w", str(tmp_path / "wheel"), str(ROOT)])
    site_dir = tmp_path / "site"
    with zipfile.ZipFile(next((tmp_path / "wheel").glob("pydflash-*.whl"))) as whl:
        whl.extractall(site_dir)
    target, draft = pair_file("qwen35", "target", "q8_0"), pair_file("qwen35", "dflash", "q8_0")
    prompt = prompt_rows("code")[0]["text"]
    # -S: no .pth files, so an editable install of this checkout cannot take `import pydflash` from the wheel's
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site_dir), *site.getsitepackages()])}
    res = subprocess.run([sys.executable, "-S", "-c", GENERATE, str(target), str(draft), prompt], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(out["module"]).is_relative_to(site_dir)
    linked = subprocess.run(["ldd", out["module"]], capture_output=True, text=True).stdout
    assert str(ggml_dir.parents[1] / "libggml-base.so") in linked, linked  # the installed ggml, by its RPATH
    with pydflash.Model(target, draft_model_path=draft, spec_mode="chain", n_ctx=512, n_threads=2) as m:
        assert out["tokens"] == m.generate(prompt, max_tokens=32).tokens
