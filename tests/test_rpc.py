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
