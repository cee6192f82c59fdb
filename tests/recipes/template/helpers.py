"""Fixtures shared by this folder's test files."""

from __future__ import annotations

import hashlib
from pathlib import Path

from accel_common.run_folder.outputs import LOCK_FILE


def digest(folder: Path) -> dict[str, str]:
    """Every file's digest but the run's lock (which records the last process to hold it)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE
    }
