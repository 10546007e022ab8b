"""Bold and dim text for the terminal: ANSI escapes only when the stream is a terminal and NO_COLOR
(https://no-color.org) is unset, so output redirected to a file or a pipe stays plain text."""

from __future__ import annotations

import os
from typing import TextIO


class Style:
    def __init__(self, out: TextIO):
        self.on = hasattr(out, "isatty") and out.isatty() and not os.environ.get("NO_COLOR")

    def dim(self, text: str) -> str:
        return f"\x1b[2m{text}\x1b[0m" if self.on and text else text

    def bold(self, text: str) -> str:
        return f"\x1b[1m{text}\x1b[0m" if self.on and text else text
