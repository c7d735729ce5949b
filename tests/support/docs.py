"""Code blocks of the Markdown docs, so quick starts are run as written."""

from __future__ import annotations

import re
from pathlib import Path

BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def code_blocks(path: Path, language: str) -> list[str]:
    """The fenced blocks of `language` in a Markdown file, in order."""
    return [body for lang, body in BLOCK.findall(path.read_text()) if lang == language]
