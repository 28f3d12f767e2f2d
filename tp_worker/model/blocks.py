"""A GGUF file's quantized matrices, as their blocks, into this rank's share of the model
(tp_worker; the converted checkpoint names them in gguf_source.json's "blocks",
cli/gguf_convert.py).

A dense layer's q/k/v, output, gate/up and down matrices and the embeddings keep their
blocks (ShardedLinear.take_blocks, VocabEmbedding.take_blocks), each sharded as its float
weight is: column-parallel rows as they are, row-parallel columns in whole blocks. The CPU
kernels then multiply them as they are (cpu/quantized.py); any other path dequantizes them
first (CausalLM.dequantize_blocks). A tensor with no place for blocks (an expert's, one whose
shard would split a block) is dequantized here and loaded as a float one.
"""

from __future__ import annotations

import re

from tokenmill.tp_worker.cpu.quantized import QuantRows, dequantize
from tokenmill.tp_worker.model import weights
from tokenmill.tp_worker.model.decoder import CausalLM

_LAYER = re.compile(
    r"model\.layers\.(\d+)\.(self_attn|mlp)\.(q|k|v|o|qkv|gate|up|down|gate_up)_proj\.weight"
)


def load_blocks(model: CausalLM, name: str, rows: QuantRows) -> bool:
    """One quantized tensor into the model: as blocks where it has a place for them, else
    dequantized (weights.load_tensor). False for a tensor the model has no place for."""
    name = weights.text_model_name(name)
    try:
        if _take(model, name, rows):
            return True
    except ValueError:
        pass  # NOTE: a shard that would split a block: the float weight takes it
    return weights.load_tensor(model, name, dequantize(rows))


def _take(model: CausalLM, name: str, rows: QuantRows) -> bool:
    if name == "model.embed_tokens.weight":
        return model.embed_tokens.take_blocks(rows)
    if name == "lm_head.weight":
        return not model.config.tie_word_embeddings and model.lm_head.take_blocks(rows)
    match = _LAYER.fullmatch(name)
    if match is None or model.config.residual_multiplier != 1.0:
        return False
    layer = model.layers[int(match[1])]
    if layer.moe is not None and match[2] == "mlp":
        return False  # NOTE: a mixture of experts' layer: its experts are float panels
    group, config, which = model.group, model.config, match[3]
    if which == "qkv":
        q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        parts = zip("qkv", (0, q_rows, q_rows + kv_rows), (q_rows, kv_rows, kv_rows), strict=True)
        return all(
            _take(model, _part_name(name, p), rows.select(slice(at, at + count)))
            for p, at, count in parts
        )
    if which == "gate_up":
        half = rows.rows // 2
        gate, up = rows.select(slice(0, half)), rows.select(slice(half, 2 * half))
        return _take(model, _part_name(name, "gate"), gate) and _take(
            model, _part_name(name, "up"), up
        )
    if which == "o":
        start, end = group.shard(rows.width, "num_attention_heads * head_dim")
        return layer.o_proj.take_blocks(0, rows.columns(start, end))
    if which == "down":
        start, end = group.shard(rows.width, "intermediate_size")
        return layer.down_proj.take_blocks(0, rows.columns(start, end))
    if which in ("gate", "up"):
        start, end = group.shard(rows.rows, "intermediate_size")
        return layer.gate_up_proj.take_blocks(
            0 if which == "gate" else end - start, rows.select(slice(start, end))
        )
    heads = config.num_heads if which == "q" else config.num_kv_heads
    share = weights.head_rows(heads, config.head_dim, which, model)
    first = weights.qkv_rows(model, which).start
    return layer.qkv_proj.take_blocks(first, rows.select(share))


def _part_name(name: str, part: str) -> str:
    return re.sub(r"\.(qkv|gate_up)_proj\.", f".{part}_proj.", name)
