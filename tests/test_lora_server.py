"""Multi-LoRA through the real server (--enable-lora): vLLM's flags and routes, an adapter
as `model` with the openai client, SGLang's `lora_path`, /v1/models and /metrics, and the
errors, with the numbers of the in-process engine."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest
from helpers import make_engine
from lora_adapters import ALL_TARGETS, make_adapter, teacher_forced
from server_process import ServerProcess, start_server

from tokenmill.offline.engine import OfflineRequest

PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def lora_server(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("lora-server")
    make_adapter(base, root / "a", ALL_TARGETS, 8, 16)
    make_adapter(base, root / "b", ("q_proj", "v_proj"), 4, 8, seed=2)
    server = start_server(
        base,
        root / "server.log",
        "--enable-lora",
        "--lora-modules",
        f"a={root / 'a'}",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
    )
    yield server, root
    assert server.stop() == 0, server.log()[-3000:]


def _post_text(server: ServerProcess, path: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(
        server.base_url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_an_adapter_as_model_through_the_openai_client(lora_server, tiny_checkpoint) -> None:
    server, root = lora_server
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    answer = client.completions.create(
        model="a", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, echo=True
    )
    assert answer.model == "a"
    engine = make_engine(tiny_checkpoint("llama"), loras={"a": root / "a"})
    [ours] = engine.generate([OfflineRequest(PROMPT, 6, prompt_logprob_start=1, lora_name="a")])
    served = answer.choices[0].logprobs.token_logprobs[1:]  # type: ignore[union-attr]
    assert served == (ours.prompt_logprobs + ours.logprobs)
    base = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, logprobs=1)
    assert base.choices[0].logprobs.token_logprobs != served[-6:]  # type: ignore[union-attr]
    models = {m.id: m for m in client.models.list().data}
    assert models["a"].parent == server.model and models["a"].root == str(root / "a")  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError, match="`a`"):
        client.completions.create(model="nope", prompt="x", max_tokens=1)


def test_load_use_and_unload_at_run_time(lora_server) -> None:
    server, root = lora_server
    status, text = _post_text(
        server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(root / "b")}
    )
    assert status == 200 and "added successfully" in text
    status, answer = server.post(
        "/generate",
        {"input_ids": [PROMPT, PROMPT], "lora_path": ["b", None],
         "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True},
    )  # fmt: skip
    assert status == 200, answer
    adapted, base = (np.array(a["meta_info"]["output_token_logprobs"])[:, 0] for a in answer)
    assert not np.array_equal(adapted, base)
    _, metrics = server.get("/metrics")
    assert 'vllm:lora_requests_info{max_lora="2"' in metrics
    load_c = {"lora_name": "c", "lora_path": "/x"}
    status, text = _post_text(server, "/v1/load_lora_adapter", load_c)
    assert status == 400 and "--max-loras 2 adapters are loaded (a, b)" in text
    status, text = _post_text(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert status == 200 and "removed successfully" in text
    status, text = _post_text(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert status == 404
    status, text = _post_text(server, "/v1/load_lora_adapter", load_c)
    assert status == 400 and "no such directory" in json.loads(text)["error"]["message"]
    status, answer = server.post("/v1/completions", {"model": "b", "prompt": "hi", "max_tokens": 1})
    assert status == 404 and answer["error"]["code"] == "model_not_found"


def test_a_rank_over_the_limit_is_a_400_and_the_server_goes_on(
    lora_server, tiny_checkpoint
) -> None:
    server, root = lora_server
    make_adapter(tiny_checkpoint("llama"), root / "big", ("q_proj",), 16, 16)
    status, text = _post_text(
        server, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(root / "big")}
    )
    assert status == 400 and "--max-lora-rank 8" in text
    status, _ = server.post("/v1/completions", {"model": "a", "prompt": "hi", "max_tokens": 2})
    assert status == 200


def test_tensor_parallel_adapters_score_as_peft_merged(tiny_checkpoint, tmp_path: Path) -> None:
    """TP=2: q/k/v and gate/up deltas on each rank's columns, o and down's shrinks summed
    over the ranks before their expand, the lm_head's on each rank's vocabulary."""
    base = tiny_checkpoint("llama")
    every = (*ALL_TARGETS, "embed_tokens", "lm_head")
    merged = make_adapter(base, tmp_path / "a", every, 8, 16, seed=4)
    server = start_server(
        base, tmp_path / "log", "--tensor-parallel-size", "2", "--enable-lora",
        "--lora-modules", f"a={tmp_path / 'a'}", "--max-model-len", "1024",
    )  # fmt: skip
    try:
        body = {
            "input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
            "lora_path": "a", "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        }  # fmt: skip
        status, answer = server.post("/generate", body)
        assert status == 200, answer
    finally:
        assert server.stop() == 0
    meta = answer["meta_info"]
    ours = [e[0] for e in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]
    greedy, reference = teacher_forced(merged, PROMPT, answer["output_ids"])
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    assert answer["output_ids"] == greedy


def test_responses_carry_the_adapters_weight_version(lora_server) -> None:
    """An adapter's requests carry its version: "1" from the start, a load_inplace's own."""
    server, root = lora_server
    body = {"model": "a", "prompt": "hi", "max_tokens": 1}
    assert server.post("/v1/completions", body)[1]["weight_version"] == "1"
    replace = {"lora_name": "a", "lora_path": str(root / "a"), "load_inplace": True,
               "weight_version": "policy-2"}  # fmt: skip
    assert _post_text(server, "/v1/load_lora_adapter", replace)[0] == 200
    assert server.post("/v1/completions", body)[1]["weight_version"] == "policy-2"
    base = {**body, "model": server.model}
    assert server.post("/v1/completions", base)[1]["weight_version"] == "default"


def test_an_adapter_from_a_trainer(tiny_checkpoint, tmp_path: Path) -> None:
    """The RL control plane's /update_weights_from_distributed with lora_name: the test
    process as the trainer broadcasts a whole adapter's PEFT tensors; the adapter's requests
    then get the in-process engine's bits for those weights and the trainer's version; a
    refused set (a missing half) changes nothing."""
    import socket

    from safetensors.torch import load_file

    from tokenmill.cli.weight_sync import WeightSync, WeightSyncError

    base = tiny_checkpoint("llama")
    make_adapter(base, tmp_path / "a", ALL_TARGETS, 8, 16)
    make_adapter(base, tmp_path / "b", ALL_TARGETS, 8, 16, seed=9)
    server = start_server(
        base, tmp_path / "log", "--enable-lora", "--enable-rl-control",
        "--lora-modules", f"a={tmp_path / 'a'}",
    )  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    body = {
        "model": "a",
        "prompt": PROMPT,
        "max_tokens": 4,
        "logprobs": 1,
        "echo": True,
        "temperature": 0,
    }
    try:
        sync = WeightSync.connect(server.base_url, master_port=port, num_ranks=1)
        try:
            tensors = load_file(tmp_path / "b" / "adapter_model.safetensors")
            answer = sync.update(tensors, weight_version="policy-3", lora_name="a")
            assert answer.get("success"), answer
            status, served = server.post("/v1/completions", body)
            half = {k: v for k, v in tensors.items() if "lora_B" not in k}
            with pytest.raises(WeightSyncError, match="lora_B is missing"):
                sync.update(half, lora_name="a")
            _, again = server.post("/v1/completions", body)
        finally:
            sync.close()
    finally:
        assert server.stop() == 0
    assert status == 200 and served["weight_version"] == "policy-3"
    engine = make_engine(base, loras={"a": tmp_path / "b"})
    [ours] = engine.generate([OfflineRequest(PROMPT, 4, prompt_logprob_start=1, lora_name="a")])
    got = served["choices"][0]["logprobs"]["token_logprobs"][1:]
    assert got == ours.prompt_logprobs + ours.logprobs
    assert again["choices"][0]["logprobs"]["token_logprobs"][1:] == got
