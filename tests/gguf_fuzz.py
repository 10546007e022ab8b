#!/usr/bin/env python3
"""Seeded GGUF fuzzing: mutants of the committed pairs are loaded and run in a worker subprocess, which must
never die of a signal, hang, or raise anything but pydflash's typed errors.

Mutants (each from a seed, so a failure can be replayed):
- truncation at a random offset;
- random bytes overwritten in the header, the metadata or the tensor infos;
- one hyper-parameter key set to a hostile value (0, 1, -1, huge, NaN, inf, a string, invalid UTF-8, an empty
  or too long array), or dropped;
- one tensor's shape or type changed in its info (the data left as it is).

    python tests/gguf_fuzz.py --n 2000          # a larger run than the test suite's (tests/test_fuzz.py)
    python tests/gguf_fuzz.py --replay 1234     # one mutant, in this process, with its traceback
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "tools"), str(HERE)]

from export_pairs import pair_file  # noqa: E402
from gguf_edit import patch_tensor_info, rewrite  # noqa: E402

# (target, draft) pairs mutated: the draft is mutated with its target intact and the other way round
SOURCES = [("qwen3", "f32"), ("qwen35", "f32")]
HOSTILE_INTS = [0, 1, 2, 3, -1, 7, 100, 2**16, 2**31 - 1, 2**32 - 1, 2**63 - 1]
HOSTILE_FLOATS = [0.0, -1.0, 1e-30, 1e30, float("nan"), float("inf"), -float("inf")]
WORKER_TIMEOUT = 30.0  # s for one mutant (load + 2 tokens take ~0.05 s)


def _mutate_value(rng: random.Random, field: gguf.ReaderField):
    """a hostile replacement (value, type, subtype) for a metadata field"""
    vtype = gguf.GGUFValueType(field.types[0])
    choice = rng.random()
    if choice < 0.1:
        return b"\xff\xfe bad utf-8", gguf.GGUFValueType.STRING, None
    if vtype == gguf.GGUFValueType.ARRAY:
        sub = gguf.GGUFValueType(field.types[-1])
        n = rng.choice([1, 3, 5, 100])  # (gguf-py writes no empty array)
        if sub in (gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64):
            return [rng.choice(HOSTILE_FLOATS) for _ in range(n)], vtype, sub
        if sub == gguf.GGUFValueType.STRING:
            return [rng.choice(["", "x", "\u00e9"]) for _ in range(n)], vtype, sub
        if sub == gguf.GGUFValueType.BOOL:
            return [rng.random() < 0.5 for _ in range(n)], vtype, sub
        return [rng.choice([0, 1, 3, 100, 2**31 - 1]) for _ in range(n)], vtype, gguf.GGUFValueType.INT32
    if vtype in (gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64):
        return rng.choice(HOSTILE_FLOATS), gguf.GGUFValueType.FLOAT32, None
    if vtype == gguf.GGUFValueType.STRING:
        return rng.choice(["", "qwen3", "qwen35", "dflash", "llama", "x" * 1000]), vtype, None
    if vtype == gguf.GGUFValueType.BOOL:
        return rng.random() < 0.5, vtype, None
    if choice < 0.2:
        return rng.choice(HOSTILE_FLOATS[:4]), gguf.GGUFValueType.FLOAT32, None  # a float where an int belongs
    value = rng.choice(HOSTILE_INTS)
    return value, (gguf.GGUFValueType.INT64 if value < 0 or value >= 2**32 else gguf.GGUFValueType.UINT32), None


def _tensor_info_mutant(src: Path, dst: Path, rng: random.Random) -> str:
    """One tensor's dims or type changed in place in its info (byte level: the data stays as it was)."""
    t = rng.choice(list(gguf.GGUFReader(src).tensors))
    ne = [int(n) for n in t.shape]
    if rng.random() < 0.5:
        i = rng.randrange(len(ne))
        value = rng.choice([0, 1, 2, ne[i] * 2, ne[i] + 1, 2**40])
        patch_tensor_info(src, dst, t.name, dim=(i, value))
        return f"tensor {t.name} ne[{i}] = {value}"
    value = rng.choice([1, 8, 12, 26, 30, 39, 200])  # f16, q8_0, q4_k, i32, bf16, (unused), out of range
    patch_tensor_info(src, dst, t.name, ggml_type=value)
    return f"tensor {t.name} type = {value}"


