"""Multi-LoRA (--enable-lora): PEFT adapters against transformers + peft with the adapter
merged, the same bits for a request alone or in any mix of adapters, chunks and drafts, the
base's rows untouched, adapters loaded, replaced and unloaded, and what is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_same_bits, make_engine
from lora_adapters import ALL_TARGETS, make_adapter, rewrite_config, teacher_forced

from tokenmill.offline.engine import OfflineEngine, OfflineOutput, OfflineRequest
from tokenmill.protocol.control import LoadLoraAdapter, UnloadLoraAdapter
from tokenmill.protocol.outputs import NO_ADAPTER

PROMPT = list(range(5, 45))
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3}'


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """name -> (directory, merged oracle) on the tiny llama: every projection (rank 8) plus
    the embeddings and the lm_head; three projections with rslora (rank 4)."""
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("adapters")
    every = (*ALL_TARGETS, "embed_tokens", "lm_head")
    return {
        "every": (root / "every", make_adapter(base, root / "every", every, 8, 16)),
        "rslora": (
            root / "rslora",
            make_adapter(
                base,
                root / "rslora",
                ("q_proj", "v_proj", "down_proj"),
                4,
                8,
                seed=1,
                use_rslora=True,
            ),
        ),  # fmt: skip
    }


def _ours(out: OfflineOutput) -> np.ndarray:
    return np.array(out.prompt_logprobs + out.logprobs)


def _check_oracle(out: OfflineOutput, merged: torch.nn.Module) -> None:
    """Every prompt and generated logprob within 1e-4 of the merged model's (float32), and
    each greedy token its argmax."""
    greedy, reference = teacher_forced(merged, PROMPT, out.output_ids)
    np.testing.assert_allclose(_ours(out), reference, atol=1e-4, rtol=0)
    assert out.output_ids == greedy


def _request(lora: str = "", **asks: object) -> OfflineRequest:
    settings: dict = {"max_tokens": 8, "prompt_logprob_start": 1, **asks}
    return OfflineRequest(PROMPT, lora_name=lora, **settings)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["csrc", "torch"])
def test_each_adapter_scores_as_peft_merged(adapters, tiny_checkpoint, cpu_kernels) -> None:
    engine = make_engine(
        tiny_checkpoint("llama"),
        cpu_kernels=cpu_kernels,
        loras={name: path for name, (path, _) in adapters.items()},
    )
    outs = engine.generate([_request("every"), _request("rslora")])
    for out, name in zip(outs, ("every", "rslora"), strict=True):
        _check_oracle(out, adapters[name][1])


@pytest.mark.parametrize("arch", ["phi3", "qwen3"])
def test_other_families_fused_and_normed(arch, tiny_checkpoint, tmp_path: Path) -> None:
    """Phi-3's fused qkv_proj and gate_up_proj (one A over the parts), Qwen3's q/k norms
    after the adapted projection."""
    base = tiny_checkpoint(arch)
    targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if arch == "phi3" else ALL_TARGETS
    merged = make_adapter(base, tmp_path / "a", targets, 8, 32, seed=3)
    engine = make_engine(base, loras={"a": tmp_path / "a"})
    _check_oracle(engine.generate([_request("a")])[0], merged)


def test_rank_and_alpha_patterns(tiny_checkpoint, tmp_path: Path) -> None:
    """PEFT's rank_pattern and alpha_pattern: a module's own rank and lora_alpha."""
    base = tiny_checkpoint("llama")
    patterns = {"rank_pattern": {"q_proj": 4}, "alpha_pattern": {"v_proj": 32, "down_proj": 2}}
    merged = make_adapter(base, tmp_path / "a", ALL_TARGETS, 8, 16, seed=5, **patterns)
    engine = make_engine(base, loras={"a": tmp_path / "a"})
    _check_oracle(engine.generate([_request("a")])[0], merged)


def _mix(engine: OfflineEngine) -> list[OfflineOutput]:
    return engine.generate(_requests_of_mix())


@pytest.mark.parametrize(
    "settings",
    [
        {"max_prefill_tokens": 16},
        {"decode_steps": 4},
        {"speculative_config": NGRAM},
        {"prefix_cache": False, "cpu_kernels": False},
        {"layer_stack": False},
    ],
    ids=["chunked", "multi-step", "drafts", "torch", "python-layers"],
)
def test_a_mix_of_adapters_and_the_base_keeps_every_bit(
    adapters, tiny_checkpoint, settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bfloat16: each request of a batch mixing two adapters and the base gets the bits it
    gets alone (whole prompt, one step at a time), and a base row the bits of a server with
    LoRA off. python-layers: the mix through the Python layer loop, alone through
    csrc/layer_stack.cpp."""
    model = tiny_checkpoint("llama")
    loras = {name: path for name, (path, _) in adapters.items()}
    settings = dict(settings)
    cpu = settings.get("cpu_kernels", True)
    alone = make_engine(model, dtype="bfloat16", loras=loras, cpu_kernels=cpu)
    if cpu:
        assert alone.runner.model.layer_stack is not None  # NOTE: the native path is tested
    if not settings.pop("layer_stack", True):
        monkeypatch.setenv("TOKENMILL_CPU_LAYER_STACK", "0")
    mixed = _mix(make_engine(model, dtype="bfloat16", loras=loras, **settings))
    reference = [alone.generate([r])[0] for r in _requests_of_mix()]
    for a, b in zip(reference, mixed, strict=True):
        assert_same_bits(a, b)
    off = make_engine(model, dtype="bfloat16", cpu_kernels=cpu)
    base = off.generate([_request("")])[0]
    assert_same_bits(base, mixed[1])
    assert_same_bits(base, mixed[5])
    assert not np.array_equal(_ours(mixed[0]), _ours(mixed[1]))  # NOTE: the adapter acts


