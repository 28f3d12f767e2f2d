"""Speculative decoding gives the tokens and the logprob bits of plain decoding.

A step verifies a row's drafts as one chunk and samples at each position as plain decoding
samples there, so whatever the drafts are, only the speed may change. The tiny random models
rarely repeat themselves, so most of these tests draft with an oracle: the reference run's
own tokens, with a wrong one in some steps, so that steps keep all, some or none of their
drafts. The real n-gram proposer runs in the rest (and on SmolLM2 in test_smollm2.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_same_bits, make_engine

from tokenmill.controller import speculation
from tokenmill.controller.request import Request
from tokenmill.controller.speculation import (
    DraftState,
    SpeculativeConfig,
    Speculator,
    _lookup,
)
from tokenmill.offline.engine import OfflineEngine, OfflineOutput, OfflineRequest

NGRAM = '{"method": "ngram", "num_speculative_tokens": %d}'


def _requests(sampled: bool) -> list[OfflineRequest]:
    """A mixed batch: greedy or seeded rows with top logprobs, caller-given ids, prompt
    logprobs, penalties, min_tokens, and a row that opts out."""
    rng = np.random.default_rng(1)
    lengths = [5, 17, 30, 9, 12, 20, 3]
    base = [
        OfflineRequest(
            rng.integers(3, 1000, n).tolist(),
            max_tokens=24,
            num_top=3 if i % 2 else 0,
            temperature=0.8 if sampled and i % 3 else 0.0,
            top_p=0.9,
            seed=i,
        )
        for i, n in enumerate(lengths)
    ]
    base[2] = replace(base[2], token_ids=(5, 7, 11), prompt_logprob_start=4)
    base[3] = replace(base[3], presence_penalty=0.5, frequency_penalty=0.3)
    base[4] = replace(base[4], repetition_penalty=1.3)
    base[5] = replace(base[5], min_tokens=10, stop_at_eos=True)
    base[6] = replace(base[6], speculative=False)
    return base


@pytest.fixture()
def oracle_drafts(monkeypatch: pytest.MonkeyPatch):
    """oracle_drafts(requests, outputs): the speculator proposes each request's reference
    tokens from here on, one of them wrong where the output count is 1 mod 3."""

    def install(requests: list[OfflineRequest], outputs: list[OfflineOutput]) -> None:
        future = {tuple(r.prompt_ids): o.output_ids for r, o in zip(requests, outputs, strict=True)}

        def propose(self: Speculator, request: Request, limit: int, num_rows: int) -> list[int]:
            limit = min(limit, self.config.num_speculative_tokens)
            n = len(request.output_ids)
            drafts = future[tuple(request.prompt_ids)][n : n + limit]
            if drafts and n % 3 == 1:
                wrong = n % len(drafts)
                drafts[wrong] = (drafts[wrong] + 1) % 1000
            return drafts

        monkeypatch.setattr(speculation.Speculator, "propose", propose)

    return install


def _counters(engine: OfflineEngine) -> speculation.SpecCounters:
    assert engine.controller.speculator is not None
    return engine.controller.speculator.counters


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_drafts_change_no_token_and_no_logprob_bit(
    tiny_checkpoint, oracle_drafts, k: int, sampled: bool
) -> None:
    """In a mixed batch cold (every prompt computed) and warm (the same requests again:
    prefix-cache hits), then each request alone, against plain decoding; some steps keep
    every draft, some a few, some none."""
    model = tiny_checkpoint("llama")
    requests = _requests(sampled)
    reference = make_engine(model, prefix_cache=False).generate(requests)
    oracle_drafts(requests, reference)
    engine = make_engine(model, speculative_config=NGRAM % k)
    for _ in range(2):
        for a, b in zip(reference, engine.generate(requests), strict=True):
            assert_same_bits(a, b)
    alone = make_engine(model, prefix_cache=False, speculative_config=NGRAM % k)
    for request, a in zip(requests, reference, strict=True):
        assert_same_bits(a, alone.generate([request])[0])
    counters = _counters(engine)
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert counters.accepted_per_pos[k - 1] > 0  # NOTE: some steps kept all k
    assert engine.controller.kv.hit_tokens > 0


@pytest.mark.parametrize(
    "settings",
    [
        {"dtype": "bfloat16"},
        {"cpu_kernels": False},  # NOTE: torch's SDPA: drafts attend one query each
        {"logprobs_mode": "processed"},
        {"decode_steps": 4},
        {"arch": "qwen3", "dtype": "bfloat16"},
        {"arch": "gemma2", "dtype": "bfloat16"},
        {"arch": "gemma3", "cpu_kernels": False},
        {"arch": "qwen3_moe", "dtype": "bfloat16"},
    ],
    ids=[
        "bfloat16",
        "sdpa",
        "processed",
        "decode-steps-4",
        "qwen3",
        "gemma2",
        "gemma3-sdpa",
        "qwen3-moe",
    ],
)
def test_the_same_bits_on_every_path(
    tiny_checkpoint, oracle_drafts, settings: dict, cpu_kernel: str
) -> None:
    """cpu_kernel: on a CPU with AMX, the tile kernels' bfloat16 run too."""
    settings = dict(settings)
    model = tiny_checkpoint(settings.pop("arch", "qwen2"))
    requests = _requests(sampled=True)
    reference = make_engine(model, prefix_cache=False, **settings).generate(requests)
    oracle_drafts(requests, reference)
    engine = make_engine(model, prefix_cache=False, speculative_config=NGRAM % 4, **settings)
    for a, b in zip(reference, engine.generate(requests), strict=True):
        assert_same_bits(a, b)
    assert _counters(engine).num_accepted_tokens > 0
    pool = engine.controller.slots
    assert pool.num_free == pool.size  # NOTE: no prefix cache: every slot is back


