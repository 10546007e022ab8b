#!/usr/bin/env python3
"""Build and locate the peer: upstream llama.cpp from the same pinned source distribution as our ggml.

    python benchmarks/peer.py build     # configures and builds the tools below (CPU, ~11 min on 2 cores)
    python benchmarks/peer.py server    # and llama-server (bench_parallel.py's peer; a few more minutes)
    python benchmarks/peer.py path      # prints the folder holding the binaries

Used by the benchmarks and by the slow compatibility tests (which skip when the peer is not built), which
run its tools through the helpers at the bottom.
"""

from __future__ import annotations

import json
import os
import platform
import re
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


def build(jobs: int | None = None, server: bool = False) -> Path:
    src = source_dir()
    subprocess.run(["cmake", "-S", str(src), "-B", str(BUILD_DIR), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    f"-DLLAMA_BUILD_SERVER={'ON' if server else 'OFF'}", "-DGGML_NATIVE=ON", *NO_AMX], check=True)
    cmd = ["cmake", "--build", str(BUILD_DIR), "--target", *(["llama-server"] if server else TARGETS)]
    if jobs:
        cmd += ["-j", str(jobs)]
    subprocess.run(cmd, check=True)
    return bin_dir()


# ---------------------------------------------------------------------------------------------------------------
# running the tools and reading their output


class PeerError(RuntimeError):
    pass


def _exe(name: str) -> Path:
    path = binary(name)
    if path is None:
        raise PeerError(f"{name} not built (python benchmarks/peer.py build)")
    return path


def prompt_file(path: Path, text: str) -> Path:
    """Write a prompt for a tool's -f: llama.cpp drops one trailing newline of the file, so add one."""
    path.write_text(text + "\n", encoding="utf-8")
    return path


def _run(cmd: list[str], timeout: float) -> str:
    """stderr + stdout of a llama.cpp tool (it logs to stderr), raising PeerError with the reason on failure."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, errors="replace")
    except subprocess.TimeoutExpired:
        raise PeerError(f"{Path(cmd[0]).name} timed out after {timeout:.0f} s") from None
    if p.returncode != 0:
        tail = [ln for ln in (p.stderr or "").splitlines() if ln.strip()][-3:]
        raise PeerError(f"{Path(cmd[0]).name} exited {p.returncode}: {' | '.join(tail)[-300:]}")
    return p.stderr + p.stdout


def _run_and_parse(cmd: list[str], parse, attempts: int = 5) -> dict:
    """Run and parse, again when the summary lines are missing: the tools log through an asynchronous logger and
    now and then exit without its last lines (seen with llama-completion and llama-speculative-simple, more
    often under load)."""
    for attempt in range(attempts):
        try:
            return parse(_run(cmd, timeout=600))
        except PeerError as e:
            if "could not find" not in str(e) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _search(pattern: str, text: str, what: str) -> re.Match:
    m = re.search(pattern, text)
    if m is None:
        tail = [ln for ln in text.splitlines() if ln.strip()][-2:]
        raise PeerError(f"could not find {what} in the llama.cpp output (ends: {' | '.join(tail)[-200:]!r})")
    return m


def sampling_flags(temp: float, seed: int) -> list[str]:
    """Greedy at temp 0, else llama-cpp-python's defaults (top-k 40, top-p 0.95, min-p 0.05) at that temperature."""
    if temp <= 0:
        return ["--temp", "0", "--top-k", "1", "--seed", str(seed)]
    return ["--temp", str(temp), "--top-k", "40", "--top-p", "0.95", "--min-p", "0.05", "--seed", str(seed)]


def gpu_flags(n_gpu_layers: int, draft: bool = False) -> list[str]:
    """-ngl (and -ngld for the drafter) as our n_gpu_layers: -1 all layers, 0 none, N the last N. Always passed:
    a GPU build's own default ("auto") would offload what fits."""
    n = "all" if n_gpu_layers < 0 else str(n_gpu_layers)
    return ["-ngl", n, *(["-ngld", "all" if n_gpu_layers else "0"] if draft else [])]


