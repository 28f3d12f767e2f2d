"""The model families tokenmill runs, as one table of switches (tp_worker).

Every family runs through the same decoder (decoder.py); what sets one apart is a row here,
read once when config.json is parsed (config.py) into plain ModelConfig fields that the
layers read. A new family is a new row, plus, where it differs in a way no switch covers yet,
a new field and the one place in the layers that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    # NOTE: None: as config.json's `attention_bias` says (Llama); True: always (Qwen2)
    qkv_bias: bool | None = None
    # NOTE: a config.json key that must be true for `sliding_window` to apply (Qwen2 writes
    # a window it does not use unless `use_sliding_window`); None: the window applies
    sliding_window_switch: str | None = None
    # NOTE: an RMSNorm of q and of k before RoPE: over each head ("head": Qwen3), or over the
    # whole projection ("projection": OLMo 2); "": none
    qk_norm: str = ""
    # NOTE: where a layer's norms sit: "pre" (before attention and before the MLP: Llama),
    # "post" (after each, before its residual add: OLMo 2)
    norms: str = "pre"
    # NOTE: the checkpoint holds q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`
    # (Phi-3); the layers fuse them the same way whatever the checkpoint holds
    fused_checkpoint: bool = False


FAMILIES: dict[str, Family] = {  # the Hugging Face architecture name -> its switches
    "LlamaForCausalLM": Family("llama"),
    "MistralForCausalLM": Family("mistral"),
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias=True, sliding_window_switch="use_sliding_window"),
    "Qwen3ForCausalLM": Family("qwen3", sliding_window_switch="use_sliding_window", qk_norm="head"),
    "Phi3ForCausalLM": Family("phi3", fused_checkpoint=True),
    # NOTE: its multipliers are config.json fields (ModelConfig's, default 1 for the rest)
    "GraniteForCausalLM": Family("granite"),
    "Olmo2ForCausalLM": Family("olmo2", qk_norm="projection", norms="post"),
}
