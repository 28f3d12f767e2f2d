"""Routed experts returned (--enable-return-routed-experts): each position's top-k experts in
every MoE layer, as transformers' router picks them; the same in every schedule (alone or
batched, chunked, multi-step, from the prefix cache, with speculation); a rollout's equal to
its echo re-scoring, before and after new weights; SGLang's encoding on /generate and in the
OpenAI responses' `sglext`; a stop string's cut; the errors.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
import transformers
from helpers import make_engine
from server_process import ServerProcess, generate_once, start_server

from tokenmill.cli.make_model import build_checkpoint
from tokenmill.offline.engine import OfflineRequest
from tokenmill.tp_worker.config import RunnerConfig
from tokenmill.tp_worker.model_runner import ModelRunner

MOE_ARCHS = ("qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "gpt_oss")
KEY = "routed-experts-key"


def _prompt(seed: int, length: int = 60) -> list[int]:
    return np.random.default_rng(seed).integers(3, 1000, length).tolist()


def _hf_choices(model_dir: Path, ids: list[int], k: int) -> np.ndarray:
    """[len(ids) - 1, moe layers, k] transformers' router's top-k, best first."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        out = hf.eval()(torch.tensor([ids]), output_router_logits=True)
    return np.stack([torch.topk(x[:-1], k, dim=-1).indices.numpy() for x in out.router_logits], 1)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_the_experts_are_the_ones_transformers_routes_to(arch: str, tiny_checkpoint) -> None:
    """Every position of prompt and completion but the last sampled token (never computed):
    transformers' router's choices in order, -1 in the dense layers (Qwen3-MoE's first)."""
    model = tiny_checkpoint(arch)
    prompt = _prompt(0)
    engine = make_engine(model, routed_experts=True)
    out = engine.generate([OfflineRequest(prompt, max_tokens=8, routed_experts_start=0)])[0]
    routed = out.routed_experts
    assert routed is not None and routed.dtype == np.int16
    config = engine.runner.model_config
    assert routed.shape == (len(prompt) + 8 - 1, config.num_layers, config.experts_per_token)
    dense = [i for i in range(config.num_layers) if i not in config.moe_layers]
    assert (routed[:, dense] == -1).all()
    expected = _hf_choices(model, prompt + out.output_ids, config.experts_per_token)
    np.testing.assert_array_equal(routed[:, list(config.moe_layers)], expected)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_same_experts_in_every_schedule(dtype: str, tiny_checkpoint) -> None:
    """A request alone, whole, one token a step, against the same request among three others
    whose tokens share its experts, its prompt chunked by 16 tokens, decoded 3 steps at a
    time; then found in the prefix cache; then with n-gram speculation: the same experts
    (and tokens) at every position."""
    model = tiny_checkpoint("qwen3_moe")
    prompt = _prompt(1, 90)
    asked = OfflineRequest(prompt, max_tokens=12, routed_experts_start=0)
    alone = make_engine(model, dtype=dtype, prefix_cache=False, routed_experts=True)
    reference = alone.generate([asked])[0]
    assert reference.routed_experts is not None
    busy = make_engine(
        model, dtype=dtype, max_prefill_tokens=16, decode_steps=3, routed_experts=True
    )
    others = [OfflineRequest(_prompt(seed, 70), max_tokens=12) for seed in (2, 3, 4)]
    batched = busy.generate([others[0], asked, *others[1:]])[1]
    cached = busy.generate([asked])[0]
    speculative = make_engine(
        model,
        dtype=dtype,
        routed_experts=True,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
    )
    drafted = speculative.generate([asked])[0]
    for other in (batched, cached, drafted):
        assert other.output_ids == reference.output_ids
        np.testing.assert_array_equal(other.routed_experts, reference.routed_experts)


def test_from_a_start_position(tiny_checkpoint) -> None:
    """SGLang's routed_experts_start_len: positions [start, prompt + completion - 1)."""
    engine = make_engine(tiny_checkpoint("qwen3_moe"), routed_experts=True)
    prompt = _prompt(5, 40)
    whole, part = engine.generate(
        [
            OfflineRequest(prompt, max_tokens=6, routed_experts_start=0),
            OfflineRequest(prompt, max_tokens=6, routed_experts_start=40),
        ]
    )
    assert part.routed_experts is not None and whole.routed_experts is not None
    np.testing.assert_array_equal(part.routed_experts, whole.routed_experts[40:])
    assert engine.generate([OfflineRequest(prompt, max_tokens=6)])[0].routed_experts is None


