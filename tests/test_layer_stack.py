"""The decoder layers as one native call (tp_worker/cpu/layer_stack.py, csrc/layer_stack.cpp)
give the Python loop's bits: tokens, logprobs, top-k and prompt logprobs, greedy and seeded,
prefill chunks and decode steps, with q/k/v biases (qwen2), per-head q/k norms (qwen3),
partial rotary (phi3), norms after each sublayer and over whole projections (olmo2), norms
before and after each sublayer, soft-caps, GeGLU and sliding windows on every other layer
(gemma2), two RoPE tables (gemma3), a window on every layer (mistral), a mixture of experts
(qwen3_moe with its dense first layer, olmoe, mixtral: router, top-k and experts in the same
call), in float32 and bfloat16 and on each kind of bfloat16 kernel the machine has."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import make_engine

from tokenmill.offline.engine import OfflineEngine, OfflineRequest


def _requests() -> list[OfflineRequest]:
    rng = np.random.default_rng(7)
    return [
        OfflineRequest(
            rng.integers(3, 1000, n).tolist(),
            max_tokens=10,
            num_top=5,
            prompt_logprob_start=n // 2 if i % 2 else -1,
            temperature=0.0 if i % 3 == 0 else 0.9,
            seed=i,
        )
        for i, n in enumerate([4, 37, 11, 90, 23])
    ]


def _engine(model, monkeypatch: pytest.MonkeyPatch, native: bool, **kwargs) -> OfflineEngine:
    monkeypatch.setenv("TOKENMILL_CPU_LAYER_STACK", "1" if native else "0")
    engine = make_engine(model, **kwargs)
    assert (engine.runner.model.layer_stack is not None) == native
    return engine


def _same(native: OfflineEngine, python: OfflineEngine) -> None:
    requests = _requests()
    # NOTE: together (a prefill chunk of every prompt, decode batches of 5) and one alone
    outputs = [(native.generate(requests), python.generate(requests))]
    outputs.append((native.generate(requests[3:4]), python.generate(requests[3:4])))
    for ours, theirs in outputs:
        for a, b in zip(ours, theirs, strict=True):
            assert a.output_ids == b.output_ids
            np.testing.assert_array_equal(a.logprobs, b.logprobs)
            np.testing.assert_array_equal(np.array(a.top_logprobs), np.array(b.top_logprobs))
            np.testing.assert_array_equal(a.prompt_logprobs, b.prompt_logprobs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "arch",
    [
        *("llama", "qwen2", "qwen3", "phi3", "granite", "olmo2", "gemma2", "gemma3"),
        *("qwen3_moe", "olmoe", "mixtral", "gpt_oss"),
    ],
)
def test_native_layers_give_the_python_loops_bits(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch, arch: str, dtype: str
) -> None:
    model = tiny_checkpoint(arch)
    _same(
        _engine(model, monkeypatch, True, dtype=dtype, max_prefill_tokens=64),
        _engine(model, monkeypatch, False, dtype=dtype, max_prefill_tokens=64),
    )


def test_native_layers_with_a_sliding_window(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """Mistral's window on every layer (16 positions: the prompts reach past it)."""
    model = tmp_path / "mistral-window"
    shutil.copytree(tiny_checkpoint("mistral"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "sliding_window": 16}))
    engines = [_engine(model, monkeypatch, n, decode_steps=3) for n in (1, 0)]
    assert all(layer.attention_settings.window == 16 for layer in engines[0].runner.model.layers)
    _same(*engines)


def test_native_layers_on_each_bfloat16_kernel(
    small_checkpoint, monkeypatch: pytest.MonkeyPatch, cpu_kernel: str
) -> None:
    """Heads of 64 (the AMX attention kernel's size), on the vector and the AMX kernels."""
    _same(
        _engine(small_checkpoint, monkeypatch, True, dtype="bfloat16"),
        _engine(small_checkpoint, monkeypatch, False, dtype="bfloat16"),
    )


def test_no_native_layers_where_a_layer_leaves_csrc(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the CPU kernels (torch's products) there is nothing to run natively."""
    monkeypatch.setenv("TOKENMILL_CPU_LAYER_STACK", "1")
    engine = make_engine(tiny_checkpoint("llama"), cpu_kernels=False)
    assert engine.runner.model.layer_stack is None
    # NOTE: Qwen2-MoE's shared expert runs from Python, so its layers do
    engine = make_engine(tiny_checkpoint("qwen2_moe"))
    assert engine.runner.model.layer_stack is None
