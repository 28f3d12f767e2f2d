"""A draft model cut from a checkpoint: its first layers, its embedding, final norm and
lm_head (tests and benchmarks of speculative decoding with a draft model).

No hub is reachable here, so no trained draft exists for the models at hand; a checkpoint's
own first layers are one with its tokenizer by construction, and agree with it often enough
on a trained model to measure what a draft model costs and gains.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def layer_truncated(src: Path, dst: Path, num_layers: int) -> Path:
    """`src` (a Hugging Face checkpoint directory) with its first `num_layers` layers, into
    `dst` (replaced if it exists); returns `dst`."""
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers={num_layers}: use 1..{config['num_hidden_layers']}")
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            layer = _LAYER.match(name)
            if layer is None or int(layer.group(1)) < num_layers:
                tensors[name] = tensor
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for other in src.iterdir():
        weights = other.suffix == ".safetensors" or other.name.endswith(".safetensors.index.json")
        if other.is_file() and not weights and other.name != "config.json":
            shutil.copy(other, dst / other.name)
    return dst
