"""Every sampling parameter on the real model, through the real controller pieces (scheduler,
prefix cache, batch builder, output processor) and a ModelRunner in `--logprobs-mode
processed`, against a plain per-request reference.

The raw logits of each step are recorded where the runner hands them to the logit adjuster;
the reference then rebuilds, for each sampled token alone and in float64, the penalties,
bias, stop ban, temperature and filters, and the seeded draw (the same exponential noise of
(seed, position)); the runner's tokens and processed logprobs (of every vocabulary id) must
agree. Run together, alone, chunked and from the prefix cache, requests get the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from test_penalties import reference_logits
from test_sampling import reference_probs

from tokenmill.controller.batch_builder import build_forward_batch
from tokenmill.controller.kv_allocator import KvAllocator
from tokenmill.controller.output_processor import OutputProcessor
from tokenmill.controller.request import Request
from tokenmill.controller.scheduler import ScheduledRow, Scheduler
from tokenmill.controller.slot_pool import IndexPool
from tokenmill.protocol.arrays import pack, unpack
from tokenmill.protocol.requests import (
    DetokenizeParams,
    GenerateRequest,
    LogprobParams,
    SamplingParams,
)
from tokenmill.protocol.step import StepResult
from tokenmill.tp_worker.config import RunnerConfig
from tokenmill.tp_worker.model_runner import ModelRunner
from tokenmill.tp_worker.sample.sampling import exponential_noise


@dataclass
class Sampled:
    """One sampled token and what the reference needs to rebuild it."""

    raw: np.ndarray  # [V] float32 logits before any change
    prompt: list[int]
    output: list[int]  # generated before this token
    token: int
    processed: np.ndarray  # [V] float32 processed logprobs the runner returned


@dataclass
class Run:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    sampled: dict[str, list[Sampled]] = field(default_factory=dict)
    finish: dict[str, str | None] = field(default_factory=dict)


def _runner(model: Path) -> ModelRunner:
    config = RunnerConfig(
        model=str(model),
        kv_cache_tokens=4096,
        max_running_requests=6,
        max_model_len=512,
        dtype="float32",
        device="cpu",
        logprobs_mode="processed",
    )
    return ModelRunner(config)


def run(runner: ModelRunner, messages: list[GenerateRequest], max_prefill: int = 4096) -> Run:
    """The controller's loop, in-process: schedule, build, step, apply, release."""
    rows = runner.config.max_running_requests
    kv = KvAllocator(IndexPool(runner.kv_cache_tokens, "kv slots"), enable_cache=True)
    scheduler = Scheduler(kv, IndexPool(rows, "table rows"), rows, max_prefill)
    processor = OutputProcessor(runner.model_config.eos_token_ids, runner.max_model_len)
    for i, message in enumerate(messages):
        scheduler.waiting.append(Request.from_message(message, i))
    recorded: list[torch.Tensor] = []
    adjust = _record_raw_logits(runner, recorded)
    out, step = Run(), 0
    try:
        while scheduler.has_work():
            step += 1
            scheduled = scheduler.schedule()
            before = [list(r.request.output_ids) for r in scheduled]
            result = runner.step(build_forward_batch(step, scheduled))
            processor.apply(scheduled, result)
            _collect(out, scheduled, before, result, recorded[-1])
            for row in scheduled:
                request = row.request
                if row.is_prefill and not request.is_prefill and not request.finished:
                    kv.cache_computed(request)
                if request.finished and request in scheduler.running:
                    out.outputs[request.req_id] = list(request.output_ids)
                    out.finish[request.req_id] = request.finish_reason
                    scheduler.finish(request)
    finally:
        runner.adjuster.adjust = adjust  # type: ignore[method-assign]
    kv.check_integrity([])
    return out


def _record_raw_logits(runner: ModelRunner, recorded: list[torch.Tensor]) -> Callable:
    """Wraps the adjuster so that each step's raw logits [B, V] land in `recorded`."""
    adjust = runner.adjuster.adjust

    def recording(logits: torch.Tensor, *args: object) -> torch.Tensor:
        recorded.append(logits.clone())
        return adjust(logits, *args)  # type: ignore[arg-type]

    runner.adjuster.adjust = recording  # type: ignore[method-assign]
    return adjust


def _collect(
    out: Run,
    scheduled: list[ScheduledRow],
    before: list[list[int]],
    result: StepResult,
    raw: torch.Tensor,
) -> None:
    token_lps = unpack(result.token_ids_logprobs)[0]
    offsets = np.cumsum([0] + [len(r.request.message.logprobs.token_ids) for r in scheduled])
    for b, row in enumerate(scheduled):
        request = row.request
        if not row.samples or len(request.output_ids) == len(before[b]):
            continue
        out.sampled.setdefault(request.req_id, []).append(
            Sampled(
                raw=raw[b].numpy(),
                prompt=request.prompt_ids,
                output=before[b],
                token=request.output_ids[-1],
                processed=token_lps[offsets[b] : offsets[b + 1]],
            )
        )
        out.logprobs.setdefault(request.req_id, []).append(float(unpack(result.logprobs)[0, b]))


