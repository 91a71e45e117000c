"""The cache folder of generated artefacts (default tokenizer, tiny model):
$WARMSTATE_CACHE, else ~/.cache/warmstate. Nothing else lives here."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache folder, created if needed."""
    root = os.environ.get("WARMSTATE_CACHE")
    path = Path(root) if root else Path.home() / ".cache" / "warmstate"
    path.mkdir(parents=True, exist_ok=True)
    return path