def _rewrite(src: Path, dst: Path, rng: random.Random) -> str:
    """A metadata mutant: one key hostile or dropped; returns what was changed."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    fields = [n for n in reader.fields if not n.startswith("GGUF.")]
    key = rng.choice([n for n in fields if n.startswith(arch) or n.startswith("tokenizer.ggml.")
                      or n == "general.architecture"] or fields)
    if key == "general.architecture":
        value, _, _ = _mutate_value(rng, reader.fields[key])
        raw = value if isinstance(value, bytes) else str(value).encode()
        rewrite(src, dst, arch=raw)
        return f"{key} = {raw!r:.80}"
    if rng.random() < 0.15:
        rewrite(src, dst, drop_keys=[key])
        return f"drop {key}"
    value, vtype, sub = _mutate_value(rng, reader.fields[key])
    rewrite(src, dst, set_keys={key: (value, vtype, sub)})
    return f"{key} = {value!r:.80}"


def make_mutant(seed: int, out_dir: Path) -> dict:
    """Write mutant `seed` into out_dir; returns {"target", "draft", "what"} (one of the two paths mutated)."""
    rng = random.Random(seed)
    arch, kind = SOURCES[seed % len(SOURCES)]
    target, draft = pair_file(arch, "target", kind), pair_file(arch, "dflash", kind)
    mutate_draft = rng.random() < 0.3
    src = draft if mutate_draft else target
    dst = out_dir / f"mutant-{seed}.gguf"
    data = src.read_bytes()
    mode = rng.random()
    if mode < 0.15:
        cut = rng.randrange(len(data))
        dst.write_bytes(data[:cut])
        what = f"truncated at {cut} of {len(data)}"
    elif mode < 0.35:
        # bytes in the header, metadata and tensor infos (the first few KB; tensor data starts after them)
        buf = bytearray(data)
        head = min(len(buf), 64 + (rng.random() < 0.5) * 8192)
        for _ in range(rng.choice([1, 2, 4, 16])):
            i = rng.randrange(4, head)
            buf[i] = rng.randrange(256)
        dst.write_bytes(bytes(buf))
        what = "bytes overwritten in the first %d" % head
    elif mode < 0.5:
        what = _tensor_info_mutant(src, dst, rng)
    else:
        try:
            what = _rewrite(src, dst, rng)
        except (ValueError, OverflowError, struct.error):  # a value gguf-py cannot write: a truncation instead
            cut = rng.randrange(len(data))
            dst.write_bytes(data[:cut])
            what = f"truncated at {cut} of {len(data)}"
    return {"target": str(dst if not mutate_draft else target), "draft": str(dst if mutate_draft else draft),
            "what": f"{'draft' if mutate_draft else 'target'} ({arch}): {what}"}


def run_one(target: str, draft: str) -> str:
    """Load the pair and generate 2 tokens (plain, then speculative): 'ok' or the exception's class. The
    arguments are valid, so whatever goes wrong is the file's: only pydflash's errors count as typed."""
    import pydflash
    from pydflash.errors import PydflashError

    try:
        with pydflash.Model(target, n_ctx=64, n_threads=1, draft_model_path=draft) as m:
            m.generate([1, 2, 3], max_tokens=2, speculative=False)
            m.generate([1, 2, 3], max_tokens=3)
        return "ok"
    except PydflashError as e:
        return type(e).__name__
    except Exception as e:  # noqa: BLE001 - an untyped error is what the fuzz looks for
        return f"UNTYPED {type(e).__name__}: {e}"


def worker() -> None:
    """Read {"target", "draft"} lines from stdin, answer each with one line."""
    for line in sys.stdin:
        job = json.loads(line)
        print(run_one(job["target"], job["draft"]), flush=True)


class Runner:
    """A worker subprocess fed one mutant at a time; restarted after a crash or a hang."""

    def __init__(self):
        self.proc = None

    def _start(self):
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tempfile.gettempdir(),
                                     env={**os.environ, "PYTHONFAULTHANDLER": "0"})

    def run(self, job: dict) -> str:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], WORKER_TIMEOUT)
        if not ready:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            return f"HANG (> {WORKER_TIMEOUT:.0f} s)"
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            self.proc = None
            return f"CRASH (exit {code})"
        return line.strip()

    def close(self):
        if self.proc and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)


def fuzz(seeds, out_dir: Path, progress=None) -> list[tuple[int, str, str]]:
    """Run the mutants of `seeds`; returns the failures (seed, what, outcome)."""
    runner = Runner()
    failures = []
    try:
        for i, seed in enumerate(seeds):
            job = make_mutant(seed, out_dir)
            outcome = runner.run(job)
            Path(job["target"] if "mutant" in job["target"] else job["draft"]).unlink(missing_ok=True)
            if outcome.startswith(("UNTYPED", "HANG", "CRASH")):
                failures.append((seed, job["what"], outcome))
            if progress:
                progress(i, seed, job["what"], outcome)
    finally:
        runner.close()
    return failures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=500, help="mutants")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--replay", type=int, default=None, help="run one mutant here, with its traceback")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker()
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.replay is not None:
            job = make_mutant(args.replay, Path(tmp))
            print(job["what"])
            import pydflash

            with pydflash.Model(job["target"], n_ctx=64, n_threads=1, draft_model_path=job["draft"]) as m:
                m.generate([1, 2, 3], max_tokens=2, speculative=False)
                print(m.generate([1, 2, 3], max_tokens=3))
            return

        def show(i, seed, what, outcome):
            if args.verbose or outcome.startswith(("UNTYPED", "HANG", "CRASH")):
                print(f"{seed:6d} {outcome:<40.40} {what}", flush=True)

        failures = fuzz(range(args.first_seed, args.first_seed + args.n), Path(tmp), show)
    print(f"{args.n} mutants, {len(failures)} failures")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