def llama_ar(target: Path, prompt: Path, max_tokens: int, threads: int, n_ctx: int, temp: float = 0.0,
             seed: int = 0, n_gpu_layers: int = 0) -> dict:
    """llama-completion (greedy unless temp > 0): (decode steps, decode ms) from its `eval time = T ms / N runs`
    line."""
    cmd = [str(_exe("llama-completion")), "-m", str(target), "-f", str(prompt), "-n", str(max_tokens),
           *sampling_flags(temp, seed), "-t", str(threads), "-c", str(n_ctx), "-no-cnv", *gpu_flags(n_gpu_layers)]

    def parse(out: str) -> dict:
        m = _search(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs", out, "'eval time ... runs'")
        return {"ms": float(m[1]), "tokens": int(m[2]), "passes": int(m[2])}

    return _run_and_parse(cmd, parse)


def llama_dflash(target: Path, draft: Path, prompt: Path, max_tokens: int, threads: int, n_ctx: int,
                 n_draft: int, temp: float = 0.0, seed: int = 0, n_batch: int | None = None,
                 per_round: bool = False, n_gpu_layers: int = 0) -> dict:
    """llama-speculative-simple --spec-type draft-dflash (greedy unless temp > 0), -lv 4 for its statistics line;
    "output" holds what it printed (the prompt and the continuation among the log lines). It evaluates the
    prompt in one batch: n_batch (-b) must hold it (its default is 2048). per_round: -lv 5 for its debug lines,
    and "accepted_per_round", the drafts each verify accepted, in order.

    Its counts are not ours round for round: it evaluates the prompt less its last token and anchors its first
    block there (the first generated token is that round's first draft; ours comes from the prompt's pass), and
    it verifies whole blocks to the end, stopping once n_predict exceeds max_tokens (n_predict is then up to
    n_draft + 1 past it). Compare verify passes over the same tokens: rounds_to()."""
    cmd = [str(_exe("llama-speculative-simple")), "-m", str(target), "-md", str(draft), "--spec-type",
           "draft-dflash", "--spec-draft-n-max", str(n_draft), "-f", str(prompt), "-n", str(max_tokens),
           *sampling_flags(temp, seed), "-t", str(threads), "-td", str(threads), "-c", str(n_ctx),
           "-lv", "5" if per_round else "4", *(["-b", str(n_batch)] if n_batch else []),
           *gpu_flags(n_gpu_layers, draft=True)]
    return _run_and_parse(cmd, lambda out: _parse_dflash(out, per_round))


def llama_ngram(target: Path, prompt: Path, max_tokens: int, threads: int, n_ctx: int, spec_type: str,
                spec_flags: tuple[str, ...] = (), temp: float = 0.0, seed: int = 0, n_gpu_layers: int = 0) -> dict:
    """llama-speculative-simple --spec-type ngram-* (no draft model; spec_flags: its --spec-ngram-* options), parsed
    as llama_dflash's (the same statistics lines)."""
    cmd = [str(_exe("llama-speculative-simple")), "-m", str(target), "--spec-type", spec_type, *spec_flags,
           "-f", str(prompt), "-n", str(max_tokens), *sampling_flags(temp, seed), "-t", str(threads),
           "-c", str(n_ctx), "-lv", "4", *gpu_flags(n_gpu_layers)]
    return _run_and_parse(cmd, _parse_dflash)


def llama_mtp(target: Path, prompt: Path, max_tokens: int, threads: int, n_ctx: int, n_draft: int,
              temp: float = 0.0, seed: int = 0, per_round: bool = False, n_gpu_layers: int = 0) -> dict:
    """llama-speculative-simple --spec-type draft-mtp: the target's own MTP head (its GGUF's nextn block) drafts
    n_draft tokens a round (--spec-draft-p-min 0: never fewer), parsed as llama_dflash's; its first round anchors
    on the prompt's last token as draft-dflash's does (compare with rounds_to())."""
    cmd = [str(_exe("llama-speculative-simple")), "-m", str(target), "--spec-type", "draft-mtp",
           "--spec-draft-n-max", str(n_draft), "--spec-draft-p-min", "0", "-f", str(prompt), "-n", str(max_tokens),
           *sampling_flags(temp, seed), "-t", str(threads), "-td", str(threads), "-c", str(n_ctx),
           "-lv", "5" if per_round else "4", *gpu_flags(n_gpu_layers)]
    return _run_and_parse(cmd, lambda out: _parse_dflash(out, per_round))


def rounds_to(n_tokens: int, tokens_per_round) -> int:
    """The verify passes a loop took to have produced n_tokens, given what each round committed in order (drafts
    accepted + 1); the whole list's length when they fall short."""
    total = 0
    for i, n in enumerate(tokens_per_round):
        total += n
        if total >= n_tokens:
            return i + 1
    return len(tokens_per_round)


def _parse_dflash(out: str, per_round: bool = False) -> dict:
    dec = _search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", out, "'decoded N tokens in S seconds'")
    n_predict = int(_search(r"n_predict\s*=\s*(\d+)", out, "n_predict")[1])
    n_drafted = int(_search(r"n_drafted\s*=\s*(\d+)", out, "n_drafted")[1])
    n_accept = int(_search(r"n_accept\s*=\s*(\d+)", out, "n_accept")[1])
    calls = _search(r"#calls\(b,g,a\)\s*=\s*(\d+)\s+(\d+)\s+(\d+)", out, "the '#calls(b,g,a)' statistics")
    dur = _search(r"dur\(b,g,a\)\s*=\s*([\d.]+),\s*([\d.]+),\s*([\d.]+) ms", out, "the 'dur(b,g,a)' statistics")
    pev = _search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", out, "the target's 'prompt eval time'")
    rounds = n_predict - n_accept
    r = {"ms": 1000.0 * float(dec[2]), "tokens": int(dec[1]), "n_predict": n_predict, "n_drafted": n_drafted,
         "n_accept": n_accept, "rounds": rounds, "passes": rounds, "draft_calls": int(calls[2]),
         "draft_ms": float(dur[2]), "target_multi_ms": float(pev[1]), "target_multi_tokens": int(pev[2]),
         "checkpoints": "will use checkpoints" in out, "output": out}
    if per_round:
        accepted = [int(a) for a in re.findall(r"accepted (\d+)/\d+ draft tokens", out)]
        if sum(a + 1 for a in accepted) != n_predict:  # (a line the asynchronous logger lost)
            raise PeerError(f"could not find every round's 'accepted N/M draft tokens' line: {len(accepted)} found, "
                            f"{sum(a + 1 for a in accepted)} of the {n_predict} tokens")
        r["accepted_per_round"] = accepted
    return r


def llama_bench(target: Path, threads: int, n_prompt: int, n_gen: int, depth: int = 0, reps: int = 1) -> dict:
    """llama-bench -p n_prompt -n n_gen at a cache depth: {"pp_ms": prefill of n_prompt, "ar_ms": one decode step}"""
    cmd = [str(_exe("llama-bench")), "-m", str(target), "-p", str(n_prompt), "-n", str(n_gen), "-d", str(depth),
           "-t", str(threads), "-r", str(reps), "-o", "json"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        raise PeerError("llama-bench timed out") from None
    if p.returncode != 0:
        raise PeerError(f"llama-bench exited {p.returncode}: {p.stderr.strip().splitlines()[-1:]}")
    rows = json.loads(p.stdout)
    pp = next(r for r in rows if r["n_prompt"] == n_prompt and r["n_gen"] == 0)
    tg = next(r for r in rows if r["n_gen"] == n_gen and r["n_prompt"] == 0)
    return {"pp_ms": pp["avg_ns"] / 1e6, "ar_ms": tg["avg_ns"] / 1e6 / n_gen}


class llama_server:
    """llama-server over `target` (with `draft` as a DFlash drafter of n_draft tokens a round, with mtp the
    target's own MTP head drafting n_draft, or plainly) with n_parallel slots, each of n_ctx tokens, on `threads`
    threads and n_gpu_layers on the GPU (gpu_flags), for the life of a `with` block, which gets its base URL. Its
    log goes to `log`; `extra`: more of its flags (e.g. --metrics)."""

    def __init__(self, target: Path, n_parallel: int, threads: int, n_ctx: int, log: Path, draft: Path | None = None,
                 n_draft: int = 0, mtp: bool = False, n_gpu_layers: int = 0, extra: tuple[str, ...] = ()):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.cmd = [str(_exe("llama-server")), "-m", str(target), "-np", str(n_parallel), "-t", str(threads),
                    "-tb", str(threads), "-c", str(n_ctx * n_parallel), "--host", "127.0.0.1", "--port",
                    str(self.port), "--no-webui", "-lv", "3", *gpu_flags(n_gpu_layers, draft is not None), *extra]
        if draft is not None:
            self.cmd += ["-md", str(draft), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(n_draft),
                         "-td", str(threads)]
        elif mtp:
            self.cmd += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(n_draft), "--spec-draft-p-min", "0",
                         "-td", str(threads)]
        self.log = log
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        import time
        import urllib.request

        self.log_file = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log_file, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise PeerError(f"llama-server exited {self.proc.returncode}: see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self.url
            except OSError:
                time.sleep(0.2)
        self.__exit__()
        raise PeerError(f"llama-server did not come up in 120 s: see {self.log}")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log_file.close()


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "path"
    if what == "build":
        print(build())
    elif what == "server":
        print(build(server=True))
    elif what == "path":
        print(bin_dir())
    else:
        raise SystemExit("usage: peer.py [build|server|path]")


if __name__ == "__main__":
    main()
