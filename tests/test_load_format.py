"""`--load-format dummy`: a model's shape served from config.json and the tokenizer alone."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
from server_process import start_server


def shape_only(checkpoint: Path, into: Path) -> Path:
    """The checkpoint's directory without its weights."""
    into.mkdir()
    for path in checkpoint.iterdir():
        if not path.name.endswith(".safetensors") and path.name != "model.safetensors.index.json":
            shutil.copy(path, into / path.name)
    return into


def test_dummy_weights_serve_a_shape_with_no_checkpoint(tiny_checkpoint, tmp_path: Path) -> None:
    model = shape_only(tiny_checkpoint("llama"), tmp_path / "shape")
    server = start_server(model, tmp_path / "log", "--load-format", "dummy")
    try:
        body = {"model": server.model, "prompt": "hello", "max_tokens": 8, "logprobs": 3}
        status, reply = server.post("/v1/completions", {**body, "ignore_eos": True})
        assert status == 200, reply
        logprobs = reply["choices"][0]["logprobs"]
        assert reply["usage"]["completion_tokens"] == 8
        assert all(math.isfinite(v) and v <= 0 for v in logprobs["token_logprobs"])
    finally:
        assert server.stop() == 0


def test_without_dummy_a_shape_alone_fails_at_start(tiny_checkpoint, tmp_path: Path) -> None:
    model = shape_only(tiny_checkpoint("llama"), tmp_path / "shape")
    with pytest.raises(RuntimeError, match="no \\*.safetensors"):
        start_server(model, tmp_path / "log", timeout=60)
