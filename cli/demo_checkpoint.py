"""The demo checkpoint: built once by make-model into a cache directory (main process).

`tokenmill serve` and `tokenmill generate` with no `--model` use it, so the server runs on a
fresh machine with nothing downloaded. The version in the name changes when the builder does.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tokenmill.frontend.cache import cache_dir

logger = logging.getLogger(__name__)

DEMO_ARCH = "llama"
DEMO_PRESET = "small"
_BUILDER_VERSION = 1


def demo_checkpoint(arch: str = DEMO_ARCH, preset: str = DEMO_PRESET) -> Path:
    """The cached demo checkpoint's directory, built on first use."""
    from tokenmill.cli.make_model import build_checkpoint

    path = cache_dir() / f"demo-{arch}-{preset}-v{_BUILDER_VERSION}"
    if not (path / "config.json").exists():
        logger.info("building the demo checkpoint (%s, %s) into %s", arch, preset, path)
        build_checkpoint(path, arch, preset)
    return path