def test_a_request_that_opts_out_never_drafts(tiny_checkpoint, oracle_drafts) -> None:
    model = tiny_checkpoint("llama")
    requests = [replace(r, speculative=False) for r in _requests(sampled=False)]
    reference = make_engine(model).generate(requests)
    oracle_drafts(requests, reference)
    engine = make_engine(model, speculative_config=NGRAM % 4)
    for a, b in zip(reference, engine.generate(requests), strict=True):
        assert_same_bits(a, b)
    assert _counters(engine).num_drafts == 0


def test_preempted_requests_recompute_what_they_kept(tiny_checkpoint, oracle_drafts) -> None:
    """A KV cache too small for the batch: requests are preempted mid-output and replayed;
    drafts never take a slot a running request needs."""
    model = tiny_checkpoint("llama")
    requests = [replace(r, max_tokens=40) for r in _requests(sampled=True)]
    reference = make_engine(model, prefix_cache=False).generate(requests)
    oracle_drafts(requests, reference)
    engine = _small_cache_engine(model, NGRAM % 4)
    for a, b in zip(reference, engine.generate(requests), strict=True):
        assert_same_bits(a, b)
    assert engine.controller.scheduler.num_preemptions > 0
    assert _counters(engine).num_accepted_tokens > 0


def _small_cache_engine(model: Path, speculative_config: str) -> OfflineEngine:
    """200 KV slots for 8 requests of up to 70 tokens: some are preempted and replayed."""
    from tokenmill.tp_worker.config import RunnerConfig
    from tokenmill.tp_worker.model_runner import ModelRunner

    spec = SpeculativeConfig.parse(speculative_config)
    config = RunnerConfig(
        model=str(model),
        kv_cache_tokens=200,
        max_running_requests=8,
        max_model_len=128,
        dtype="float32",
        device="cpu",
        draft_model=spec.model if spec is not None else "",
    )
    return OfflineEngine(ModelRunner(config), speculative_config=speculative_config)


