"""Shared fixtures: small checkpoints built by make-model, and runners over them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenmill.cli.make_model.weights import ARCHS  # noqa: E402, F401 (the tests' archs)


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoint_root: Path):
    """tiny_checkpoint(arch, tokenizer="auto") -> the directory of a tiny checkpoint of that
    family (tokenizer: auto, byte-level or sentencepiece, as `tokenmill make-model`)."""
    from tokenmill.cli.make_model import build_checkpoint

    built: dict[tuple[str, str], Path] = {}

    def get(arch: str = "llama", tokenizer: str = "auto") -> Path:
        if (arch, tokenizer) not in built:
            name = f"tiny-{arch}" if tokenizer == "auto" else f"tiny-{arch}-{tokenizer}"
            built[arch, tokenizer] = build_checkpoint(
                checkpoint_root / name, arch, "tiny", tokenizer=tokenizer
            )
        return built[arch, tokenizer]

    return get


@pytest.fixture(scope="session")
def small_checkpoint(checkpoint_root: Path) -> Path:
    """The small llama preset (~25M parameters, heads of 64: the size the AMX attention
    kernel takes), built once."""
    from tokenmill.cli.make_model import build_checkpoint

    return build_checkpoint(checkpoint_root / "small-llama", "llama", "small")


@pytest.fixture(scope="session")
def wide_checkpoint(tiny_checkpoint, checkpoint_root: Path) -> Path:
    """The tiny llama's tokenizer with rows of 256 and 512: the GGUF K types' blocks fit."""
    import json
    import shutil

    from tokenmill.cli.make_model.weights import write_weights

    out = checkpoint_root / "wide-llama"
    if (out / "model.safetensors").exists():
        return out
    out.mkdir()
    for path in tiny_checkpoint("llama").iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    config = json.loads((out / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=512, head_dim=64)
    (out / "config.json").write_text(json.dumps(config))
    write_weights(out, config, seed=1, num_used_tokens=config["vocab_size"])
    return out


def _session_server(model, tmp_path_factory: pytest.TempPathFactory, name: str, *args: str):
    """A real server (all processes) for the session; it must exit 0 on SIGTERM."""
    from server_process import start_server

    log = tmp_path_factory.mktemp(name) / "server.log"
    proc = start_server(model, log, "--kv-cache-tokens", "8192", "--max-model-len", "1024", *args)
    yield proc
    code = proc.stop()
    assert code == 0, f"server exited with {code} on SIGTERM:\n{proc.log()[-3000:]}"


@pytest.fixture(scope="session")
def server(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):
    """The real server on the tiny llama checkpoint, shared by e2e tests."""
    # NOTE: --rerank-labels: the tiny tokenizer has no one-token "yes" / "no"
    args = ("--max-running-requests", "32", "--rerank-labels", "y,n")
    yield from _session_server(tiny_checkpoint("llama"), tmp_path_factory, "server", *args)


@pytest.fixture(scope="session")
def qwen2_server(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):
    """The real server on the tiny qwen2 checkpoint (its chat template shows tools as
    Qwen2.5's does), with overlap scheduling: grammar masks follow their running batch."""
    model = tiny_checkpoint("qwen2")
    yield from _session_server(model, tmp_path_factory, "qwen2-server", "--overlap-schedule")


@pytest.fixture()
def qwen2_client(qwen2_server):
    import openai

    return openai.OpenAI(base_url=qwen2_server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(params=["vector", "amx"])
def cpu_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each kind of bfloat16 kernel this machine has: the AVX-512 (or portable) ones and, on
    a CPU with AMX, the tile ones (linear_amx.cpp, attention_amx.cpp), which the worker picks
    there unless TOKENMILL_CPU_AMX=0."""
    from tokenmill.tp_worker.cpu.ops import amx_enabled

    monkeypatch.setenv("TOKENMILL_CPU_AMX", "1" if request.param == "amx" else "0")
    if request.param == "amx" and not amx_enabled():
        pytest.skip("this CPU (or its kernel build) has no AMX tiles")
    return request.param
