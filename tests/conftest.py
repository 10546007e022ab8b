import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
for _path in (TESTS, ROOT / "tools", ROOT / "benchmarks"):  # hf_models; qwen2_bpe, dflash_ref, export_pairs; peer
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


def _shim_pydflash_convert() -> None:
    """Dev-time shim: `convert/` ships in the wheel as `pydflash.convert`. From a plain source tree
    (nothing installed) load that folder under its installed name, so tests import it the same way."""
    try:
        import pydflash.convert  # noqa: F401
        return
    except ModuleNotFoundError as e:
        if e.name not in ("pydflash.convert", "pydflash"):
            raise
    import pydflash

    spec = importlib.util.spec_from_file_location("pydflash.convert", ROOT / "convert" / "__init__.py",
                                                  submodule_search_locations=[str(ROOT / "convert")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["pydflash.convert"] = module
    spec.loader.exec_module(module)
    pydflash.convert = module


_shim_pydflash_convert()


@pytest.fixture(scope="session", autouse=True)
def _own_cache_dir(tmp_path_factory):
    """What the engine learns and keeps per machine (prefill micro-batches, verify costs: pydflash/cache_paths.py)
    goes to a folder of this run's: the user's cache stays clean, and no test's choices follow what an earlier
    run measured (on a busier machine) for the same files."""
    saved = os.environ.get("PYDFLASH_CACHE")
    os.environ["PYDFLASH_CACHE"] = str(tmp_path_factory.mktemp("pydflash-cache"))
    yield
    if saved is None:
        os.environ.pop("PYDFLASH_CACHE", None)
    else:
        os.environ["PYDFLASH_CACHE"] = saved


@pytest.fixture
def rss_measurable():
    """Tests that a process's resident memory stays flat: skipped under AddressSanitizer (docs/contributing.md,
    its runtime preloaded), whose quarantine keeps freed memory resident."""
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("AddressSanitizer's quarantine keeps freed memory resident")


@pytest.fixture(autouse=True)
def _fresh_verify_costs(_own_cache_dir):
    """Each test starts with no verify costs learnt (pydflash/cost_cache.py), as a fresh machine does: a table
    an earlier test learnt on the same files would let auto know up front that drafting does not pay on a tiny
    pair, and an exactness test of auto would then compare plain decoding with itself. (The prefill micro-batch
    sizes stay for the run: they change no output.)"""
    forget_learnt_costs()


def forget_learnt_costs() -> None:
    """What the loads so far learnt and kept (verify costs, acceptance, a batch's step times) forgotten, as on a
    fresh machine (also within a test, between two loads that must not share it)."""
    from pydflash import cache_paths, cost_cache

    (cache_paths.cache_dir() / cost_cache.CACHE_FILE).unlink(missing_ok=True)
    cost_cache._saved.clear()
    cost_cache._saved_steps.clear()


@pytest.fixture(scope="session")
def llama_cpp_dir() -> Path:
    """The pinned llama.cpp source tree (vocab fixtures, converter, templates), unpacked from the sdist."""
    out = subprocess.run([sys.executable, str(ROOT / "vendor" / "ggml" / "fetch.py"), "llama.cpp"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def qwen35_template(llama_cpp_dir) -> str:
    """Qwen3.5's chat template (llama.cpp's copy): XML tool calls, a reasoning block it opens itself."""
    return (llama_cpp_dir / "models" / "templates" / "Qwen3.5-4B.jinja").read_text()


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory):
    """Factory for tiny random HF Qwen3 checkpoints, cached for the session:
    `qwen3_checkpoint("gqa4x2_hd64", dtype="bfloat16")` -> Path (shapes: hf_models.QWEN3_SHAPES;
    keyword arguments go to hf_models.make_qwen3_checkpoint)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import hf_models

    cache: dict = {}

    def make(shape: str = "gqa4x2_hd64", **overrides) -> Path:
        key = (shape, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            cache[key] = hf_models.make_qwen3_shape(tmp_path_factory.mktemp(f"hf-{shape}"), shape, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def qwen35_checkpoint(tmp_path_factory):
    """Factory for tiny random HF Qwen3.5 checkpoints, cached for the session:
    `qwen35_checkpoint("k2v4_hd32", dtype="bfloat16")` -> Path (shapes: hf_models.QWEN35_SHAPES;
    keyword arguments go to hf_models.make_qwen35_checkpoint)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import hf_models

    cache: dict = {}

    def make(shape: str = "k2v4_hd32", **overrides) -> Path:
        key = (shape, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            cache[key] = hf_models.make_qwen35_shape(tmp_path_factory.mktemp(f"hf-q35-{shape}"), shape, **overrides)
        return cache[key]

    return make
