"""`pydflash demo`: its words follow what it measured, and it writes no ANSI escapes off a terminal."""

from __future__ import annotations

import io

import pytest

from pydflash.cli import main
from pydflash.demo import realistic_verdict, tiny_verdict
from pydflash.style import Style


def test_the_realistic_verdict_says_speculation_pays_only_when_it_did():
    slow = realistic_verdict(0.51)  # measured on a loaded machine; it once printed "Here speculation pays"
    assert "pays" not in slow and "did not pay" in slow and "0.51x" in slow
    assert "did not pay" in realistic_verdict(1.0)
    fast = realistic_verdict(2.3)
    assert fast.startswith("Here speculation pays") and "2.30x as fast" in fast


@pytest.mark.parametrize("chain, auto, says, never", [
    (0.4, 0.98, "falls back to plain decoding", "gains"),
    (0.4, 0.6, "noisy on a loaded machine", "falls back to plain decoding and"),
    (0.4, 1.3, "still found rounds worth a draft", "falls back"),
    (1.0, 1.0, "about as fast as plain decoding", "costs almost nothing"),
    (1.4, 1.6, "Even a model this small gains", "slower"),
])
def test_the_tiny_verdict_follows_the_measured_speeds(chain, auto, says, never):
    words = tiny_verdict(chain, auto)
    assert says in words and never not in words and f"{chain:.2f}x" in words


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_style_writes_escapes_only_on_a_terminal_without_no_color(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert Style(io.StringIO()).bold("x") == "x"
    assert Style(_Terminal()).bold("x") == "\x1b[1mx\x1b[0m"
    monkeypatch.setenv("NO_COLOR", "1")
    assert Style(_Terminal()).bold("x") == Style(_Terminal()).dim("x") == "x"


def test_demo_writes_no_escapes_off_a_terminal(capsys, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert main(["demo", "--tiny-only", "-p", "1", "-n", "16"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert "DFlash auto" in out and "outputs identical to plain decoding" in out
