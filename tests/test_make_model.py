"""The checkpoint builder writes standard HF checkpoints that transformers loads as is.

These checkpoints are what the end-to-end and oracle tests serve, so they check the
properties those tests rely on: tokenizers agree, bos as upstream, peaked distributions.
"""

from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from tokenmill.cli.make_model import ARCHS, build_checkpoint  # noqa: E402
from tokenmill.cli.make_model.tokenizer import QWEN_ARCHS  # noqa: E402
from tokenmill.cli.make_model.weights import (  # noqa: E402
    PRESET_SHAPES,
    make_config,
    write_weights,
)

SAMPLES = [
    "Hello, world!",
    "def main(argv: list[str]) -> int:\n    return len(argv)  # count\n",
    "Größe, café, naïve — 東京 and 🙂 emoji",
    unicodedata.normalize("NFD", "crème brûlée"),
    "  leading spaces\n\n\ttabs and 12345 digits",
    "<|im_start|>user\nhi<|im_end|>\n",
]
PEAK_TEXT = (
    "The json module can serialize Python objects to JSON text and parse it back. "
    "def dumps(obj, *, indent=None):\n    return JSONEncoder(indent=indent).encode(obj)\n"
    "Encoding errors raise ValueError; a dict with non-string keys raises TypeError."
)
# Measured on tiny with this text: mean top-1 probability 0.5-0.65 for every arch.
MIN_MEAN_TOP1 = 0.35


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: build_checkpoint(root / arch, arch, "tiny") for arch in ARCHS}


def _load_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]  # [T, V] float32


