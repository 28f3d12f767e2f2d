"""The RL rollout engine through the real server (--enable-rl-control): pause and resume,
new weights from disk and from a trainer's broadcast (all or nothing, no stale prefix
reused), memory released and taken back, token ids and weight versions in responses, a
per-request logprob mode, and a completion's sampled logprobs equal to the same completion
scored again by echo, bit for bit.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from helpers import make_engine, oracle
from safetensors.torch import load_file, save_file
from server_process import ServerProcess, start_server

from tokenmill.cli.make_model import build_checkpoint
from tokenmill.cli.weight_sync import WeightSync
from tokenmill.offline.engine import OfflineRequest

KEY = "rl-test-key"
PROMPT = list(range(40, 70))


@pytest.fixture(scope="module")
def new_weights(checkpoint_root: Path) -> Path:
    """The tiny llama's architecture and tokenizer, other weights (another seed)."""
    return build_checkpoint(checkpoint_root / "tiny-llama-seed1", "llama", "tiny", seed=1)


def _start(model: Path, log: Path, *args: str) -> ServerProcess:
    server = start_server(
        model, log, "--enable-rl-control", "--api-key", KEY, "--kv-cache-tokens", "200000",
        "--max-model-len", "1024", *args,
    )  # fmt: skip
    server.api_key = KEY
    return server


@pytest.fixture(scope="module")
def rl_server(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):
    server = _start(tiny_checkpoint("llama"), tmp_path_factory.mktemp("rl") / "server.log")
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def _ok(server: ServerProcess, path: str, body: object = None) -> dict:
    status, answer = server.post(path, body if body is not None else {})
    assert status == 200, answer
    return answer


def _generate(server: ServerProcess, prompt: list[int], **sampling: object) -> dict:
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 16, "temperature": 0, **sampling},
    }
    return _ok(server, "/generate", body)


def _same(a: dict, b: dict) -> bool:
    keys = ("output_token_logprobs", "output_top_logprobs")
    return a["output_ids"] == b["output_ids"] and all(
        json.dumps(a["meta_info"][k]) == json.dumps(b["meta_info"][k]) for k in keys
    )


def _reference(model: Path, prompt: list[int], **kwargs: object):
    request = OfflineRequest(prompt, max_tokens=16, num_top=2, **kwargs)  # type: ignore[arg-type]
    return make_engine(model).generate([request])[0]


def _matches_engine(answer: dict, ref) -> bool:  # noqa: ANN001 (an OfflineOutput)
    logprobs = [e[0] for e in answer["meta_info"]["output_token_logprobs"]]
    return answer["output_ids"] == ref.output_ids and logprobs == ref.logprobs


# --- who may use the routes --------------------------------------------------------------


def test_the_control_routes_are_off_without_the_flag(server) -> None:
    assert server.post("/pause_generation", {"mode": "abort"})[0] == 404
    assert server.get("/get_weight_version")[0] == 404
    assert "/update_weights_from_disk" not in server.get("/openapi.json")[1]


def test_the_control_routes_need_the_key(rl_server) -> None:
    anonymous = ServerProcess(rl_server.proc, rl_server.port, rl_server.log_path, "")
    status, answer = anonymous.post("/pause_generation", {"mode": "abort"})
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    assert anonymous.get("/get_weight_version")[0] == 401
    paths = json.loads(rl_server.get("/openapi.json")[1])["paths"]
    assert {"/update_weights_from_disk", "/pause_generation", "/release_memory_occupation"} <= set(
        paths
    )
    assert json.loads(rl_server.get("/get_weight_version")[1])["weight_version"] == "default"


# --- pause and resume --------------------------------------------------------------------


