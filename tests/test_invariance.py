"""Every way of scheduling the same requests gives the same tokens and logprobs, bit for bit:
batched or alone, chunked prefill or whole, one or several decode steps per round trip, any
prompt logprob chunk size, in float32 and in bfloat16.

test_dispatch.py runs this file again under other math-library dispatch settings and thread
counts, so a change that holds only on the developer's own CPU fails there too."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import ARCHS
from helpers import make_engine

from tokenmill.offline.engine import OfflineOutput, OfflineRequest
from tokenmill.protocol.arrays import unpack
from tokenmill.protocol.step import ForwardBatch, StepResult
from tokenmill.tp_worker import model_runner
from tokenmill.tp_worker.cpu import ops as cpu_ops
from tokenmill.tp_worker.step_inputs import LastLayerRows
from tokenmill.tp_worker.upload import Upload

LENGTHS = [3, 9, 17, 30, 64, 5, 41, 12]


# NOTE: every family but the plain ones (llama's runs in the tests above; Mistral and Granite
# differ from it in fields these layers read the same way)
CHUNKED_ARCHS = [a for a in ARCHS if a not in ("llama", "mistral", "granite")]


def _requests(sampled: bool) -> list[OfflineRequest]:
    rng = np.random.default_rng(0)
    return [
        OfflineRequest(
            rng.integers(3, 1000, n).tolist(),
            max_tokens=12,
            num_top=5,
            prompt_logprob_start=n // 3,
            temperature=0.8 if sampled else 0.0,
            top_p=0.9 if sampled else 1.0,
            seed=i,
        )
        for i, n in enumerate(LENGTHS)
    ]


def _assert_same(a: OfflineOutput, b: OfflineOutput, atol: float) -> None:
    assert a.output_ids == b.output_ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=atol, rtol=0)
    np.testing.assert_allclose(
        np.array(a.top_logprobs), np.array(b.top_logprobs), atol=atol, rtol=0
    )
    np.testing.assert_allclose(a.prompt_logprobs, b.prompt_logprobs, atol=atol, rtol=0)


DTYPES = ["float32", "bfloat16"]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_batch_of_8_equals_each_alone(
    tiny_checkpoint, sampled: bool, dtype: str, arch: str
) -> None:
    """Alone on a cold engine, and alone again on the warm one (a prefix-cache hit)."""
    model = tiny_checkpoint(arch)
    warm = make_engine(model, dtype=dtype)
    requests = _requests(sampled)
    batched = warm.generate(requests)
    cold = make_engine(model, prefix_cache=False, dtype=dtype)
    for request, together in zip(requests, batched, strict=True):
        _assert_same(cold.generate([request])[0], together, atol=0.0)
        _assert_same(warm.generate([request])[0], together, atol=0.0)
    assert warm.controller.kv.hit_tokens > 0 and cold.controller.kv.hit_tokens == 0


@pytest.mark.parametrize("processed", [False, True], ids=["raw", "processed"])
def test_the_same_tokens_whether_or_not_a_batch_reads_logprobs(
    tiny_checkpoint, processed: bool
) -> None:
    """A batch where no row asks for logprobs skips their log-softmax (NaN comes back, and no
    row shows any): its tokens are those of a batch that reads them, greedy and sampled."""
    engine = make_engine(
        tiny_checkpoint("llama"), logprobs_mode="processed" if processed else "raw"
    )
    scored = [replace(r, num_top=0, prompt_logprob_start=-1) for r in _requests(sampled=True)]
    scored[0::2] = [replace(r, temperature=0.0) for r in scored[0::2]]
    unscored = [replace(r, logprobs=False) for r in scored]
    steps: list[tuple[bool, np.ndarray]] = []  # per step: whether it read them, and theirs
    original = engine.sockets.step

    def step(batch: ForwardBatch) -> StepResult:
        result = original(batch)
        steps.append((batch.logprobs.sampled, unpack(result.logprobs)))
        return result

    engine.sockets.step = step
    without = engine.generate(unscored)
    assert steps and all(not read and np.isnan(lp).all() for read, lp in steps)
    steps.clear()
    with_them = engine.generate(scored)
    assert steps and all(read and np.isfinite(lp).all() for read, lp in steps)
    for a, b in zip(without, with_them, strict=True):
        assert a.output_ids == b.output_ids and a.logprobs == [] and len(b.logprobs) == 12
    mixed = engine.generate([unscored[0], *scored[1:]])
    assert [m.output_ids for m in mixed] == [b.output_ids for b in with_them]


@pytest.mark.parametrize("arch", CHUNKED_ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("max_prefill_tokens", "decode_steps"), [(7, 1), (4096, 4), (16, 3)])
def test_chunked_prefill_and_multi_step(
    tiny_checkpoint, max_prefill_tokens: int, decode_steps: int, dtype: str, arch: str
) -> None:
    model = tiny_checkpoint(arch)
    requests = _requests(sampled=True)
    reference = make_engine(model, prefix_cache=False, dtype=dtype).generate(requests)
    other = make_engine(
        model, max_prefill_tokens=max_prefill_tokens, decode_steps=decode_steps, dtype=dtype
    ).generate(requests)
    for a, b in zip(reference, other, strict=True):
        _assert_same(a, b, atol=0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_laid_a_cache_line_apart_give_the_same_numbers(
    tiny_checkpoint, dtype: str, monkeypatch: pytest.MonkeyPatch, cpu_kernel: str
) -> None:
    """cpu_ops.product_rows pads rows a multiple of 4 KiB long; the tiny model has none, so
    here every width counts as one (64 and 128 features are multiples of 128 bytes in both
    dtypes): the norms' and the MLP's outputs then reach the next products a line apart, and
    every token and logprob is the one of contiguous rows."""
    model = tiny_checkpoint("llama")
    requests = _requests(sampled=True)
    contiguous = make_engine(model, dtype=dtype).generate(requests)
    monkeypatch.setattr(cpu_ops, "ALIASING_ROW_BYTES", 128)
    strides: list[tuple[int, int]] = []  # (row stride, width) of each one laid out
    product_rows = cpu_ops.product_rows

    def recorded(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        out = product_rows(rows, width, dtype)
        strides.append((out.stride(0), width))
        return out

    monkeypatch.setattr(cpu_ops, "product_rows", recorded)
    padded = make_engine(model, dtype=dtype).generate(requests)
    assert {width for _, width in strides} == {64, 128}  # the norms', the MLP's
    assert all(stride > width for stride, width in strides)
    for a, b in zip(contiguous, padded, strict=True):
        _assert_same(a, b, atol=0.0)


def test_heads_of_64_in_bfloat16_alone_batched_and_chunked(
    small_checkpoint, cpu_kernel: str
) -> None:
    """The small preset's heads of 64 in bfloat16: the size the AMX kernels take on a CPU
    that has them (cpu_kernel runs both kinds there)."""
    requests = _requests(sampled=True)[:4]
    batched = make_engine(small_checkpoint, dtype="bfloat16").generate(requests)
    cold = make_engine(small_checkpoint, prefix_cache=False, dtype="bfloat16")
    chunked = make_engine(small_checkpoint, dtype="bfloat16", max_prefill_tokens=7, decode_steps=3)
    for request, together in zip(requests, batched, strict=True):
        _assert_same(cold.generate([request])[0], together, atol=0.0)
    for alone, together in zip(chunked.generate(requests), batched, strict=True):
        _assert_same(alone, together, atol=0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prompt_logprob_chunk_sizes_agree(tiny_checkpoint, dtype: str) -> None:
    model = tiny_checkpoint("mistral")
    request = OfflineRequest(list(range(3, 200)), max_tokens=1, num_top=20, prompt_logprob_start=0)
    runs = [
        make_engine(model, prompt_chunk=c, dtype=dtype).generate([request])[0] for c in (1, 7, 4096)
    ]
    for other in runs[1:]:
        np.testing.assert_allclose(other.prompt_logprobs, runs[0].prompt_logprobs, atol=0.0, rtol=0)
        np.testing.assert_allclose(
            np.array(other.prompt_top_logprobs),
            np.array(runs[0].prompt_top_logprobs),
            atol=0.0,
            rtol=0,
        )
        assert np.array_equal(np.array(other.prompt_top_ids), np.array(runs[0].prompt_top_ids))


def test_prompt_logprobs_from_start_position(tiny_checkpoint) -> None:
    """Scoring from s returns exactly the positions >= s, with the values of a full scoring."""
    engine = make_engine(tiny_checkpoint("llama"), max_prefill_tokens=10)
    prompt = list(range(3, 50))
    full = engine.generate([OfflineRequest(prompt, max_tokens=1, prompt_logprob_start=0)])[0]
    for start in (1, 9, 10, 11, 30, 46):
        part = engine.generate([OfflineRequest(prompt, max_tokens=1, prompt_logprob_start=start)])[
            0
        ]
        assert len(part.prompt_logprobs) == len(prompt) - start
        np.testing.assert_allclose(
            part.prompt_logprobs, full.prompt_logprobs[start - 1 :], atol=0.0, rtol=0
        )


@pytest.mark.parametrize("arch", ["llama", "qwen3", "olmo2", "gemma2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_last_layer_of_the_tokens_read_equals_one_of_every_token(
    tiny_checkpoint, dtype: str, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """Prefill steps compute the last layer only for the states they read (each row's last,
    its scored prompt positions): every token's keys and values, the rest (q included) for
    those alone; computing it for every token gives the same bits."""
    model = tiny_checkpoint(arch)
    requests = _requests(sampled=True)
    requests += [OfflineRequest(list(range(3, 90)), max_tokens=3, prompt_logprob_start=0)]
    engine = make_engine(model, max_prefill_tokens=40, dtype=dtype)
    trims: list[bool] = []
    real_plan = model_runner.plan_last_layer

    def counted(attention, rows):  # type: ignore[no-untyped-def]
        plan = real_plan(attention, rows)
        trims.append(plan is not None)
        return plan

    monkeypatch.setattr(model_runner, "plan_last_layer", counted)
    last = engine.runner.model.layers[-1]
    products: list[tuple[str, int]] = []  # the last layer's q/k/v products, rows in order
    last.qkv_proj.register_forward_hook(lambda m, x, y: products.append(("qkv", x[0].shape[0])))
    real_kv = last.kv_kernel

    def kv_rows(x: torch.Tensor) -> torch.Tensor:
        products.append(("kv", x.shape[0]))
        return real_kv(x)

    last.kv_kernel = kv_rows
    trimmed = engine.generate(requests)
    assert any(trims)
    # NOTE: a trimmed step's kept tokens go through q/k/v just before every token's k/v.
    pairs = [(products[i - 1], p) for i, p in enumerate(products) if p[0] == "kv"]
    assert len(pairs) == sum(trims) and all(q[0] == "qkv" and q[1] < kv[1] for q, kv in pairs)
    monkeypatch.setattr(model_runner, "plan_last_layer", lambda attention, rows: None)
    whole = make_engine(model, max_prefill_tokens=40, dtype=dtype).generate(requests)
    for a, b in zip(trimmed, whole, strict=True):
        _assert_same(a, b, atol=0.0)


HOST = Upload(torch.device("cpu"))


def test_the_last_layer_keeps_each_rows_last_token_and_scored_positions() -> None:
    extend = np.array([5, 1, 4])
    prefix = np.array([0, 9, 20])
    keep_from = np.array([4, 0, 1])  # row 2 scores its last three prompt positions
    rows = LastLayerRows.plan(
        extend, np.array([0, 5, 6]), prefix, keep_from, np.array([7, 8, 9]), HOST
    )
    assert rows is not None
    assert rows.index.tolist() == [4, 5, 7, 8, 9]
    assert rows.first_pos.tolist() == [4, 9, 21]
    assert rows.counts.tolist() == [1, 1, 3] and rows.starts.tolist() == [0, 1, 2]
    assert rows.prompt_index.tolist() == [2, 3, 4]
    every = LastLayerRows.plan(
        np.ones(3, np.int64),
        np.arange(3),
        prefix,
        np.zeros(3, np.int64),
        np.zeros(0, np.int64),
        HOST,
    )
    assert every is None  # a decode step reads every token


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_experts_in_passes_give_the_same_bits(
    tiny_checkpoint, arch: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill chunk goes through a mixture of experts in passes of TOKENS_PER_PASS tokens
    (bounded memory); passes of 7 give the bits of one pass (Qwen2-MoE: the shared expert
    too, from Python; Qwen3-MoE: inside the layer stack's call)."""
    from tokenmill.tp_worker.model import moe

    model = tiny_checkpoint(arch)
    requests = _requests(sampled=True)
    whole = make_engine(model, dtype=dtype).generate(requests)
    monkeypatch.setattr(moe, "TOKENS_PER_PASS", 7)
    for a, b in zip(whole, make_engine(model, dtype=dtype).generate(requests), strict=True):
        _assert_same(a, b, atol=0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "gpt_oss"])
def test_the_native_experts_give_the_python_loops_bits(
    tiny_checkpoint, arch: str, dtype: str
) -> None:
    """csrc/moe.cpp (every expert of a layer in one call) against model/moe.py's loop over
    the experts from Python, with the same packed panels: the same bits, prompt and decode."""
    from tokenmill.tp_worker.model.moe import SparseMoe

    model, requests = tiny_checkpoint(arch), _requests(sampled=True)
    native = make_engine(model, dtype=dtype)
    assert all(m.panels for m in native.runner.model.modules() if isinstance(m, SparseMoe))
    looped = make_engine(model, dtype=dtype)
    for module in looped.runner.model.modules():
        if isinstance(module, SparseMoe):
            module.panels = None
    for a, b in zip(native.generate(requests), looped.generate(requests), strict=True):
        _assert_same(a, b, atol=0.0)
