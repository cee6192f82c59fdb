"""Fixtures shared by this folder's test files."""

from __future__ import annotations

import hashlib
from pathlib import Path


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