def _in_flight(server: ServerProcess, bodies: list[dict]) -> tuple[list, list[threading.Thread]]:
    """The bodies streamed at once, each in a thread; returns once each has sent its first
    event (so each runs and holds its KV). A result is the stream's last JSON event: the
    whole answer (chunks are cumulative) or an error object."""
    # NOTE: the running gauge is a periodic report (every 0.25-0.35 s), and a tiny model's
    # 900 tokens can end within a few of them: a first event is the proof that a request runs.
    results: list = [None] * len(bodies)
    started = [threading.Event() for _ in bodies]

    def send(i: int) -> None:
        body = json.dumps({**bodies[i], "stream": True}).encode()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        request = urllib.request.Request(server.base_url + "/generate", body, headers)
        with urllib.request.urlopen(request, timeout=120) as stream:
            for line in stream:
                started[i].set()
                if line.startswith(b"data: {"):
                    results[i] = json.loads(line[len(b"data: ") :])

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for event in started:
        assert event.wait(timeout=30), "a request never started"
    return results, threads


def _long_bodies() -> list[dict]:
    return [
        {
            "input_ids": [7 + i] * 12,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 900, "temperature": t, "seed": i,
                                "ignore_eos": True},
        }
        for i, t in enumerate((0.0, 0.9, 0.6))
    ]  # fmt: skip


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_pause_loses_nothing(rl_server, mode: str) -> None:
    """Requests paused mid-output and continued give what an unpaused run gives, bit for
    bit (retract: recomputed from their tokens; in_place: their KV kept)."""
    bodies = _long_bodies()
    unpaused = [rl_server.post("/generate", b, timeout=120)[1] for b in bodies]
    _ok(rl_server, "/flush_cache")
    results, threads = _in_flight(rl_server, bodies)
    try:
        paused = _ok(rl_server, "/pause_generation", {"mode": mode})
        assert paused["paused"] == mode
        # NOTE: a request may have finished since it was seen running
        assert (paused["num_retracted"] > 0) == (mode == "retract"), paused
        time.sleep(0.4)  # NOTE: the engine reports every 0.25-0.35 s
        steps = rl_server.metrics()["tokenmill_num_steps"]
        time.sleep(0.6)
        assert rl_server.metrics()["tokenmill_num_steps"] == steps, "a step ran while paused"
    finally:
        _ok(rl_server, "/continue_generation")
    for t in threads:
        t.join(timeout=120)
    for answer, reference in zip(results, unpaused, strict=True):
        assert _same(answer, reference), answer


def test_a_pause_with_abort_fails_requests_in_flight(rl_server) -> None:
    results, threads = _in_flight(rl_server, _long_bodies())
    waiting: list = []
    late = threading.Thread(
        target=lambda: waiting.append(_generate(rl_server, PROMPT)), daemon=True
    )
    try:
        _ok(rl_server, "/pause_generation", {"mode": "abort"})
        for t in threads:
            t.join(timeout=60)
        for answer in results:
            assert answer["error"]["code"] == "generation_paused", answer
            assert "/pause_generation" in answer["error"]["message"]
        late.start()
        time.sleep(0.3)
        assert not waiting, "a request ran while generation was paused"
    finally:
        _ok(rl_server, "/continue_generation")
    late.join(timeout=60)
    assert waiting and waiting[0]["output_ids"]


def test_the_prefix_cache_is_not_flushed_under_running_requests(rl_server) -> None:
    results, threads = _in_flight(rl_server, _long_bodies()[:1])
    try:
        _ok(rl_server, "/pause_generation", {"mode": "in_place"})
        status, answer = rl_server.post("/flush_cache", {})
        assert status == 409 and "hold prefix-cache entries" in answer["error"]["message"]
    finally:
        _ok(rl_server, "/continue_generation")
    threads[0].join(timeout=120)
    assert results[0]["meta_info"]["finish_reason"]["type"] == "length", results[0]


# --- new weights -------------------------------------------------------------------------


