"""Random PEFT LoRA adapters on the tests' tiny checkpoints, and the oracle: transformers
with the adapter merged by peft (merge_and_unload), in float32."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    base: Path,
    out: Path,
    targets: tuple[str, ...] = ALL_TARGETS,
    rank: int = 8,
    alpha: float = 16,
    seed: int = 0,
    **settings: Any,
) -> torch.nn.Module:
    """A PEFT adapter with random A and B (not PEFT's zero B) saved at `out`; returns the
    base with it merged (float32), the oracle."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        init_lora_weights=False,
        **settings,
    )
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out)
    return peft_model.merge_and_unload().eval()


def rewrite_config(adapter: Path, **changes: Any) -> None:
    """adapter_config.json with some settings changed (a test's bad adapter)."""
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def teacher_forced(
    model: torch.nn.Module, prompt: list[int], output: list[int]
) -> tuple[list[int], np.ndarray]:
    """prompt + output through `model`: the greedy token at each output position, and the
    logprob of every token after the first, given those before it."""
    ids = prompt + output
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    scored = logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    return logits[len(prompt) - 1 : -1].argmax(-1).tolist(), scored