def _message(
    req_id: str, prompt: list[int], vocab: int, scored: bool = True, **sampling: object
) -> GenerateRequest:
    return GenerateRequest(
        req_id=req_id,
        input_ids=pack(np.asarray(prompt, np.int32)),
        sampling=SamplingParams(**{"max_tokens": 10, **sampling}),  # type: ignore[arg-type]
        logprobs=LogprobParams(
            return_logprob=True, token_ids=tuple(range(vocab)) if scored else ()
        ),
        detokenize=DetokenizeParams(),
    )


def _messages(vocab: int, eos: int) -> list[GenerateRequest]:
    rng = np.random.default_rng(7)

    def prompt(n: int) -> list[int]:
        return rng.integers(3, 40, n).tolist()  # a small id range: prompts repeat tokens

    shared = prompt(37)
    params: list[dict[str, object]] = [
        {"temperature": 0.9, "presence_penalty": 1.5, "frequency_penalty": 0.7, "seed": 1},
        {"temperature": 0.0, "repetition_penalty": 1.8},
        {"temperature": 1.2, "top_k": 20, "top_p": 0.9, "repetition_penalty": 0.7, "seed": 2},
        {"temperature": 0.7, "min_p": 0.05, "logit_bias": ((5, 8.0), (6, -100.0)), "seed": 3},
        {"temperature": 1.0, "min_tokens": 6, "logit_bias": ((eos, 30.0),), "seed": 4},
        {"temperature": 0.8, "top_p": 0.8, "seed": 5},  # no change to the logits at all
    ]
    messages = [
        _message(f"r{i}", prompt(int(rng.integers(5, 30))), vocab, **p)
        for i, p in enumerate(params)
    ]
    # The same prompt three times: the later two restart from the prefix cache.
    messages += [
        _message(
            f"s{i}",
            shared,
            vocab,
            temperature=1.0,
            frequency_penalty=1.0,
            repetition_penalty=1.6,
            seed=10 + i,
        )
        for i in range(3)
    ]
    return messages


def _check_against_reference(
    s: Sampled, p: SamplingParams, eos_ids: tuple[int, ...], label: str
) -> None:
    z = reference_logits(s.raw, s.prompt, s.output, p, eos_ids)
    greedy = p.temperature == 0
    probs = reference_probs(z, 1.0 if greedy else p.temperature, p.top_k, p.top_p, p.min_p)
    if greedy:
        assert s.token == int(np.argmax(z)), label
    else:
        position = len(s.prompt) + len(s.output)
        noise = exponential_noise(torch.tensor([p.seed]), torch.tensor([position]), len(z))
        race = probs / noise[0].double().numpy()
        top2 = np.sort(race)[-2:]
        if top2[1] - top2[0] > 1e-4 * top2[1]:  # else a tie within float32 rounding
            assert s.token == int(np.argmax(race)), label
    kept = probs > 1e-12
    got = s.processed.astype(np.float64)
    assert np.isfinite(got[kept]).all(), label
    np.testing.assert_allclose(np.exp(got), probs, atol=2e-5, err_msg=label)
    assert abs(np.exp(got[np.isfinite(got)]).sum() - 1.0) < 1e-4, label


@pytest.fixture(scope="module")
def setup(tiny_checkpoint) -> tuple[ModelRunner, list[GenerateRequest]]:
    runner = _runner(tiny_checkpoint("llama"))
    vocab = runner.model_config.vocab_size
    return runner, _messages(vocab, runner.model_config.eos_token_ids[0])


def test_tokens_and_processed_logprobs_match_the_reference(setup) -> None:
    runner, messages = setup
    result = run(runner, messages, max_prefill=16)  # prompts chunked, rows shared
    eos_ids = runner.model_config.eos_token_ids
    for message in messages:
        sampled = result.sampled[message.req_id]
        assert [s.token for s in sampled] == result.outputs[message.req_id]
        for k, s in enumerate(sampled):
            _check_against_reference(s, message.sampling, eos_ids, f"{message.req_id}[{k}]")
            assert result.logprobs[message.req_id][k] == pytest.approx(
                float(s.processed[s.token]), abs=1e-6
            )
    # min_tokens with eos pushed up by +30: the first 6 outputs cannot be eos, the 7th is.
    biased = result.outputs["r4"]
    assert len(biased) == 7 and biased[-1] in eos_ids and not set(biased[:6]) & set(eos_ids)
    assert result.finish["r4"] == "stop"


def test_same_tokens_alone_together_chunked_and_cached(setup) -> None:
    runner, messages = setup
    unscored = [
        GenerateRequest(m.req_id, m.input_ids, m.sampling, LogprobParams(True), m.detokenize)
        for m in messages
    ]
    together = run(runner, unscored)
    chunked = run(runner, unscored[::-1], max_prefill=7)
    for message in unscored:
        alone = run(runner, [message])
        for other in (together, chunked):
            assert other.outputs[message.req_id] == alone.outputs[message.req_id]
            np.testing.assert_allclose(
                other.logprobs[message.req_id], alone.logprobs[message.req_id], atol=1e-5
            )
    # The shared prompt's choices differ by seed only; rerun, each reproduces itself.
    again = run(runner, unscored[-3:])
    for req_id in ("s0", "s1", "s2"):
        assert again.outputs[req_id] == together.outputs[req_id]
