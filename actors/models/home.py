"""troupe's cache root, in a module of its own: actors/models/blas.py reads it before MLX may be
imported (a preload only works at process start)."""

from __future__ import annotations

import os
from pathlib import Path


def troupe_home() -> Path:
    """Cache root: ``$TROUPE_HOME``, default ``~/.cache/mlx-troupe``."""
    return Path(os.environ.get("TROUPE_HOME") or "~/.cache/mlx-troupe").expanduser()