def test_the_torch_deltas_of_a_device_without_our_kernels(adapters, tiny_checkpoint) -> None:
    """float16 (no csrc/ kernel takes it: CUDA's path): torch multiplies each adapter's rows
    in blocks of a fixed shape; a mix gives each request its bits alone, a base row LoRA
    off's, and the numbers stay near the merged model's."""
    model = tiny_checkpoint("llama")
    loras = {name: path for name, (path, _) in adapters.items()}
    alone = make_engine(model, dtype="float16", loras=loras, prefix_cache=False)
    mixed = _mix(make_engine(model, dtype="float16", loras=loras, max_prefill_tokens=16))
    for a, b in zip([alone.generate([r])[0] for r in _requests_of_mix()], mixed, strict=True):
        assert_same_bits(a, b)
    assert_same_bits(make_engine(model, dtype="float16").generate([_request("")])[0], mixed[1])
    _, reference = teacher_forced(adapters["every"][1], PROMPT, mixed[0].output_ids)
    np.testing.assert_allclose(_ours(mixed[0]), reference, atol=0.1, rtol=0)


def _requests_of_mix() -> list[OfflineRequest]:
    return [
        _request("every", num_top=3),
        _request(""),
        _request("rslora", temperature=0.8, seed=7),
        _request("every", temperature=0.8, seed=7),
        OfflineRequest(PROMPT[:23], max_tokens=12, lora_name="rslora"),
        _request(""),
    ]


def test_load_replace_and_unload(adapters, tiny_checkpoint, tmp_path: Path) -> None:
    model = tiny_checkpoint("llama")
    (every, every_merged), (rslora, rslora_merged) = adapters["every"], adapters["rslora"]
    engine = make_engine(model, loras={}, max_loras=2)

    def control(command: type, *args: object) -> tuple[int, str]:
        reply = engine.control(lambda ctl_id: command(ctl_id, *args))
        return reply.status, reply.message

    assert control(LoadLoraAdapter, "a", str(every))[0] == 200
    _check_oracle(engine.generate([_request("a")])[0], every_merged)
    status, message = control(LoadLoraAdapter, "a", str(rslora))
    assert status == 400 and "already loaded" in message
    # NOTE: in place: the new weights, and nothing the old ones computed is read again
    hits = engine.controller.kv.hit_tokens
    assert control(LoadLoraAdapter, "a", str(rslora), True)[0] == 200
    _check_oracle(engine.generate([_request("a")])[0], rslora_merged)
    assert engine.controller.kv.hit_tokens == hits
    assert control(LoadLoraAdapter, "b", str(every))[0] == 200
    status, message = control(LoadLoraAdapter, "c", str(every))
    assert status == 400 and "--max-loras 2" in message
    # NOTE: the prefix cache is the adapter's own: b's prompt is cached, a's is not b's
    engine.generate([_request("b")])
    hits = engine.controller.kv.hit_tokens
    engine.generate([_request("a")])
    assert engine.controller.kv.hit_tokens - hits == 0
    assert control(UnloadLoraAdapter, "a")[0] == 200
    assert control(UnloadLoraAdapter, "a")[0] == 404
    assert engine.generate([_request("a")])[0].finish_reason == NO_ADAPTER
    assert control(LoadLoraAdapter, "c", str(every))[0] == 200  # NOTE: a's slot again
    _check_oracle(engine.generate([_request("c")])[0], every_merged)
    engine.controller.kv.check_integrity([])


