"""The GPU suite (tests/test_gpu.py) against a device that is not this process's memory, on a machine without a
GPU: ggml's RPC backend, served by a second process computing on its CPU (`_core.rpc_serve`). The device code
paths are the GPU's: weights, KV cache, recurrent state, feature ring and drafter in device buffers, graphs split
between the device and the CPU with the scheduler's copies between them, tensors read back through the backend,
flash attention (the CPU's small-window matmul path is for host memory only).

It reproduces the fault an H100 showed as illegal memory accesses (a kept graph made resident again read the
scheduler's copies of another graph: core/graph_cache.cpp), and found one of its own (KV row moves ran views
without a buffer, which reached the device as null pointers: state/kv_cache.cpp)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# a failing ggml assertion prints its message and ends the process, without running a debugger for a backtrace
QUIET_ABORT = {**os.environ, "GGML_NO_BACKTRACE": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rpc_endpoint(tmp_path_factory):
    endpoint = f"127.0.0.1:{_free_port()}"
    log = tmp_path_factory.mktemp("rpc") / "server.log"  # (a file: it logs every connection, a pipe would fill)
    sink = log.open("w")
    server = subprocess.Popen([sys.executable, "-c", f"from pydflash import _core; _core.rpc_serve('{endpoint}', 1)"],
                              cwd=TESTS, env=QUIET_ABORT, stdout=sink, stderr=subprocess.STDOUT)  # (cwd: see below)
    host, port = endpoint.split(":")
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=0.2).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                sink.close()
                pytest.fail(f"the RPC server did not start: {log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)
    yield endpoint
    server.kill()
    server.wait()
    sink.close()


def test_gpu_suite_on_an_rpc_device(rpc_endpoint):
    # a process of its own: registering the device makes every later model in that process offload to it
    # (cwd tests/: `python -m pytest` puts its cwd on sys.path, and the checkout's pydflash has no _core)
    res = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-q", "-s",
                          "test_gpu.py"], cwd=TESTS, env={**QUIET_ABORT, "PYDFLASH_TEST_RPC": rpc_endpoint},
                         capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    # every test ran on the device: none skipped for want of one
    assert re.search(r"^\d+ passed", out, re.M) and "skipped" not in out, out[-3000:]


@pytest.mark.parametrize("endpoint,error", [("127.0.0.1:1", ConnectionError), ("no.such.host.invalid:80", ConnectionError),
                                            ("nohost", ValueError), (":5", ValueError), ("host:", ValueError)])
def test_unreachable_or_malformed_endpoint_raises(endpoint, error):
    """(ggml's RPC client aborts the process on an endpoint it cannot reach; nothing is registered here.)"""
    from pydflash import _core

    with pytest.raises(error, match="RPC"):
        _core.rpc_add_server(endpoint)


# --------------------------------------------------------------------------------------------------
# RPC as a user feature: `pydflash rpc-server` serves a device, `Model(rpc_servers=...)` offloads to it


def _start_rpc_server(tmp_path, *args) -> tuple[str, subprocess.Popen, Path]:
    """`pydflash rpc-server -p PORT *args` in a process of its own, once it accepts connections: (endpoint, process,
    its log)."""
    port = _free_port()
    log = tmp_path / f"rpc-server-{port}.log"
    with log.open("w") as sink:
        server = subprocess.Popen([sys.executable, "-c", "import sys; from pydflash.cli import main; "
                                   "sys.exit(main(sys.argv[1:]))", "rpc-server", "-p", str(port), "-t", "1", *args],
                                  cwd=TESTS, env=QUIET_ABORT, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return f"127.0.0.1:{port}", server, log
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"pydflash rpc-server did not start: {log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)


def _run_client(script: str, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    # a process of its own: registering a server is for the whole process
    return subprocess.run([sys.executable, "-c", script, *args], cwd=TESTS, env=QUIET_ABORT, capture_output=True,
                          text=True, timeout=timeout)


# (run in tests/: the committed pairs are found through tools/export_pairs.py)
OFFLOAD = r'''
import sys
sys.path.insert(0, "../tools")
import numpy as np
import pydflash
from pydflash import _core
from export_pairs import pair_file
target, endpoint = str(pair_file("qwen3", "target", "f32")), sys.argv[1]
tokens = np.arange(3, 40, dtype=np.int32)
cpu, _ = _core.Session(_core.Model(target), n_ctx=128).eval(tokens)
with pydflash.Model(target, n_ctx=128, n_gpu_layers=-1, rpc_servers=[endpoint]) as m:
    memory = m.memory()
    dev, _ = _core.Session(m._model, n_ctx=128).eval(tokens)
print("weights on the device:", memory["weights"]["gpu"], "max |cpu - device|:", float(np.abs(cpu - dev).max()),
      "scale:", float(np.abs(cpu).max()))
'''


def test_a_model_offloads_to_an_rpc_server(tmp_path):
    """`pydflash rpc-server` (127.0.0.1 by default, no warning) serves its CPU; a model given rpc_servers places every
    layer on that device (its weights in the device's memory) and computes the CPU's logits there."""
    endpoint, server, log = _start_rpc_server(tmp_path)
    try:
        res = _run_client(OFFLOAD, endpoint)
    finally:
        server.kill()
        server.wait()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    words = res.stdout.split()
    on_device, diff, scale = int(words[4]), float(words[9]), float(words[11])
    assert on_device > 0 and diff <= 2e-3 * scale
    assert "unauthenticated" not in log.read_text().lower()


def test_rpc_server_warns_when_it_listens_beyond_this_machine(tmp_path):
    endpoint, server, log = _start_rpc_server(tmp_path, "-H", "0.0.0.0")
    server.kill()
    server.wait()
    assert "RPC is unauthenticated" in log.read_text()


LOST = r'''
import sys
sys.path.insert(0, "../tools")
import pydflash
from export_pairs import pair_file
with pydflash.Model(pair_file("qwen3", "target", "f32"), n_ctx=4096, n_gpu_layers=-1, rpc_servers=sys.argv[1]) as m:
    print("loaded", flush=True)
    for _ in range(1000):
        m.generate("def fib(n):", max_tokens=512)
print("the server never went away")
'''


def test_a_server_that_goes_away_mid_generation_ends_the_process_with_one_line(tmp_path):
    """ggml's RPC client cannot return from a compute whose server is gone: the process says which server, in one
    line, and exits (no hang, no backtrace)."""
    endpoint, server, _ = _start_rpc_server(tmp_path)
    client = subprocess.Popen([sys.executable, "-c", LOST, endpoint], cwd=TESTS, env=QUIET_ABORT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "loaded"
        time.sleep(1.0)  # generating
        server.kill()
        server.wait()
        out, err = client.communicate(timeout=120)
    finally:
        client.kill()
        server.kill()
    assert client.returncode != 0, out
    lines = err.strip().splitlines()
    assert lines[-1] == (f"pydflash: lost the RPC server at {endpoint} (it stopped or the connection broke); "
                         "exiting"), err[-2000:]
    assert "backtrace" not in err.lower() and "never went away" not in out


@pytest.mark.parametrize("servers,error", [(5, TypeError), ([1], TypeError), (",", ValueError), ("nohost", ValueError),
                                           ("127.0.0.1:1", ConnectionError), ("localhost:99999", ValueError),
                                           ("host:port", ValueError)])
def test_bad_rpc_servers(servers, error):
    """(Each refused before anything is registered.)"""
    import pydflash
    from export_pairs import pair_file

    with pytest.raises(error, match="rpc_servers|RPC"):
        pydflash.Model(pair_file("qwen3", "target", "f32"), rpc_servers=servers)


TWO_DEVICES = r'''
import sys
sys.path.insert(0, "../tools")
import numpy as np
import pydflash
from pydflash import _core
from export_pairs import pair_file, prompt_rows
from near_ties import TIE, first_difference, tie_gap
target, draft = str(pair_file("qwen35", "target", "f32")), str(pair_file("qwen35", "dflash", "f32"))
tokens = np.arange(3, 40, dtype=np.int32)
cpu, _ = _core.Session(_core.Model(target), n_ctx=128).eval(tokens)
with pydflash.Model(target, draft_model_path=draft, n_ctx=512, n_gpu_layers=-1, rpc_servers=sys.argv[1:],
                    spec_mode="tree") as m:
    devices = {}
    for name, device, buft in m._model.placement:
        if name.startswith("blk.") or name == "output.weight":  # the head as layer n_layer
            devices.setdefault(buft, set()).add(int(name.split(".")[1]) if name.startswith("blk.") else m._model.n_layer)
    print("layers by device:", {b: sorted(ls) for b, ls in sorted(devices.items())})
    dev, _ = _core.Session(m._model, n_ctx=128).eval(tokens)
    print("max |cpu - devices| / scale:", float(np.abs(cpu - dev).max() / np.abs(cpu).max()))
    text = prompt_rows("code")[0]["text"]
    plain = m.generate(text, max_tokens=48, speculative=False).tokens
    spec = m.generate(text, max_tokens=48).tokens
    k = first_difference(spec, plain) if spec != plain else None
    print("speculative == plain:", spec == plain or tie_gap(m, m.tokenize(text), spec, plain, k) < TIE)
'''


def _run_with_two_servers(tmp_path, script: str) -> subprocess.CompletedProcess:
    """`script` run as a client of two rpc-servers of its own (argv: their endpoints); the servers are ended after."""
    (a, server_a, _), (b, server_b, _) = _start_rpc_server(tmp_path), _start_rpc_server(tmp_path)
    try:
        return _run_client(script, a, b)
    finally:
        for s in (server_a, server_b):
            s.kill()
            s.wait()


def test_layers_split_over_two_rpc_servers(tmp_path):
    """Two servers: the offloaded layers and head go to both, consecutive runs in order (an equal split: the same
    free memory; the head with the last), the hybrid's KV rows and recurrent state on each; the CPU's logits, and
    speculative (tree) output equal to plain."""
    res = _run_with_two_servers(tmp_path, TWO_DEVICES)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = res.stdout.splitlines()
    layers = eval(lines[0].split(":", 1)[1])  # {buffer type: [layers]}
    assert len(layers) == 2, layers
    runs = [sorted(v) for _, v in sorted(layers.items(), key=lambda kv: min(kv[1]))]
    assert runs[0][-1] + 1 == runs[1][0] and runs[0][0] == 0 and abs(len(runs[0]) - len(runs[1])) <= 1, runs
    assert float(lines[1].split(":")[1]) <= 2e-3
    assert lines[2] == "speculative == plain: True"


SPLIT = r'''
import sys
sys.path.insert(0, "../tools")
import pydflash
from export_pairs import pair_file
target = str(pair_file("qwen35", "target", "f32"))
for split in ([3, 1], [0, 1], [1, 0, 0]):
    try:
        with pydflash.Model(target, n_ctx=256, n_gpu_layers=-1, rpc_servers=sys.argv[1:], tensor_split=split) as m:
            devices = {}
            for name, device, buft in m._model.placement:
                if name.startswith("blk.") or name == "output.weight":  # the head as layer n_layer
                    il = int(name.split(".")[1]) if name.startswith("blk.") else m._model.n_layer
                    devices.setdefault(buft, set()).add(il)
            print(split, m._model.n_layer, m._model.tensor_split,
                  sorted(sorted(v) for v in devices.values()), flush=True)
    except ValueError as e:
        print(split, "ValueError:", e, flush=True)
'''


def test_tensor_split_over_two_rpc_servers(tmp_path):
    """tensor_split (llama.cpp's --tensor-split) puts each device's proportion of the offloaded layers on it in
    device order, with llama.cpp's rounding: layer j of n to the first device whose cumulative share exceeds j/n.
    A device with 0 gets none; more entries than devices is refused, naming them."""
    res = _run_with_two_servers(tmp_path, SPLIT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = res.stdout.splitlines()
    n_layer = int(lines[0].split("] ", 1)[1].split()[0])
    placed = n_layer + 1  # the layers and the head
    # [3, 1]: cumulative shares 0.75, 1.0: layers j with j/placed < 0.75 go to the first server
    first = sum(1 for j in range(placed) if j / placed < 0.75)
    assert lines[0] == f"[3, 1] {n_layer} [3.0, 1.0] {[list(range(first)), list(range(first, placed))]}", lines[0]
    assert lines[1] == f"[0, 1] {n_layer} [0.0, 1.0] {[list(range(placed))]}", lines[1]
    assert lines[2].startswith("[1, 0, 0] ValueError: tensor_split has 3 entries, expected at most one per GPU "
                               "device (2: RPC"), lines[2]


@pytest.mark.parametrize("split,error,match", [
    ([1, -1], ValueError, r"tensor_split\[1\] = -1"),
    ([1, float("nan")], ValueError, r"tensor_split\[1\]"),
    ("3,1", TypeError, "tensor_split must be a sequence"),
    ([1, "a"], TypeError, r"tensor_split\[1\] must be a number")])
def test_tensor_split_checked(split, error, match):
    import pydflash
    from export_pairs import pair_file

    with pytest.raises(error, match=match):
        pydflash.Model(pair_file("qwen3", "target", "q8_0"), tensor_split=split)


def test_tensor_split_of_a_plan_is_the_loads():
    """A plan's Model loads with the split it was planned with, or says which differs."""
    from pydflash import _core
    from export_pairs import pair_file

    planned = _core.Model(str(pair_file("qwen3", "target", "q8_0")), tensor_split=[1, 1], plan_only=True)
    with pytest.raises(ValueError, match=r"tensor_split = \[3, 1\], but the plan split the layers by \[1, 1\]"):
        planned.load_weights(tensor_split=[3, 1])
    planned.load_weights(tensor_split=[1, 1])
    assert planned.tensor_split == [1.0, 1.0]
