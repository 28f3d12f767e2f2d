"""Where tokenmill keeps what it builds once per machine (main process): $TOKENMILL_CACHE, else
$XDG_CACHE_HOME/tokenmill, else ~/.cache/tokenmill."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("TOKENMILL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenmill"
    )
    return Path(root)