def test_weights_from_disk_and_back(rl_server, tiny_checkpoint, new_weights) -> None:
    """A prompt cached with the old weights, rescored after the update: the new weights'
    numbers (the in-process engine's bits, and transformers' within 1e-4), never the cache's;
    then the old weights again, and their numbers again."""
    old = tiny_checkpoint("llama")
    before = _generate(rl_server, PROMPT)
    assert _matches_engine(before, _reference(old, PROMPT))
    answer = _ok(rl_server, "/update_weights_from_disk",
                 {"model_path": str(new_weights), "weight_version": "step-1"})  # fmt: skip
    assert answer["weight_version"] == "step-1"
    after = _generate(rl_server, PROMPT)
    assert after["meta_info"]["weight_version"] == "step-1"
    assert _matches_engine(after, _reference(new_weights, PROMPT))
    _check_rescored_prompt(rl_server, new_weights)
    _ok(rl_server, "/update_weights_from_disk",
        {"model_path": str(old), "weight_version": "default"})  # fmt: skip
    assert _same(_generate(rl_server, PROMPT), before)


def _check_rescored_prompt(server: ServerProcess, weights: Path) -> None:
    from transformers import AutoModelForCausalLM

    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "logprob_start_len": 1,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    }
    scored = [e[0] for e in _ok(server, "/generate", body)["meta_info"]["input_token_logprobs"]]
    hf = AutoModelForCausalLM.from_pretrained(weights, torch_dtype=torch.float32)
    ref = oracle(hf, PROMPT)
    expected = ref.of(np.arange(len(PROMPT) - 1), PROMPT[1:])
    np.testing.assert_allclose(scored, expected, atol=1e-4, rtol=0)


def _broken(new_weights: Path, into: Path, how: str) -> Path:
    shutil.copytree(new_weights, into)
    (weights,) = into.glob("*.safetensors")
    tensors = load_file(weights)
    if how == "missing":
        del tensors["model.norm.weight"]
    elif how == "shape":
        tensors["model.layers.1.mlp.down_proj.weight"] = tensors[
            "model.layers.1.mlp.down_proj.weight"
        ][:, :-1].contiguous()
    else:
        tensors["model.layers.0.self_attn.q_proj.weight"] = tensors[
            "model.layers.0.self_attn.q_proj.weight"
        ].half()
    save_file(tensors, weights, metadata={"format": "pt"})
    return into


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("missing", "lacks tensor 'model.norm.weight'"),
        ("shape", "'model.layers.1.mlp.down_proj.weight' has shape"),
        ("dtype", "'model.layers.0.self_attn.q_proj.weight' is float16"),
    ],
)
def test_weights_that_do_not_fit_change_nothing(
    rl_server, new_weights, tmp_path, how: str, message: str
) -> None:
    before = _generate(rl_server, PROMPT)
    body = {"model_path": str(_broken(new_weights, tmp_path / how, how)), "weight_version": "x"}
    status, answer = rl_server.post("/update_weights_from_disk", body)
    assert status == 400 and message in answer["error"]["message"], answer
    assert json.loads(rl_server.get("/get_weight_version")[1])["weight_version"] == "default"
    assert _same(_generate(rl_server, PROMPT), before)


def _trainer_tensors(weights: Path) -> dict[str, torch.Tensor]:
    (path,) = weights.glob("*.safetensors")
    return load_file(path)


def test_weights_from_a_trainer(rl_server, tiny_checkpoint, new_weights) -> None:
    """The test process as the trainer: rank 0 of a gloo group with the server's rank."""
    sync = WeightSync.connect(rl_server.base_url, master_port=_free_port(), num_ranks=1,
                              api_key=KEY)  # fmt: skip
    try:
        sync.update(_trainer_tensors(new_weights), weight_version="trainer-1")
        after = _generate(rl_server, PROMPT)
        assert after["meta_info"]["weight_version"] == "trainer-1"
        assert _matches_engine(after, _reference(new_weights, PROMPT))
        sync.update(_trainer_tensors(tiny_checkpoint("llama")), weight_version="default")
        assert _matches_engine(_generate(rl_server, PROMPT), _reference(tiny_checkpoint("llama"),
                                                                        PROMPT))  # fmt: skip
    finally:
        sync.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- memory -------------------------------------------------------------------------------