def test_real_ngram_drafts_on_a_repeating_output(tiny_checkpoint) -> None:
    """The n-gram proposer itself, on prompts whose greedy output repeats (the tiny llama
    falls into a loop after a run of one token)."""
    model = tiny_checkpoint("llama")
    requests = [
        OfflineRequest([11] * 30, max_tokens=60, num_top=2),
        OfflineRequest([5, 6, 7, 8] * 10, max_tokens=40, temperature=0.7, seed=4),
    ]
    reference = make_engine(model).generate(requests)
    engine = make_engine(model, speculative_config=NGRAM % 4)
    for a, b in zip(reference, engine.generate(requests), strict=True):
        assert_same_bits(a, b)
    assert _counters(engine).num_accepted_tokens > 0


def _history(tokens: list[int]) -> bytearray:
    return bytearray(b"".join(t.to_bytes(4, "little") for t in tokens))


def test_lookup_takes_the_longest_latest_match() -> None:
    # the 3-gram [1, 2, 3] was followed by 4, 5 first and by 9, 8 later: the later wins
    assert _lookup(_history([1, 2, 3, 4, 5, 0, 1, 2, 3, 9, 8, 1, 2, 3]), 2, 4, 3) == [9, 8, 1]
    # a 2-gram only: [7, 3] ends the tokens and was seen once
    assert _lookup(_history([7, 3, 6, 6, 1, 7, 3]), 2, 4, 2) == [6, 6]
    assert _lookup(_history([1, 2, 3, 4]), 2, 4, 3) == []  # no earlier occurrence
    # bytes that match across a token boundary are no match: 0x0100 0x0000 vs 0x0001 ...
    assert _lookup(_history([256, 0, 5, 1, 0]), 1, 1, 2) == [5, 1]
    assert _lookup(_history([256, 5, 1, 0]), 1, 1, 2) == []


def _drafting_request(tokens: list[int]) -> Request:
    request = Request.__new__(Request)
    request.prompt_ids, request.output_ids = list(tokens), []
    request.drafts, request.grammar = DraftState(), None
    return request