def test_a_model_without_experts_is_refused(tiny_checkpoint) -> None:
    config = RunnerConfig(
        model=str(tiny_checkpoint("llama")),
        kv_cache_tokens=512,
        device="cpu",
        return_routed_experts=True,
    )
    with pytest.raises(ValueError, match="llama has no mixture of experts"):
        ModelRunner(config)


# --- through the server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_server(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("routed") / "server.log"
    server = start_server(
        tiny_checkpoint("qwen3_moe"), log, "--enable-return-routed-experts",
        "--enable-rl-control", "--api-key", KEY, "--kv-cache-tokens", "8192",
        "--max-model-len", "1024",
    )  # fmt: skip
    server.api_key = KEY
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def _decode(encoded: str, num_layers: int = 2, k: int = 2) -> np.ndarray:
    """As RL clients decode SGLang's: base64 -> int32 -> [positions, layers, k]."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    return flat.reshape(-1, num_layers, k)


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)


def test_generate_returns_them_as_sglang_does(moe_server, tiny_checkpoint) -> None:
    prompt = _prompt(6, 50)
    body = {
        "input_ids": prompt,
        "return_routed_experts": True,
        "routed_experts_start_len": 10,
        "sampling_params": {"max_new_tokens": 9, "temperature": 0},
    }
    status, answer = moe_server.post("/generate", body)
    assert status == 200, answer
    meta = answer["meta_info"]
    assert meta["routed_experts_start_len"] == 10
    routed = _decode(meta["routed_experts"])
    assert routed.shape == (len(prompt) + 9 - 1 - 10, 2, 2)
    engine = make_engine(tiny_checkpoint("qwen3_moe"), routed_experts=True)
    ref = engine.generate([OfflineRequest(prompt, max_tokens=9, routed_experts_start=10)])[0]
    assert answer["output_ids"] == ref.output_ids
    np.testing.assert_array_equal(routed, ref.routed_experts)
    _, plain = moe_server.post("/generate", {**body, "return_routed_experts": False})
    assert "routed_experts" not in plain["meta_info"]


def test_the_openai_responses_carry_them_in_sglext(moe_server) -> None:
    """SGLang's shape: `sglext.routed_experts` on the response (a list, one per choice, for
    n > 1); streamed, on each choice's last chunk."""
    client = _client(moe_server)
    extra = {"return_routed_experts": True, "return_token_ids": True}
    prompt = _prompt(7, 30)
    out = client.completions.create(
        model=moe_server.model, prompt=prompt, max_tokens=8, temperature=0, extra_body=extra
    ).model_dump()
    routed = _decode(out["sglext"]["routed_experts"])
    assert routed.shape[0] == len(prompt) + len(out["choices"][0]["token_ids"]) - 1
    two = client.completions.create(
        model=moe_server.model, prompt=prompt, max_tokens=8, n=2, temperature=1, seed=3,
        extra_body=extra,
    ).model_dump()  # fmt: skip
    assert [_decode(r).shape[0] for r in two["sglext"]["routed_experts"]] == [
        len(prompt) + len(c["token_ids"]) - 1 for c in two["choices"]
    ]
    chat = {"model": moe_server.model, "messages": [{"role": "user", "content": "hi"}]}
    stream = client.chat.completions.create(
        **chat, max_tokens=6, temperature=0, stream=True, extra_body=extra
    )
    chunks = [c.model_dump() for c in stream]
    with_ext = [i for i, c in enumerate(chunks) if c.get("sglext")]
    assert with_ext == [len(chunks) - 1]
    whole = client.chat.completions.create(**chat, max_tokens=6, temperature=0, extra_body=extra)
    assert chunks[-1]["sglext"] == whole.model_dump()["sglext"]