def _worker_rss(server: ServerProcess) -> int:
    from test_server_faults import children_of

    (pid,) = [p for p, cmd in children_of(server.proc.pid).items() if "tp_worker" in cmd]
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_memory_released_and_taken_back(rl_server) -> None:
    """The KV cache (200,000 slots: 102 MB here) and the weights go back to the system and
    come back; a request sent meanwhile waits, then gets what it got before."""
    before = _generate(rl_server, PROMPT)
    rss = _worker_rss(rl_server)
    _ok(rl_server, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
    waiting: list = []
    late = threading.Thread(target=lambda: waiting.append(_generate(rl_server, PROMPT)))
    try:
        released = _worker_rss(rl_server)
        assert rss - released > 80 << 20, (rss, released)
        late.start()
        time.sleep(0.3)
        assert not waiting
    finally:
        _ok(rl_server, "/resume_memory_occupation", {})
    late.join(timeout=60)
    assert _same(waiting[0], before)


# --- what responses carry ----------------------------------------------------------------


def test_token_ids_and_versions_in_responses(rl_server) -> None:
    client = openai.OpenAI(base_url=rl_server.base_url + "/v1", api_key=KEY, max_retries=0)
    extra = {"return_token_ids": True}
    chat = client.chat.completions.create(
        model=rl_server.model, messages=[{"role": "user", "content": "hello there"}],
        max_tokens=8, temperature=0, extra_body=extra,
    ).model_dump()  # fmt: skip
    assert chat["weight_version"] == "default"
    assert chat["prompt_token_ids"] and len(chat["choices"][0]["token_ids"]) == 8
    completion = client.completions.create(
        model=rl_server.model, prompt=PROMPT, max_tokens=8, temperature=0, n=2,
        extra_body=extra,
    ).model_dump()  # fmt: skip
    assert completion["weight_version"] == "default"
    reference = _generate(rl_server, PROMPT)["output_ids"][:8]
    for choice in completion["choices"]:
        assert choice["prompt_token_ids"] == PROMPT and choice["token_ids"] == reference
    streamed: list[int] = []
    prompt_ids = None
    for chunk in client.completions.create(
        model=rl_server.model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
        extra_body=extra,
    ):  # fmt: skip
        data = chunk.model_dump()
        assert data["weight_version"] == "default"
        choice = data["choices"][0]
        streamed += choice["token_ids"]
        prompt_ids = prompt_ids or choice.get("prompt_token_ids")
    assert streamed == reference and prompt_ids == PROMPT


def test_the_logprob_mode_per_request(rl_server, tiny_checkpoint) -> None:
    """processed and raw side by side on the same server (the default is raw): each the
    in-process engine's bits in its own mode."""
    model = tiny_checkpoint("llama")
    sampled = {"temperature": 0.8, "top_k": 20, "seed": 5}
    raw = _generate(rl_server, PROMPT, **sampled)
    body = {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
            "logprobs_mode": "processed",
            "sampling_params": {"max_new_tokens": 16, **sampled}}  # fmt: skip
    processed = _ok(rl_server, "/generate", body)
    kwargs = {"temperature": 0.8, "top_k": 20, "seed": 5}
    assert _matches_engine(raw, _reference(model, PROMPT, **kwargs))
    assert _matches_engine(processed, _reference(model, PROMPT, processed=True, **kwargs))
    assert raw["output_ids"] == processed["output_ids"]
    status, answer = rl_server.post("/generate", {**body, "logprobs_mode": "cooked"})
    assert status == 400 and answer["error"]["param"] == "logprobs_mode"


def test_n_choices_are_distinct_and_derived_from_a_seed(rl_server) -> None:
    client = openai.OpenAI(base_url=rl_server.base_url + "/v1", api_key=KEY, max_retries=0)

    def texts(**kwargs: object) -> list[str]:
        out = client.completions.create(
            model=rl_server.model, prompt=PROMPT, max_tokens=12, temperature=1.0, **kwargs
        )  # type: ignore[call-overload]
        return [c.text for c in out.choices]  # fmt: skip

    unseeded = texts(n=4)
    assert len(set(unseeded)) == 4
    seeded = texts(n=3, seed=100)
    assert seeded == [texts(n=1, seed=100 + j)[0] for j in range(3)]


# --- the echo property -------------------------------------------------------------------


def _sampled_equals_echo(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24,
                                    temperature=0, logprobs=1,
                                    extra_body={"return_token_ids": True})  # fmt: skip
    choice = out.choices[0]
    ids = choice.model_dump()["token_ids"]
    echoed = client.completions.create(model=server.model, prompt=PROMPT + ids, max_tokens=0,
                                       echo=True, logprobs=1)  # fmt: skip
    scored = echoed.choices[0].logprobs.token_logprobs[len(PROMPT) :]
    assert scored == choice.logprobs.token_logprobs  # NOTE: equal floats: the same bits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_completions_logprobs_equal_its_echo_scores(
    tiny_checkpoint, new_weights, tmp_path, dtype: str
) -> None:
    """What an RL trainer reads back: the logprobs a completion was sampled with equal the
    same completion scored again (echo), bit for bit; and again after new weights."""
    server = _start(tiny_checkpoint("llama"), tmp_path / "log", "--dtype", dtype)
    try:
        _sampled_equals_echo(server)
        _ok(server, "/update_weights_from_disk", {"model_path": str(new_weights)})
        _sampled_equals_echo(server)
    finally:
        assert server.stop() == 0