def _file_hashes(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("arch", ARCHS)
def test_files_and_config(checkpoints: dict[str, Path], arch: str) -> None:
    path = checkpoints[arch]
    names = {p.name for p in path.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    config = json.loads((path / "config.json").read_text())
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert config["model_type"] == {"gemma3": "gemma3_text"}.get(arch, arch)
    assert config["vocab_size"] >= raw.get_vocab_size()
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    generation = json.loads((path / "generation_config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert generation[key] == config[key]
    assert raw.id_to_token(config["bos_token_id"]) == "<|begin_of_text|>"
    eos = config["eos_token_id"]
    # NOTE: Gemma's turns end generation too, as Gemma's generation_config says
    ends = ["<|end_of_text|>", "<end_of_turn>"] if arch.startswith("gemma") else ["<|end_of_text|>"]
    assert [raw.id_to_token(i) for i in (eos if isinstance(eos, list) else [eos])] == ends
    assert raw.id_to_token(config["pad_token_id"]) == "<|pad|>"


def test_arch_specifics(checkpoints: dict[str, Path]) -> None:
    llama = AutoConfig.from_pretrained(checkpoints["llama"])
    assert llama.rope_parameters["rope_type"] == "llama3"
    assert llama.rope_parameters["rope_theta"] == 500000.0
    qwen2 = AutoConfig.from_pretrained(checkpoints["qwen2"])
    assert qwen2.tie_word_embeddings and not qwen2.use_sliding_window
    with safe_open(str(checkpoints["qwen2"] / "model.safetensors"), "np") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys
    assert "model.layers.0.self_attn.q_proj.bias" in keys
    with safe_open(str(checkpoints["llama"] / "model.safetensors"), "np") as f:
        assert "lm_head.weight" in set(f.keys())
        assert f.metadata() == {"format": "pt"}
    qwen3 = AutoConfig.from_pretrained(checkpoints["qwen3"])
    assert qwen3.head_dim == 2 * qwen3.hidden_size // qwen3.num_attention_heads
    assert qwen3.rope_parameters["rope_type"] == "yarn"
    with safe_open(str(checkpoints["qwen3"] / "model.safetensors"), "pt") as f:
        norm = f.get_tensor("model.layers.0.self_attn.q_norm.weight")
        assert norm.shape == (qwen3.head_dim,) and not torch.equal(norm, torch.ones_like(norm))
    phi3 = AutoConfig.from_pretrained(checkpoints["phi3"])
    assert phi3.rope_parameters["rope_type"] == "longrope" and phi3.partial_rotary_factor < 1
    with safe_open(str(checkpoints["phi3"] / "model.safetensors"), "np") as f:
        assert {
            "model.layers.0.self_attn.qkv_proj.weight",
            "model.layers.0.mlp.gate_up_proj.weight",
        } <= set(f.keys())
    granite = AutoConfig.from_pretrained(checkpoints["granite"])
    multipliers = ("embedding_multiplier", "attention_multiplier", "residual_multiplier")
    assert all(getattr(granite, m) != 1.0 for m in multipliers) and granite.logits_scaling != 1
    gemma2 = AutoConfig.from_pretrained(checkpoints["gemma2"])
    assert gemma2.layer_types == ["sliding_attention", "full_attention"]
    assert gemma2.attn_logit_softcapping and gemma2.final_logit_softcapping
    assert gemma2.query_pre_attn_scalar != gemma2.head_dim
    gemma3 = AutoConfig.from_pretrained(checkpoints["gemma3"])
    assert gemma3.rope_parameters["full_attention"]["rope_type"] == "linear"
    with safe_open(str(checkpoints["gemma3"] / "model.safetensors"), "pt") as f:
        # NOTE: Gemma's norms scale by 1 + w: their weights lie around 0
        norm = f.get_tensor("model.layers.0.pre_feedforward_layernorm.weight")
        assert norm.abs().mean() < 0.5 and "model.layers.0.self_attn.q_norm.weight" in set(f.keys())  # noqa: SIM118 (safe_open is not a mapping)


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizers_agree_and_bos(checkpoints: dict[str, Path], arch: str) -> None:
    path = checkpoints[arch]
    auto = AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert len(auto) == raw.get_vocab_size()
    for text in SAMPLES:
        ids = raw.encode(text).ids
        assert auto(text).input_ids == ids, text
        assert (ids[0] == auto.bos_token_id) == (arch not in QWEN_ARCHS), text
        # Qwen2's pipeline starts with NFC, as upstream; decoding skips special tokens.
        expected = unicodedata.normalize("NFC", text) if arch in QWEN_ARCHS else text
        for special in ("<|im_start|>", "<|im_end|>"):
            expected = expected.replace(special, "")
        assert raw.decode(ids) == expected
        assert auto.decode(ids, skip_special_tokens=True) == raw.decode(ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_is_peaked(checkpoints: dict[str, Path], arch: str) -> None:
    path = checkpoints[arch]
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(PEAK_TEXT).ids
    probs = _logits(_load_model(path), ids).softmax(-1)
    assert probs.shape[0] == len(ids) and torch.isfinite(probs).all()
    top = probs.topk(20, dim=-1).values
    assert top[:, 0].mean() > MIN_MEAN_TOP1
    assert (top[:, 0] > 2 * top[:, 19]).all()


def test_context_changes_the_distribution(checkpoints: dict[str, Path]) -> None:
    """The same last token after different prefixes must predict differently (KV matters)."""
    path = checkpoints["llama"]
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    model = _load_model(path)
    a, b = raw.encode("hello world then").ids, raw.encode("import os; x = 1 then").ids
    assert a[-1] == b[-1]
    la, lb = _logits(model, a)[-1], _logits(model, b)[-1]
    assert (la - lb).abs().max() > 1.0


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template(checkpoints: dict[str, Path], arch: str) -> None:
    auto = AutoTokenizer.from_pretrained(checkpoints[arch])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    text = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    body = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    opening = "<|im_start|>assistant\n"
    if arch.startswith("gemma"):
        # NOTE: Gemma's: the system message opens the first user turn; the assistant is "model"
        body = "<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
        opening = "<start_of_turn>model\n"
    assert text == ("" if arch in QWEN_ARCHS else "<|begin_of_text|>") + body
    ids = auto.apply_chat_template(messages, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids.count(auto.bos_token_id) == (0 if arch in QWEN_ARCHS else 1)
    prompt = auto(opening, add_special_tokens=False).input_ids
    assert ids[-len(prompt) :] == prompt


def test_sharded_checkpoint_loads_and_matches(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = build_checkpoint(tmp_path / "sharded", "llama", "tiny", shard_bytes=100_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and not (path / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == set(shards)
    total = 0
    for name in shards:
        with safe_open(str(path / name), "np") as f:
            keys = f.keys()  # NOTE: safe_open handles are not iterable
            for key in keys:
                assert index["weight_map"][key] == name
                total += f.get_tensor(key).nbytes
    assert index["metadata"]["total_size"] == total
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(PEAK_TEXT).ids
    sharded = _logits(_load_model(path), ids)
    single = _logits(_load_model(checkpoints["llama"]), ids)
    assert torch.equal(sharded, single)


def test_deterministic_and_replaces(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = build_checkpoint(tmp_path / "again", "llama", "tiny")
    assert _file_hashes(path) == _file_hashes(checkpoints["llama"])
    build_checkpoint(path, "llama", "tiny", seed=1)
    changed = _file_hashes(path)
    assert changed["model.safetensors"] != _file_hashes(checkpoints["llama"])["model.safetensors"]
    assert changed["tokenizer.json"] == _file_hashes(checkpoints["llama"])["tokenizer.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]


def test_padded_vocab_rows_are_zero(tmp_path: Path) -> None:
    """Embedding rows past the tokenizer (a padded vocab, e.g. 128256) are never predicted."""
    config = make_config("mistral", PRESET_SHAPES["tiny"], {})
    config["vocab_size"] = 1100
    write_weights(tmp_path, config, seed=0, num_used_tokens=1000)
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        lm_head = f.get_tensor("lm_head.weight")
    assert lm_head.shape == (1100, 64)
    assert not lm_head[1000:].any() and lm_head[:1000].all(axis=1).any()


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch"):
        build_checkpoint(tmp_path / "x", "gpt2", "tiny")
    with pytest.raises(ValueError, match="preset"):
        build_checkpoint(tmp_path / "x", "llama", "huge")
    assert not (tmp_path / "x").exists()


def test_the_sentencepiece_style_tokenizer(tmp_path: Path) -> None:
    """`--tokenizer sentencepiece`: Metaspace with a dummy prefix on the first word, BPE with
    byte fallback over <0x00>..<0xFF>, Llama 2's decoder; transformers loads it as
    LlamaTokenizer and decodes what it encodes."""
    import subprocess
    import sys

    out = tmp_path / "sp"
    subprocess.run(
        [sys.executable, "-m", "tokenmill.cli.main", "make-model", str(out), "--tokenizer",
         "sentencepiece"],
        check=True, capture_output=True,
    )  # fmt: skip
    spec = json.loads((out / "tokenizer.json").read_text())
    assert spec["pre_tokenizer"]["type"] == "Metaspace"
    assert spec["model"]["byte_fallback"] is True
    assert all(f"<0x{b:02X}>" in spec["model"]["vocab"] for b in range(256))
    hf = AutoTokenizer.from_pretrained(out)
    assert type(hf).__name__ == "LlamaTokenizer"
    for text in SAMPLES[:3]:
        ids = hf.encode(text)
        assert ids[0] == hf.bos_token_id
        assert hf.decode(ids, skip_special_tokens=True) == text
    pieces = hf.convert_ids_to_tokens(hf.encode("东京 🙂", add_special_tokens=False))
    assert pieces[0].startswith("▁") and any(p.startswith("<0x") for p in pieces)