def test_a_request_drafts_as_many_tokens_as_pay() -> None:
    """As many drafts as the chance of each being kept pays for (StepCost.break_even, here
    the prior's: 1 row 6%, 8 rows 33%); a request with no record drafts all it may, and one
    whose drafts keep failing stops for a while."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1))
    request = _drafting_request([1, 2, 3, 4, 5, 6] * 4)
    assert spec.wants_drafts(request, num_running=1)
    assert spec.propose(request, 10, num_rows=8) == [1, 2, 3, 4]
    assert spec.propose(request, 2, num_rows=8) == [1, 2]
    for _ in range(30):
        spec.record(request, 4, 1)  # NOTE: the second always fails: one draft pays
    assert spec.propose(request, 10, num_rows=8) == [1]
    assert spec.propose(request, 10, num_rows=1) == [1, 2]  # NOTE: 1/16 of the time it pays
    for _ in range(150):
        spec.record(request, 4, 0)
    assert spec.propose(request, 10, num_rows=1) == []
    assert not spec.wants_drafts(request, num_running=1)
    request.output_ids += [1] * speculation.OFF_OUTPUTS
    assert spec.wants_drafts(request, num_running=1)  # NOTE: it tries again later,
    assert request.drafts is not None and not request.drafts.reached  # from the prior
    by_batch = Speculator(SpeculativeConfig(disable_by_batch_size=2))
    fresh = _drafting_request([1, 2])
    assert by_batch.wants_drafts(fresh, 2) and not by_batch.wants_drafts(fresh, 3)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"method": "eagle", "num_speculative_tokens": 2}', "'eagle' is not served"),
        ('{"method": "draft_model"}', 'needs "model"'),
        ('{"model": "/d", "prompt_lookup_max": 3}', "apply to method ngram only"),
        ('{"method": "ngram", "model": "/d"}', '"model" goes with method draft_model'),
        ('{"model": "/d", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
        ('{"method": "medusa2"}', "unknown method"),
        ('{"method": "ngram", "k": 3}', "unknown key"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be"),
        ('{"num_speculative_tokens": 17}', "num_speculative_tokens must be"),
        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 3}', "prompt_lookup_min 5 >"),
        ("[4]", "a JSON object"),
        ("{ngram}", "not JSON"),
    ],
)
def test_a_config_it_cannot_serve_is_an_error_at_start(text: str, error: str) -> None:
    from tokenmill.frontend.server_config import SchedulerArgs, ServerConfig, validate

    with pytest.raises(ValueError, match=error):
        validate(ServerConfig(scheduler=SchedulerArgs(speculative_config=text)))


def test_the_config_as_vllm_takes_it() -> None:
    config = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
        '"prompt_lookup_min": 1}'
    )
    assert config == SpeculativeConfig("ngram", 3, 5, 1, 0)
    assert SpeculativeConfig.parse("") is None
    assert SpeculativeConfig.parse('{"prompt_lookup_max": 1}') == SpeculativeConfig(
        "ngram", 4, 1, 1, 0
    )


def test_a_constrained_row_beside_rows_with_drafts(tiny_checkpoint) -> None:
    """A constrained request with fewer drafts than another row of its step (here none: its
    prompt never repeats) needs a mask for each of the step's iterations (this once crashed
    the worker: the masks were counted by the constrained rows' drafts alone)."""
    from tokenmill.frontend.api.constraints import regex_grammar
    from tokenmill.protocol.requests import Constraint

    model = tiny_checkpoint("llama")
    regex = Constraint("regex", regex_grammar(r"[a-z]{5,40}", "r"))
    # NOTE: a constrained output that repeats itself: its own n-gram drafts, cut where the
    # grammar refuses one
    repeats = Constraint("regex", regex_grammar(r"(ab cd ){6}(ef|gh)", "r"))
    requests = [
        OfflineRequest([11] * 30, max_tokens=60, num_top=2),
        OfflineRequest([300, 301, 302, 57], max_tokens=30, constraint=regex),
        OfflineRequest([40, 41], max_tokens=40, num_top=2, constraint=repeats),
        OfflineRequest([42, 43], max_tokens=40, temperature=0.9, seed=5, constraint=repeats),
    ]

    reference = make_engine(model, grammar=True).generate(requests)
    engine = make_engine(model, grammar=True, speculative_config=NGRAM % 4)
    for a, b in zip(reference, engine.generate(requests), strict=True):
        assert_same_bits(a, b)
    assert _counters(engine).num_drafts > 0


@pytest.fixture()
def draft_of(tmp_path):
    """draft_of(model, layers): the model's first layers as a draft model (its tokenizer)."""
    from tokenmill.cli.make_model.draft import layer_truncated

    return lambda model, layers: layer_truncated(model, tmp_path / f"draft-{layers}", layers)


def _draft_config(draft, k: int) -> str:
    return json.dumps({"model": str(draft), "num_speculative_tokens": k})


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("layers", [1, 2], ids=["first-layer", "whole"])
def test_a_draft_model_changes_no_token_and_no_logprob_bit(
    tiny_checkpoint, draft_of, k: int, sampled: bool, layers: int
) -> None:
    """A draft model run by the worker, cold and warm, in a mixed batch with penalties, a
    ban and prompt logprobs: the target's first layer of two (it agrees with the target at
    some positions), or both (the target itself: it proposes the target's own samples but
    where a penalty moves them, so most drafts are kept and the penalties count them)."""
    model = tiny_checkpoint("llama")
    requests = _requests(sampled)
    reference = make_engine(model, prefix_cache=False).generate(requests)
    engine = make_engine(model, speculative_config=_draft_config(draft_of(model, layers), k))
    for _ in range(2):
        for a, b in zip(reference, engine.generate(requests), strict=True):
            assert_same_bits(a, b)
    counters = _counters(engine)
    assert 0 < counters.num_accepted_tokens <= counters.num_draft_tokens
    if layers == 1:
        assert counters.num_accepted_tokens < counters.num_draft_tokens
    assert engine.controller.kv.hit_tokens > 0


