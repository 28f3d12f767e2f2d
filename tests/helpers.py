"""Test helpers: an in-process runner, and the transformers oracle."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tokenmill.controller.grammar import GrammarEngine
from tokenmill.controller.speculation import SpeculativeConfig
from tokenmill.offline.engine import OfflineEngine, OfflineOutput
from tokenmill.tp_worker.config import RunnerConfig
from tokenmill.tp_worker.model_runner import ModelRunner


def make_engine(
    model: Path,
    prompt_chunk: int = 0,
    max_prefill_tokens: int = 4096,
    decode_steps: int = 1,
    rows: int = 8,
    prefix_cache: bool = True,
    dtype: str = "float32",
    cpu_kernels: bool = True,
    logprobs_mode: str = "raw",
    speculative_config: str = "",
    grammar: bool = False,
    routed_experts: bool = False,
    loras: dict[str, Path] | None = None,
    max_loras: int = 4,
    max_lora_rank: int = 16,
) -> OfflineEngine:
    """grammar: with the grammar engine, for constrained requests; routed_experts: each
    MoE token's experts kept (--enable-return-routed-experts); loras: LoRA on (max_loras
    slots), with these adapters (name -> PEFT directory) loaded."""
    config = RunnerConfig(
        model=str(model),
        kv_cache_tokens=rows * 512,
        max_running_requests=rows,
        max_model_len=512,
        dtype=dtype,
        device="cpu",
        prompt_logprob_chunk=prompt_chunk,
        cpu_kernels=cpu_kernels,
        logprobs_mode=logprobs_mode,
        return_routed_experts=routed_experts,
        draft_model=spec.model if (spec := SpeculativeConfig.parse(speculative_config)) else "",
        max_loras=max_loras if loras is not None else 0,
        max_lora_rank=max_lora_rank,
        lora_modules=tuple(str(path) for path in (loras or {}).values()),
    )
    runner = ModelRunner(config)
    return OfflineEngine(
        runner,
        max_prefill_tokens=max_prefill_tokens,
        decode_steps=decode_steps,
        enable_prefix_cache=prefix_cache,
        speculative_config=speculative_config,
        grammar=GrammarEngine.for_checkpoint(str(model), runner.model_config.eos_token_ids)
        if grammar
        else None,
        lora_names=tuple(loras or ()),
    )


@dataclass(frozen=True)
class Oracle:
    """Teacher-forced transformers log-softmax over a whole token sequence."""

    logprobs: np.ndarray  # [len - 1, V]: row i is the distribution of token i + 1

    def of(self, positions: np.ndarray, ids: list[int]) -> np.ndarray:
        return self.logprobs[positions, ids]


def oracle(
    hf_model: torch.nn.Module, ids: list[int], softmax_dtype: torch.dtype = torch.float32
) -> Oracle:
    """The log-softmax of the model's logits taken in `softmax_dtype` (float64: only the
    model's forward pass in its own dtype differs from the exact one)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].to(softmax_dtype)
    return Oracle(torch.log_softmax(logits, dim=-1)[:-1].numpy())


def _bits(values: list) -> np.ndarray:
    return np.asarray(values, np.float32).view(np.int32)


def assert_same_bits(a: OfflineOutput, b: OfflineOutput) -> None:
    """The same tokens and the same float bits of every logprob an output carries."""
    assert a.output_ids == b.output_ids
    assert np.array_equal(_bits(a.logprobs), _bits(b.logprobs))
    assert np.array_equal(np.asarray(a.top_ids), np.asarray(b.top_ids))
    assert np.array_equal(_bits(a.top_logprobs), _bits(b.top_logprobs))
    assert np.array_equal(_bits(a.token_ids_logprobs), _bits(b.token_ids_logprobs))
    assert np.array_equal(_bits(a.prompt_logprobs), _bits(b.prompt_logprobs))
    assert np.array_equal(np.asarray(a.prompt_top_ids), np.asarray(b.prompt_top_ids))
    assert np.array_equal(_bits(a.prompt_top_logprobs), _bits(b.prompt_top_logprobs))
    assert a.finish_reason == b.finish_reason


def assert_matches_oracle(
    out: OfflineOutput, prompt: list[int], hf_model: torch.nn.Module, atol: float
) -> Oracle:
    """A greedy output against a teacher-forced transformers pass over prompt + output: the
    same ids, their logprobs and top-k, and every prompt position's logprob within atol."""
    ref = oracle(hf_model, prompt + out.output_ids)
    n = len(prompt)
    gen_pos = np.arange(n - 1, n - 1 + len(out.output_ids))
    assert out.output_ids == ref.logprobs[gen_pos].argmax(-1).tolist()
    np.testing.assert_allclose(out.logprobs, ref.of(gen_pos, out.output_ids), atol=atol, rtol=0)
    prompt_pos = np.arange(n - 1)
    assert len(out.prompt_logprobs) == n - 1
    np.testing.assert_allclose(
        out.prompt_logprobs, ref.of(prompt_pos, prompt[1:]), atol=atol, rtol=0
    )
    for i, pos in enumerate(gen_pos):
        assert_top_close(out.top_ids[i], out.top_logprobs[i], ref.logprobs[pos], atol)
    return ref


def assert_top_close(
    our_ids: np.ndarray, our_lps: np.ndarray, ref: np.ndarray, atol: float, tie: float = 1e-6
) -> None:
    """Our top-k at one position against the reference distribution `ref` [V]: the same
    values rank by rank, and the same ids except where the reference has ties within `tie`."""
    k = len(our_ids)
    order = np.argsort(-ref, kind="stable")
    ref_vals = ref[order[:k]]
    np.testing.assert_allclose(our_lps, ref_vals, atol=atol, rtol=0)
    np.testing.assert_allclose(ref[our_ids], ref_vals, atol=atol, rtol=0)
    kth = ref_vals[-1]
    must_have = set(order[:k][ref_vals > kth + tie].tolist())
    missing = must_have - set(our_ids.tolist())
    assert not missing, f"top-{k} lacks ids {missing} that the reference ranks clearly higher"


def assert_same_tp_answer(a: dict, b: dict) -> None:
    """Two /generate answers of the same request at different tensor-parallel layouts: the
    same tokens, logprobs within 1e-5 + 1e-6 |logprob| (the all-reduce sums partial products
    in another order: a relative error, visible on logprobs of -30)."""
    assert a["output_ids"] == b["output_ids"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        np.testing.assert_allclose(
            [e[0] for e in a["meta_info"][key]],
            [e[0] for e in b["meta_info"][key]],
            atol=1e-5,
            rtol=1e-6,
        )


def float_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """A one-file checkpoint's tensors, a converted GGUF file's blocks as the gguf package
    dequantizes them (float32)."""
    from safetensors.torch import load_file

    from tokenmill.tp_worker.cpu.quantized import QuantRows, dequantize
    from tokenmill.tp_worker.model.weights import gguf_block_types

    tensors = load_file(str(model_dir / "model.safetensors"))
    for name, qtype in gguf_block_types(model_dir).items():
        tensors[name] = dequantize(QuantRows.of(qtype, tensors[name]))
    return tensors
