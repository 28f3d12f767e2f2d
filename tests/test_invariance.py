"""Every way of scheduling the same requests gives the same tokens and logprobs, bit for bit:
batched or alone, chunked prefill or whole, one or several decode steps per round trip, any
prompt logprob chunk size, in float32 and in bfloat16.

test_dispatch.py runs this file again under other math-library dispatch settings and thread
counts, so a change that holds only on the developer's own CPU fails there too."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_engine

from tokenmill.tp_worker.offline import OfflineOutput, OfflineRequest

LENGTHS = [3, 9, 17, 30, 64, 5, 41, 12]


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_batch_of_8_equals_each_alone(tiny_checkpoint, sampled: bool, dtype: str) -> None:
    """Alone on a cold engine, and alone again on the warm one (a prefix-cache hit)."""
    model = tiny_checkpoint("llama")
    warm = make_engine(model, dtype=dtype)
    requests = _requests(sampled)
    batched = warm.generate(requests)
    cold = make_engine(model, prefix_cache=False, dtype=dtype)
    for request, together in zip(requests, batched, strict=True):
        _assert_same(cold.generate([request])[0], together, atol=0.0)
        _assert_same(warm.generate([request])[0], together, atol=0.0)
    assert warm.controller.kv.hit_tokens > 0 and cold.controller.kv.hit_tokens == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("max_prefill_tokens", "decode_steps"), [(7, 1), (4096, 4), (16, 3)])
def test_chunked_prefill_and_multi_step(
    tiny_checkpoint, max_prefill_tokens: int, decode_steps: int, dtype: str
) -> None:
    model = tiny_checkpoint("qwen2")
    requests = _requests(sampled=True)
    reference = make_engine(model, prefix_cache=False, dtype=dtype).generate(requests)
    other = make_engine(
        model, max_prefill_tokens=max_prefill_tokens, decode_steps=decode_steps, dtype=dtype
    ).generate(requests)
    for a, b in zip(reference, other, strict=True):
        _assert_same(a, b, atol=0.0)


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