def test_a_stop_string_cuts_them_with_the_text(moe_server) -> None:
    """The detokenizer ends a request on a stop string while the controller still runs it:
    the answer waits for the controller's experts, cut to the tokens it keeps."""
    client = _client(moe_server)
    prompt = _prompt(8, 30)
    extra = {"return_routed_experts": True, "return_token_ids": True}
    kwargs = {"model": moe_server.model, "prompt": prompt, "temperature": 0, "extra_body": extra}
    full = client.completions.create(max_tokens=24, **kwargs).model_dump()
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert len(stop) == 2 and text.index(stop) > 0, text
    cut = client.completions.create(max_tokens=24, stop=[stop], **kwargs).model_dump()
    kept = cut["usage"]["completion_tokens"]
    assert cut["choices"][0]["finish_reason"] == "stop" and 0 < kept < 24
    routed = _decode(cut["sglext"]["routed_experts"])
    assert routed.shape[0] == len(prompt) + kept - 1
    np.testing.assert_array_equal(routed, _decode(full["sglext"]["routed_experts"])[: len(routed)])


def _rollout_equals_echo(server: ServerProcess, prompt: list[int]) -> np.ndarray:
    client = _client(server)
    extra = {"return_routed_experts": True, "return_token_ids": True}
    kwargs = {"model": server.model, "extra_body": extra}
    out = client.completions.create(
        prompt=prompt, max_tokens=16, temperature=1.0, seed=11, **kwargs
    ).model_dump()
    completion = out["choices"][0]["token_ids"]
    echo = client.completions.create(
        prompt=prompt + completion, max_tokens=0, echo=True, **kwargs
    ).model_dump()
    rollout = _decode(out["sglext"]["routed_experts"])
    np.testing.assert_array_equal(_decode(echo["sglext"]["routed_experts"]), rollout)
    return rollout


def test_a_rollouts_experts_equal_its_echo_rescoring(
    moe_server, checkpoint_root: Path, tiny_checkpoint
) -> None:
    """What routing replay needs: a sampled completion's experts equal those of the same
    completion scored again, bit for bit; and again after new weights, which route
    otherwise."""
    prompt = _prompt(9, 40)
    before = _rollout_equals_echo(moe_server, prompt)
    new = build_checkpoint(checkpoint_root / "tiny-qwen3_moe-seed1", "qwen3_moe", "tiny", seed=1)
    try:
        status, answer = moe_server.post("/update_weights_from_disk", {"model_path": str(new)})
        assert status == 200, answer
        after = _rollout_equals_echo(moe_server, prompt)
        assert not np.array_equal(after[: len(prompt) - 1], before[: len(prompt) - 1])
    finally:
        old = str(tiny_checkpoint("qwen3_moe"))
        status, answer = moe_server.post("/update_weights_from_disk", {"model_path": old})
        assert status == 200, answer


def test_the_errors(moe_server, server) -> None:
    """A start past the prompt names its param; a server without the flag says how to get
    them; neither leaks (the next request is served)."""
    body = {"input_ids": [5, 6, 7], "return_routed_experts": True, "routed_experts_start_len": 4}
    status, answer = moe_server.post("/generate", body)
    assert status == 400 and answer["error"]["param"] == "routed_experts_start_len", answer
    status, answer = server.post("/generate", {**body, "routed_experts_start_len": 0})
    assert status == 400, answer
    assert "--enable-return-routed-experts" in answer["error"]["message"]
    status, answer = server.post(
        "/v1/completions",
        {"model": server.model, "prompt": "hi", "max_tokens": 2, "return_routed_experts": True},
    )
    assert status == 400 and answer["error"]["param"] == "return_routed_experts", answer
    status, answer = moe_server.post("/generate", {**body, "routed_experts_start_len": 3})
    assert status == 200 and json.dumps(answer)


def test_at_tensor_parallel_2(tiny_checkpoint, tmp_path) -> None:
    """Two ranks, each expert's width halved: the same experts as one rank (the router reads
    the whole hidden state on every rank; rank 0's result carries them)."""
    model = tiny_checkpoint("qwen3_moe")
    prompt = _prompt(10, 50)
    body = {
        "input_ids": prompt,
        "return_routed_experts": True,
        "sampling_params": {"max_new_tokens": 10, "temperature": 0},
    }
    flags = ("--tensor-parallel-size", "2", "--max-model-len", "1024")
    answer = generate_once(model, tmp_path / "log", body, *flags, "--enable-return-routed-experts")
    engine = make_engine(model, routed_experts=True)
    ref = engine.generate([OfflineRequest(prompt, max_tokens=10, routed_experts_start=0)])[0]
    assert answer["output_ids"] == ref.output_ids
    np.testing.assert_array_equal(
        _decode(answer["meta_info"]["routed_experts"]), ref.routed_experts
    )
