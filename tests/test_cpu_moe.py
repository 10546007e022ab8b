"""A MoE target's experts in system memory (`Model(n_cpu_moe=N)`, `--n-cpu-moe N` / `--cpu-moe`, llama.cpp's
flags): the experts of the first N layers (-1: all) stay on the CPU while the rest of each layer goes where
n_gpu_layers puts it. Here, without a GPU: the memory plan (which places layers on a GPU this machine lacks) per
device, its suggestion, the CLI and the load's check against its plan. On a device (tests/test_gpu.py, run in CI
on an RPC device by tests/test_rpc.py): logits equal to all-CPU, speculative equal to plain."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import make_qwen3moe_shape  # noqa: E402

import gguf  # noqa: E402
import pydflash  # noqa: E402
from pydflash import _core  # noqa: E402
from pydflash.cli import main as cli_main  # noqa: E402
from pydflash.convert import convert_hf_to_gguf  # noqa: E402
from pydflash.memory_plan import GPU_BACKEND_OVERHEAD  # noqa: E402

N_LAYER = 3


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A 3-layer qwen3moe GGUF (5 experts, top-2) and its experts' bytes by layer, read from the file."""
    d = make_qwen3moe_shape(tmp_path_factory.mktemp("moe") / "hf", "x5k2_tied", seed=3)
    path = convert_hf_to_gguf(d, d.parent / "m.gguf", outtype="f32", progress=False)
    by_layer = [0] * N_LAYER
    for t in gguf.GGUFReader(path).tensors:
        if m := re.match(r"blk\.(\d+)\.ffn_\w+_exps\.weight$", t.name):
            by_layer[int(m[1])] += int(t.n_bytes)
    return path, by_layer


def plan_on_absent_gpu(path, **kw):
    return pydflash.plan(path, n_ctx=256, n_gpu_layers=-1, vram="1GiB", suggest=False, sweep=False, **kw)


@pytest.mark.parametrize("n_cpu_moe", [0, 1, 2, 3, 7, -1])
def test_plan_keeps_the_first_layers_experts_in_system_memory(moe, n_cpu_moe):
    path, by_layer = moe
    kept = N_LAYER if n_cpu_moe < 0 else min(n_cpu_moe, N_LAYER)
    on_cpu = sum(by_layer[:kept])
    all_gpu = plan_on_absent_gpu(path)
    p = plan_on_absent_gpu(path, n_cpu_moe=n_cpu_moe)
    assert p.experts == {"cpu": on_cpu, "gpu": sum(by_layer) - on_cpu}
    # the experts moved and nothing else did (the rest of each layer stays on the GPU)
    assert p.bytes["weights"]["gpu"] == all_gpu.bytes["weights"]["gpu"] - on_cpu
    assert p.bytes["weights"]["cpu"] == all_gpu.bytes["weights"]["cpu"] + on_cpu
    assert p.bytes["kv"] == all_gpu.bytes["kv"]
    assert p.as_dict()["devices"]["gpu"]["expert_bytes"] == sum(by_layer) - on_cpu


def test_plan_suggests_the_fewest_layers_of_experts_to_keep_on_the_cpu(moe):
    path, by_layer = moe
    # a GPU budget that holds everything but the first two layers' experts (and the backend's own memory)
    needed = {n: plan_on_absent_gpu(path, n_cpu_moe=n).total("gpu") for n in range(N_LAYER + 1)}
    vram = needed[2] + (needed[1] - needed[2]) // 2 + GPU_BACKEND_OVERHEAD
    p = pydflash.plan(path, n_ctx=256, n_gpu_layers=-1, vram=vram, sweep=False)
    assert p.fits is False
    assert p.suggestions["n_cpu_moe"] == 2
    assert pydflash.plan(path, n_ctx=256, n_gpu_layers=-1, n_cpu_moe=2, vram=vram, sweep=False).fits


def test_cli_flags(moe, capsys):
    path, by_layer = moe
    assert cli_main(["plan", str(path), "-c", "256", "-ngl", "-1", "--cpu-moe", "--vram", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "n_cpu_moe -1" in out
    experts_row = next(line.split() for line in out.splitlines() if line.strip().startswith("experts"))
    assert " ".join(experts_row[1:3]) == f"{sum(by_layer) / 2**20:.1f} MiB"  # the CPU column: all of them
    assert cli_main(["plan", str(path), "-c", "256", "-ngl", "-1", "-ncmoe", "1", "--vram", "1GiB", "--json"]) == 0
    import json

    devices = json.loads(capsys.readouterr().out)["devices"]
    assert devices["cpu"]["expert_bytes"] == by_layer[0]
    with pytest.raises(SystemExit):
        cli_main(["plan", str(path), "--cpu-moe", "--n-cpu-moe", "2"])


def test_a_load_keeps_to_its_plan(moe):
    path, _ = moe
    planned = _core.Model(str(path), n_cpu_moe=1, plan_only=True)
    with pytest.raises(ValueError, match=r"n_cpu_moe = 2 keeps the experts of 2 layers on the CPU, but the plan "
                                         r"kept 1"):
        planned.load_weights(n_cpu_moe=2)
    planned.load_weights(n_cpu_moe=1)
    assert planned.n_cpu_moe == 1


@pytest.mark.parametrize("bad", [-2, "1", 1.5])
def test_bad_n_cpu_moe(moe, bad):
    with pytest.raises((TypeError, ValueError), match="n_cpu_moe"):
        pydflash.Model(moe[0], n_cpu_moe=bad)
