#!/usr/bin/env python3
"""Obtain the pinned ggml (and, on request, the whole pinned llama.cpp tree) from the
llama-cpp-python source distribution named in ggml.pin.

    python vendor/ggml/fetch.py ggml       # prints the path of the unpacked ggml source tree
    python vendor/ggml/fetch.py llama.cpp  # prints the path of the unpacked llama.cpp tree (peer, fixtures)
    python vendor/ggml/fetch.py sdist      # prints the path of the verified archive

The archive comes from, in order: $PYDFLASH_LLAMA_SDIST (a local copy of the .tar.gz), the cache folder
vendor/ggml/.cache/, or `pip download` from the package index. Its sha256 is checked every time it is
unpacked. Everything written here is git-ignored; nothing third-party is committed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def read_pin() -> dict[str, str]:
    pin = {}
    for line in (HERE / "ggml.pin").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pin[key.strip()] = value.strip()
    return pin


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get("PYDFLASH_SDIST_CACHE", HERE / ".cache"))


def download_with_pip(pin: dict[str, str], dest: Path) -> bool:
    spec = f"{pin['package']}=={pin['version']}"
    # --no-build-isolation: pip only prepares the sdist's metadata, it does not install its build deps.
    args = ["download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation", spec, "-d", str(dest)]
    # Inside pip's isolated build environment PYTHONPATH hides the interpreter's own site-packages (and pip
    # with them): run pip with the variables of that isolation removed.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    candidates = [[sys.executable, "-m", "pip"]]
    pip_on_path = shutil.which("pip3") or shutil.which("pip")
    if pip_on_path:
        candidates.append([pip_on_path])
    for pip in candidates:
        print(f"pydflash: downloading {spec} with {' '.join(pip)}", file=sys.stderr)
        if subprocess.run(pip + args, stdout=sys.stderr, env=env).returncode == 0:
            return True
    return False


def download_from_index(pin: dict[str, str], dest: Path) -> bool:
    """Fallback without pip: the package index's JSON simple API (PEP 691); the sha256 is checked after."""
    import json
    import urllib.request

    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    url = f"{index}/{pin['package']}/"
    print(f"pydflash: downloading {pin['filename']} from {url}", file=sys.stderr)
    try:
        req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            files = json.load(r)["files"]
        link = next(f["url"] for f in files if f["filename"] == pin["filename"])
        with urllib.request.urlopen(link, timeout=600) as r, open(dest / pin["filename"], "wb") as out:
            shutil.copyfileobj(r, out)
        return True
    except Exception as e:  # reported below with what to do instead
        print(f"pydflash: download failed: {e}", file=sys.stderr)
        return False


def ensure_sdist() -> Path:
    pin = read_pin()
    local = os.environ.get("PYDFLASH_LLAMA_SDIST")
    path = Path(local) if local else cache_dir() / pin["filename"]
    if not path.exists():
        if local:
            raise SystemExit(f"pydflash: PYDFLASH_LLAMA_SDIST={local} does not exist")
        path.parent.mkdir(parents=True, exist_ok=True)
        if not (download_with_pip(pin, path.parent) or download_from_index(pin, path.parent)):
            raise SystemExit(f"pydflash: could not download {pin['filename']}; set PYDFLASH_LLAMA_SDIST to a local "
                             f"copy of it or PYDFLASH_GGML_DIR to a ggml source tree")
    actual = sha256_of(path)
    if actual != pin["sha256"]:
        raise SystemExit(f"pydflash: {path}: sha256 {actual} does not match the pin {pin['sha256']} (vendor/ggml/ggml.pin)")
    return path


def unpack(member_prefix: str, dest: Path) -> Path:
    """Unpack the archive members under `member_prefix` into `dest` (atomically, once)."""
    if (dest / ".complete").exists():
        return dest
    sdist = ensure_sdist()
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist, "r:gz") as tar:
        root = tar.getnames()[0].split("/")[0]
        prefix = f"{root}/{member_prefix}/"
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix) and (m.isfile() or m.isdir()):
                m.name = m.name[len(prefix):]
                members.append(m)
        tar.extractall(tmp, members=members, filter="data")
    (tmp / ".complete").write_text(sha256_of(sdist) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def ggml_dir() -> Path:
    pin = read_pin()
    return unpack("vendor/llama.cpp/ggml", HERE / f"ggml-{pin['ggml_version']}")


def llama_cpp_dir() -> Path:
    pin = read_pin()
    return unpack("vendor/llama.cpp", HERE / f"llama.cpp-{pin['llama_cpp_commit'][:12]}")


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "ggml"
    actions = {"ggml": ggml_dir, "llama.cpp": llama_cpp_dir, "sdist": ensure_sdist}
    if what not in actions:
        raise SystemExit(f"usage: fetch.py [{'|'.join(actions)}]")
    print(actions[what]())


if __name__ == "__main__":
    main()