def test_an_adapter_in_use_is_not_unloaded(adapters, tiny_checkpoint) -> None:
    path = adapters["every"][0]
    engine = make_engine(tiny_checkpoint("llama"), loras={"a": path})
    engine.sockets.inbox.append(_request("a", max_tokens=50).message("held"))
    engine.controller.run_once()  # NOTE: its prefill runs; it decodes on
    reply = engine.control(lambda ctl_id: UnloadLoraAdapter(ctl_id, "a"))
    assert reply.status == 409 and "1 requests use" in reply.message
    while engine.controller.has_work():
        engine.controller.run_once()
    assert engine.control(lambda ctl_id: UnloadLoraAdapter(ctl_id, "a")).status == 200
    engine.controller.kv.check_integrity([])


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias 'all'"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"lora_alpha": "x"}, "lora_alpha"),
    ],
)
def test_adapter_settings_it_cannot_serve_are_400s(
    adapters, tiny_checkpoint, tmp_path: Path, change: dict, error: str
) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(adapters["rslora"][0], bad)
    rewrite_config(bad, **change)
    engine = make_engine(tiny_checkpoint("llama"), loras={})
    reply = engine.control(lambda ctl_id: LoadLoraAdapter(ctl_id, "bad", str(bad)))
    assert reply.status == 400 and error in reply.message, reply.message


def test_adapters_that_do_not_fit_are_400s(adapters, tiny_checkpoint, tmp_path: Path) -> None:
    model = tiny_checkpoint("llama")
    engine = make_engine(model, loras={}, max_lora_rank=4)

    def load(path: Path) -> str:
        reply = engine.control(lambda ctl_id: LoadLoraAdapter(ctl_id, "x", str(path)))
        assert reply.status == 400, reply.message
        return reply.message

    assert "rank 8 is over --max-lora-rank 4" in load(adapters["every"][0])
    assert "no such directory" in load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert "no adapter_config.json" in load(tmp_path / "empty")
    hidden = engine.runner.model_config.hidden_size
    q = "base_model.model.model.layers.%d.self_attn.q_proj.lora_%s.weight"
    wide = {q % (0, "A"): torch.ones(4, hidden + 1), q % (0, "B"): torch.ones(hidden, 4)}
    assert "the base's" in load(_written(adapters, tmp_path / "wide", wide))
    deep = {q % (99, "A"): torch.ones(4, hidden), q % (99, "B"): torch.ones(hidden, 4)}
    assert "layer 99" in load(_written(adapters, tmp_path / "deep", deep))
    half = {q % (0, "A"): torch.ones(4, hidden)}
    assert "lora_B is missing" in load(_written(adapters, tmp_path / "half", half))
    moe = make_engine(tiny_checkpoint("qwen3_moe"), loras={})
    make_adapter(tiny_checkpoint("qwen3_moe"), tmp_path / "experts", ("gate_proj", "up_proj"), 4, 8)
    reply = moe.control(lambda ctl_id: LoadLoraAdapter(ctl_id, "x", str(tmp_path / "experts")))
    assert reply.status == 400 and "expert" in reply.message, reply.message
    # NOTE: nothing of a refused adapter is kept: the slot serves the next one whole
    assert (
        engine.control(lambda c: LoadLoraAdapter(c, "ok", str(adapters["rslora"][0]))).status == 200
    )
    _check_oracle(engine.generate([_request("ok")])[0], adapters["rslora"][1])


def _written(adapters: dict, directory: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """An adapter directory with rslora's config and these tensors."""
    import shutil

    from safetensors.torch import save_file

    directory.mkdir()
    shutil.copy(adapters["rslora"][0] / "adapter_config.json", directory)
    save_file(tensors, directory / "adapter_model.safetensors")
    return directory


def test_lora_off_refuses_adapter_commands(tiny_checkpoint, adapters) -> None:
    engine = make_engine(tiny_checkpoint("llama"))
    reply = engine.control(lambda c: LoadLoraAdapter(c, "a", str(adapters["every"][0])))
    assert reply.status == 400 and "--enable-lora" in reply.message
    assert engine.generate([_request("a")])[0].finish_reason == NO_ADAPTER