@pytest.mark.parametrize(
    "settings",
    [{}, {"dtype": "bfloat16"}, {"cpu_kernels": False}, {"decode_steps": 4}],
    ids=["float32", "bfloat16", "sdpa", "decode-steps-4"],
)
def test_the_target_as_its_own_draft_keeps_every_draft(tiny_checkpoint, settings: dict) -> None:
    """The draft samples with the target's noise at each position, so a draft model equal to
    the target proposes exactly the target's samples, greedy and seeded: every draft is kept
    (but where a penalty, a bias or a ban moves the target's pick: the draft sees none)."""
    model = tiny_checkpoint("qwen2")
    requests = [
        OfflineRequest(r.prompt_ids, max_tokens=24, num_top=r.num_top, temperature=r.temperature,
                       top_p=r.top_p, seed=r.seed)
        for r in _requests(sampled=True)
    ]  # fmt: skip
    reference = make_engine(model, prefix_cache=False, **settings).generate(requests)
    engine = make_engine(
        model, prefix_cache=False, speculative_config=_draft_config(model, 4), **settings
    )
    for a, b in zip(reference, engine.generate(requests), strict=True):
        assert_same_bits(a, b)
    counters = _counters(engine)
    assert counters.num_accepted_tokens == counters.num_draft_tokens > 0
    pool = engine.controller.slots
    assert pool.num_free == pool.size


def test_a_draft_model_after_preemption(tiny_checkpoint, draft_of) -> None:
    """Preempted requests recompute their tokens in both models (the draft's cache has the
    target's slots)."""
    model = tiny_checkpoint("llama")
    requests = [replace(r, max_tokens=40) for r in _requests(sampled=True)]
    reference = make_engine(model, prefix_cache=False).generate(requests)
    engine = _small_cache_engine(model, _draft_config(draft_of(model, 1), 4))
    for a, b in zip(reference, engine.generate(requests), strict=True):
        assert_same_bits(a, b)
    assert engine.controller.scheduler.num_preemptions > 0
    assert _counters(engine).num_accepted_tokens > 0


@pytest.mark.parametrize("draft", ["qwen2", "missing"])
def test_a_draft_model_it_cannot_use_is_refused_at_start(tiny_checkpoint, draft: str) -> None:
    """Another vocabulary (the tiny qwen2's tokenizer beside the tiny llama), or no
    checkpoint at all: `tokenmill serve` exits before it starts any process, naming it."""
    import subprocess
    import sys

    path = tiny_checkpoint("qwen2") if draft == "qwen2" else Path("/nonexistent/draft")
    spec = _draft_config(path, 2)
    command = [sys.executable, "-m", "tokenmill.cli.main", "serve"]
    done = subprocess.run(
        [*command, "--model", str(tiny_checkpoint("llama")), "--speculative-config", spec],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    why = "another vocabulary" if draft == "qwen2" else "neither a checkpoint directory"
    assert why in done.stderr and str(path) in done.stderr, done.stderr


def test_the_step_cost_fit_sets_what_drafts_must_keep() -> None:
    """A decode step of t tokens taking 9 + 0.7 t ms: a / b = 12.9 tokens, so a row must
    keep 7% of its drafts alone and 38% of them among 8 rows; the prior until the steps
    seen differ in size."""
    cost = speculation.StepCost()
    for _ in range(20):
        cost.observe(8, 9e-3 + 0.7e-3 * 8)
    assert cost.fixed_tokens() == speculation.PRIOR_FIXED_TOKENS  # NOTE: one size: no line
    for t in (1, 5, 8, 12, 30, 40) * 4:
        cost.observe(t, 9e-3 + 0.7e-3 * t)
    assert cost.fixed_tokens() == pytest.approx(9 / 0.7, rel=1e-6)
    assert cost.break_even(1) == pytest.approx(0.072, abs=1e-3)
    assert cost.break_even(8) == pytest.approx(0.384, abs=1e-3)
