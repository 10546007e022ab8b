import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: needs the llama.cpp peer build or takes minutes")


@pytest.fixture(scope="session")
def llama_cpp_dir() -> Path:
    """The pinned llama.cpp source tree (vocab fixtures, converter, templates), unpacked from the sdist."""
    out = subprocess.run([sys.executable, str(ROOT / "vendor" / "ggml" / "fetch.py"), "llama.cpp"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])