# --- tensor parallel ---------------------------------------------------------------------


def test_new_weights_at_tp_2(tiny_checkpoint, new_weights, tmp_path) -> None:
    """Two ranks, each loading its shard of the new weights, from disk and from a trainer
    (both ranks in its group): TP=1's tokens on them, logprobs within TP's tolerance."""
    server = _start(tiny_checkpoint("llama"), tmp_path / "log", "--tensor-parallel-size", "2")
    try:
        one = _reference(new_weights, PROMPT)
        _ok(server, "/update_weights_from_disk", {"model_path": str(new_weights)})
        two = _generate(server, PROMPT)
        assert two["output_ids"] == one.output_ids
        got = [e[0] for e in two["meta_info"]["output_token_logprobs"]]
        np.testing.assert_allclose(got, one.logprobs, atol=1e-5, rtol=1e-6)
        sync = WeightSync.connect(server.base_url, master_port=_free_port(), num_ranks=2,
                                  api_key=KEY)  # fmt: skip
        try:
            sync.update(_trainer_tensors(tiny_checkpoint("llama")), weight_version="back")
            old = _reference(tiny_checkpoint("llama"), PROMPT)
            again = _generate(server, PROMPT)
            assert again["meta_info"]["weight_version"] == "back"
            assert again["output_ids"] == old.output_ids
        finally:
            sync.close()
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_new_weights_for_a_mixture_of_experts(
    tiny_checkpoint, checkpoint_root: Path, dtype: str, arch: str
) -> None:
    """Qwen2-MoE's router, experts and shared expert, or gpt-oss's stacked experts, their
    biases and its sinks (packed for the CPU kernels, their unpacked copies freed) take a
    checkpoint's new weights in place: afterwards the bits of an engine started on that
    checkpoint."""
    from tokenmill.tp_worker.weight_update import WeightUpdater

    old = tiny_checkpoint(arch)
    new = build_checkpoint(checkpoint_root / f"tiny-{arch}-seed1", arch, "tiny", seed=1)
    request = OfflineRequest(list(range(20, 60)), max_tokens=8, num_top=3, prompt_logprob_start=0)
    engine = make_engine(old, prefix_cache=False, dtype=dtype)
    before = engine.generate([request])[0]
    WeightUpdater(engine.runner).from_disk(new)
    after = engine.generate([request])[0]
    fresh = make_engine(new, prefix_cache=False, dtype=dtype).generate([request])[0]
    assert after.prompt_logprobs != before.prompt_logprobs
    assert after.output_ids == fresh.output_ids
    np.testing.assert_array_equal(after.prompt_logprobs, fresh.prompt_logprobs)
    np.testing.assert_array_equal(after.logprobs, fresh.logprobs)
