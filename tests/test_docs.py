"""The docs: the mkdocs site (mkdocs.yml, docs/) builds in strict mode, so that a broken link, a missing anchor or
an API name that no longer exists fails the suite; the README stays short, keeps the two set-up commands CI and
users run, and links only to files that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SETUP_COMMANDS = ('pip install . && pydflash demo', 'pip install ".[test]" && pip install --no-deps dflash==0.1.0 && pytest -m "not slow"')
MAX_README_LINES = 150


def test_site_builds_strictly(tmp_path):
    # mkdocstrings reads pydflash/ statically (paths: [.] in mkdocs.yml): no import of the compiled core
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "WARNING" not in log, log
    assert (tmp_path / "site" / "api" / "index.html").read_text().count('id="pydflash.model.Model.generate"') == 1


def test_readme_is_short_and_keeps_the_setup_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    for command in SETUP_COMMANDS:
        # each in a code block of its own, unchanged
        assert [command] in [b.strip().splitlines() for b in blocks], command


def test_readme_links_resolve():
    targets = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    relative = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    assert relative, "the README links to the docs"
    missing = [t for t in relative if not (ROOT / t).is_file()]
    assert not missing, missing
