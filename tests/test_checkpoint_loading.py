"""Checkpoints as transformers itself writes them load too: the newer config spelling
(`rope_parameters`, `dtype`), sharded safetensors with an index, and the same numbers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from helpers import make_engine

from tokenmill.offline.engine import OfflineRequest
from tokenmill.tp_worker.model.config import load_model_config, parse_model_config


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_resaved_sharded_checkpoint_gives_the_same_numbers(
    arch: str, tiny_checkpoint, tmp_path: Path
) -> None:
    original = tiny_checkpoint(arch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32)
    resaved = tmp_path / "resaved"
    hf.save_pretrained(resaved, max_shard_size="200KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (resaved / name).write_bytes((original / name).read_bytes())
    assert (resaved / "model.safetensors.index.json").exists()
    assert len(list(resaved.glob("model-*.safetensors"))) > 1
    raw = json.loads((resaved / "config.json").read_text())
    assert "dtype" in raw or "rope_parameters" in raw  # the newer spelling
    assert load_model_config(resaved) == load_model_config(original)
    request = OfflineRequest(list(range(3, 40)), max_tokens=6, num_top=3, prompt_logprob_start=0)
    a = make_engine(original).generate([request])[0]
    b = make_engine(resaved).generate([request])[0]
    assert a.output_ids == b.output_ids
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    np.testing.assert_array_equal(a.prompt_logprobs, b.prompt_logprobs)


def test_both_config_spellings_parse_alike() -> None:
    old = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "torch_dtype", "rope_scaling")}
    new["dtype"] = "bfloat16"
    new["rope_parameters"] = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert parse_model_config(old) == parse_model_config(new)
    assert parse_model_config(old).rope_scaling["rope_type"] == "llama3"
    qwen = {**old, "architectures": ["Qwen3ForCausalLM"], "sliding_window": 64}
    on = {**qwen, "use_sliding_window": True}
    assert parse_model_config(qwen).sliding_window is None
    assert parse_model_config({**on, "max_window_layers": 0}).sliding_window == 64
    layers = old["num_hidden_layers"]
    assert parse_model_config({**on, "max_window_layers": layers}).sliding_window is None
    first_full = parse_model_config({**on, "max_window_layers": 1})
    assert first_full.sliding_window == 64 and first_full.full_attention_layers == (0,)
    gemma = {**old, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 64}
    # NOTE: without layer_types, Gemma 2's rule (every other layer from the first slides)
    # and Gemma 3's (five of six; sliding_window_pattern where config.json says it)
    assert parse_model_config(gemma).full_attention_layers == tuple(range(1, layers, 2))
    gemma3 = {**gemma, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 12}
    assert parse_model_config(gemma3).full_attention_layers == (5, 11)
    assert parse_model_config({**gemma3, "sliding_window_pattern": 4}).full_attention_layers == (
        3,
        7,
        11,
    )
    with pytest.raises(ValueError, match="bidirectional"):
        parse_model_config({**gemma3, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="chunked_attention"):
        parse_model_config({**gemma, "layer_types": ["chunked_attention"] * layers})
    with pytest.raises(ValueError, match="activation 'relu'"):
        parse_model_config({**old, "hidden_act": "relu"})
    with pytest.raises(ValueError, match="unsupported architectures"):
        parse_model_config({**old, "architectures": ["GPT2LMHeadModel"]})


def test_gpt_oss_mxfp4_experts_are_the_dequantized_model(tiny_checkpoint, tmp_path: Path) -> None:
    """gpt-oss's checkpoints hold their experts in MXFP4 (`*_blocks`, `*_scales`): served
    dequantized, they are the model transformers' own dequantization gives, bit for bit in
    float32 (the dequantized checkpoint is the one test_oracle checks against transformers)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tokenmill.tp_worker.model import mxfp4

    original = tiny_checkpoint("gpt_oss")
    tensors = load_file(str(original / "model.safetensors"))
    quantized, dequantized = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # NOTE: the checkpoints' layout: [E, out, in] blocks of what transformers multiplies by
        blocks, scales = _mxfp4_quantized(tensors[name].transpose(1, 2))
        del quantized[name]
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert torch.equal(dequantized[name], mxfp4.dequantize(blocks, scales).transpose(1, 2))
    dirs = {}
    for kind, weights in (("mxfp4", quantized), ("dequantized", dequantized)):
        dirs[kind] = tmp_path / kind
        dirs[kind].mkdir()
        for path in original.iterdir():
            if path.name != "model.safetensors":
                (dirs[kind] / path.name).write_bytes(path.read_bytes())
        save_file(weights, str(dirs[kind] / "model.safetensors"), metadata={"format": "pt"})
    request = OfflineRequest(list(range(3, 40)), max_tokens=6, num_top=3, prompt_logprob_start=0)
    a = make_engine(dirs["mxfp4"]).generate([request])[0]
    b = make_engine(dirs["dequantized"]).generate([request])[0]
    assert a.output_ids == b.output_ids
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    np.testing.assert_array_equal(a.prompt_logprobs, b.prompt_logprobs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(dirs["dequantized"], dtype=torch.float32)
    with torch.no_grad():
        logits = hf.eval()(torch.tensor([request.prompt_ids])).logits[0].double()
    expected = torch.log_softmax(logits, -1)[torch.arange(36), torch.tensor(request.prompt_ids[1:])]
    np.testing.assert_allclose(a.prompt_logprobs, expected.numpy(), atol=1e-4, rtol=0)


def test_mxfp4_blocks_without_their_scales_fail_naming_them(tmp_path: Path) -> None:
    """A checkpoint that holds an MXFP4 tensor's blocks but not its scales fails at load,
    naming the missing tensor."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tokenmill.tp_worker.model import weights

    path = tmp_path / "model.safetensors"
    blocks = torch.zeros(2, 4, 1, 16, dtype=torch.uint8)
    save_file({"model.layers.0.mlp.experts.down_proj_blocks": blocks}, str(path))
    with safe_open(str(path), framework="pt") as f, pytest.raises(ValueError, match="_scales"):
        weights._dequantized([path], f, "model.layers.0.mlp.experts.down_proj_blocks")


def _mxfp4_quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., rows, cols] (float) -> (blocks, scales) that dequantize to the nearest E2M1
    values of W / 2^e per block, e the smallest with max |W| / 2^e <= 6."""
    from tokenmill.tp_worker.model import mxfp4

    *lead, rows, cols = weight.shape
    grouped = weight.float().reshape(*lead, rows, cols // mxfp4.BLOCK, mxfp4.BLOCK)
    top = grouped.abs().amax(-1).clamp(min=2.0**-126)
    exponents = torch.ceil(torch.log2(top / 6.0)).clamp(-127, 127)
    scaled = grouped / torch.ldexp(torch.ones_like(exponents), exponents.int()).unsqueeze(-1)
    table = torch.tensor(mxfp4.E2M1, dtype=torch.float32)
    codes = (scaled.unsqueeze(-1) - table).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponents.int() + 127).to(torch.uint8)
