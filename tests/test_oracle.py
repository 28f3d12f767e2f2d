"""The numbers match transformers: prompt logprobs at every position, and 32 greedy tokens
with their logprobs and top-20, for every supported architecture (float32, CPU)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from conftest import ARCHS
from helpers import assert_matches_oracle, assert_top_close, make_engine, oracle

from tokenmill.cli.gguf_checkpoint import transformers_model
from tokenmill.frontend.tokenizer import Tokenizer as FrontendTokenizer
from tokenmill.offline.engine import OfflineRequest

TEXTS = [
    "The module",
    "Return a new list containing all items from the iterable in ascending order.",
    "Ünïcödé and emoji 🎉 split over byte-level tokens, then some ordinary words follow "
    "so that this prompt is clearly longer than the others in the batch.",
]
ATOL = 1e-4
TORCH_PATH_ARCHS = ("llama", "qwen3", "phi3", "olmo2", "gemma2", "gemma3", "gpt_oss")


@pytest.mark.parametrize(
    ("arch", "kind", "cpu_kernels"),
    [(arch, "auto", True) for arch in ARCHS]
    + [(arch, "auto", False) for arch in TORCH_PATH_ARCHS]
    + [("mistral", "sentencepiece", True), ("qwen2", "byte-level", True)],
)
def test_matches_transformers(arch: str, kind: str, cpu_kernels: bool, tiny_checkpoint) -> None:
    """cpu_kernels=False: the torch path (SDPA over gathered keys) that CUDA takes. The
    prompts are tokenized by the frontend's Tokenizer and by transformers' AutoTokenizer:
    the same ids (the qwen2 byte-level tokenizer.json is one transformers overrides)."""
    model_dir = tiny_checkpoint(arch, kind)
    tokenizer = FrontendTokenizer(model_dir)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [tokenizer.encode(t) for t in TEXTS]
    assert prompts == [hf_tokenizer.encode(t) for t in TEXTS]
    requests = [
        OfflineRequest(p, max_tokens=32, num_top=20, prompt_logprob_start=0) for p in prompts
    ]
    outputs = make_engine(model_dir, cpu_kernels=cpu_kernels).generate(requests)
    for prompt, out in zip(prompts, outputs, strict=True):
        ref = assert_matches_oracle(out, prompt, hf, ATOL)
        for i, pos in enumerate(range(len(prompt) - 1)):
            assert_top_close(
                out.prompt_top_ids[i], out.prompt_top_logprobs[i], ref.logprobs[pos], ATOL
            )


def test_longrope_past_its_original_length_takes_the_long_factors(
    tiny_checkpoint, tmp_path
) -> None:
    """A server that takes sequences longer than LongRoPE's original length rotates every
    one by the long factors (config.py's longrope_factors): a sequence longer than that gets
    transformers' numbers, as transformers computes one forward call of it. (The tiny phi3's
    own 4,096 are past the tests' max_model_len of 512: the short factors, tested above.)"""
    model_dir = tmp_path / "phi3-long"
    shutil.copytree(tiny_checkpoint("phi3"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    # NOTE: a factor of 4 (128 / 32), as Phi-3.5-mini's 131,072 / 4,096 is 32: not 16,384 / 32,
    # whose attention factor of 1.67 leaves logprobs of -30 a relative 4e-6 apart
    config.update(original_max_position_embeddings=32, max_position_embeddings=128)
    (model_dir / "config.json").write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = list(range(5, 53))
    request = OfflineRequest(prompt, max_tokens=16, num_top=5, prompt_logprob_start=0)
    out = make_engine(model_dir).generate([request])[0]
    assert_matches_oracle(out, prompt, hf, ATOL)
    short = make_engine(tiny_checkpoint("phi3")).generate([request])[0]
    assert short.prompt_logprobs != out.prompt_logprobs


def test_distributions_are_peaked(tiny_checkpoint) -> None:
    """Top-k order must mean something: the demo weights are not a flat distribution."""
    out = make_engine(tiny_checkpoint("llama")).generate(
        [OfflineRequest(list(range(5, 40)), max_tokens=16)]
    )[0]
    assert np.mean(np.exp(out.logprobs)) > 0.2


def test_token_ids_logprob_and_chosen_outside_top_k(tiny_checkpoint) -> None:
    """Caller-given ids are scored at every position, and the sampled token's own logprob
    comes back even when it falls outside the requested top-k."""
    model_dir = tiny_checkpoint("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = list(range(10, 30))
    req = OfflineRequest(
        prompt, max_tokens=8, num_top=1, temperature=5.0, seed=3, token_ids=(7, 100, 500)
    )
    out = make_engine(model_dir).generate([req])[0]
    ref = oracle(hf, prompt + out.output_ids)
    gen_pos = np.arange(len(prompt) - 1, len(prompt) - 1 + len(out.output_ids))
    np.testing.assert_allclose(out.logprobs, ref.of(gen_pos, out.output_ids), atol=ATOL, rtol=0)
    outside = [i for i, t in enumerate(out.output_ids) if t != out.top_ids[i][0]]
    assert outside, "at temperature 5 some sampled token should not be the top-1"
    for i, pos in enumerate(gen_pos):
        np.testing.assert_allclose(
            out.token_ids_logprobs[i], ref.logprobs[pos, [7, 100, 500]], atol=ATOL, rtol=0
        )


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_small_preset_matches_transformers(arch: str, checkpoint_root) -> None:
    """The ~25M-parameter preset (6 layers, 8 heads over 2 KV heads, head_dim 64). NOTE:
    float32 itself is off by up to ~2.5e-4 from a float64 run here (transformers' float32
    as much as ours), so this compares with a float64 oracle at 5e-4."""
    from tokenmill.cli.make_model import build_checkpoint

    model_dir = build_checkpoint(checkpoint_root / f"small-{arch}", arch, "small")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    prompt = FrontendTokenizer(model_dir).encode(TEXTS[2])
    request = OfflineRequest(prompt, max_tokens=32, num_top=20, prompt_logprob_start=0)
    out = make_engine(model_dir).generate([request])[0]
    ref = oracle(hf.eval(), prompt + out.output_ids)
    n, atol = len(prompt), 5e-4
    gen_pos = np.arange(n - 1, n - 1 + len(out.output_ids))
    assert out.output_ids == ref.logprobs[gen_pos].argmax(-1).tolist()
    np.testing.assert_allclose(out.logprobs, ref.of(gen_pos, out.output_ids), atol=atol, rtol=0)
    np.testing.assert_allclose(
        out.prompt_logprobs, ref.of(np.arange(n - 1), prompt[1:]), atol=atol, rtol=0
    )
    for i, pos in enumerate(gen_pos):
        assert_top_close(out.top_ids[i], out.top_logprobs[i], ref.logprobs[pos], atol, tie=atol)


MOE_ARCHS = ("qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "gpt_oss")


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in MOE_ARCHS])
def test_bfloat16_is_no_further_from_float32_than_transformers_bfloat16(
    arch: str, tiny_checkpoint
) -> None:
    _assert_bfloat16_promise(tiny_checkpoint(arch))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_bfloat16_experts_are_no_further_from_float32_than_transformers_bfloat16(
    arch: str, tiny_checkpoint
) -> None:
    """The same promise for a mixture of experts, by the typical position: the median error
    over 5 prompts of 400 tokens. NOTE: where a token's two best experts are nearly tied,
    either bfloat16 rounding can flip its routing, a jump of up to a few nats there and in
    what follows; which positions flip is chaotic (on the tiny Mixtral, ours against
    transformers' mean error over one prompt was 0.33 / 0.32, 0.34 / 0.36, 0.31 / 0.25 on
    three), so the mean over positions judges the flips, the median the rounding."""
    model_dir = tiny_checkpoint(arch)
    engine = make_engine(model_dir, dtype="bfloat16")
    hf32, hf16 = _hf(model_dir, torch.float32), _hf(model_dir, torch.bfloat16)
    ours_median, their_median = [], []
    for seed in range(1, 6):
        prompt = np.random.default_rng(seed).integers(3, 1000, 400).tolist()
        positions, targets = np.arange(len(prompt) - 1), prompt[1:]
        exact = oracle(hf32, prompt).of(positions, targets)
        theirs = oracle(hf16, prompt).of(positions, targets)
        request = OfflineRequest(prompt, max_tokens=1, prompt_logprob_start=0)
        ours = np.array(engine.generate([request])[0].prompt_logprobs)
        ours_median.append(float(np.median(np.abs(ours - exact))))
        their_median.append(float(np.median(np.abs(theirs - exact))))
    assert np.mean(ours_median) <= np.mean(their_median), (ours_median, their_median)


def test_bfloat16_on_the_torch_path_too(tiny_checkpoint) -> None:
    """The path CUDA takes (torch's products and SDPA), run on the CPU in bfloat16: the
    float32 residual stream and its roundings hold the same promise."""
    _assert_bfloat16_promise(tiny_checkpoint("llama"), cpu_kernels=False)


def _assert_bfloat16_promise(model_dir, cpu_kernels: bool = True) -> None:
    """The promise for bfloat16, whose kernels cannot match transformers' bit for bit: on a
    400-token prompt, tokenmill in bfloat16 is on average no further from the float32 model
    than transformers in bfloat16 is.

    NOTE: the mean over 399 positions, not the largest error: the demo checkpoints' peaked
    weights amplify any rounding chaotically (errors near 1 nat for both), so which of two
    equally good bfloat16 implementations has the single worst position is a coin toss."""
    prompt = np.random.default_rng(1).integers(3, 1000, 400).tolist()
    positions, targets = np.arange(len(prompt) - 1), prompt[1:]
    exact = oracle(_hf(model_dir, torch.float32), prompt).of(positions, targets)
    theirs = oracle(_hf(model_dir, torch.bfloat16), prompt).of(positions, targets)
    request = OfflineRequest(prompt, max_tokens=1, prompt_logprob_start=0)
    engine = make_engine(model_dir, dtype="bfloat16", cpu_kernels=cpu_kernels)
    ours = np.array(engine.generate([request])[0].prompt_logprobs)
    our_err, their_err = np.abs(ours - exact), np.abs(theirs - exact)
    summary = f"ours mean {our_err.mean():.4f} max {our_err.max():.3f}, transformers bfloat16 "
    summary += f"mean {their_err.mean():.4f} max {their_err.max():.3f}"
    assert our_err.mean() <= their_err.mean(), summary


def _hf(model_dir, dtype: torch.dtype) -> torch.nn.Module:
    return transformers_model(model_dir, dtype)


def test_an_image_and_text_gemma3_checkpoint_serves_its_text_model(
    tiny_checkpoint, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 3 4B-27B are `Gemma3ForConditionalGeneration`: a vision tower beside a Gemma 3
    text model whose `text_config` the Hub writes sparse. `--model` serves the text model
    (cli/text_checkpoint.py: its config completed by transformers, the checkpoint's files
    linked, the vision tower's tensors never read): prompt logprobs and greedy tokens as
    transformers' whole model computes them on text alone (float32)."""
    from tokenmill.cli.default_model import resolve_model

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    text = tiny_checkpoint("gemma3")
    text_config = json.loads((text / "config.json").read_text())
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text_config, vision_config=vision, mm_tokens_per_image=4,
        eos_token_id=text_config["eos_token_id"],
    )  # fmt: skip
    torch.manual_seed(0)
    whole = transformers.Gemma3ForConditionalGeneration(config).eval()
    text_model = transformers.AutoModelForCausalLM.from_pretrained(text, dtype=torch.float32)
    whole.model.language_model.load_state_dict(text_model.model.state_dict())
    source = tmp_path / "gemma3-image-and-text"
    whole.save_pretrained(source)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(text / name, source / name)
    saved = json.loads((source / "config.json").read_text())
    defaults = transformers.Gemma3TextConfig().to_dict()
    saved["text_config"] = {  # NOTE: as sparse as the Hub's: what differs from the defaults
        k: v for k, v in saved["text_config"].items() if defaults.get(k) != v
    }
    (source / "config.json").write_text(json.dumps(saved))
    served = resolve_model(str(source)).directory
    assert json.loads((served / "config.json").read_text())["architectures"] == [
        "Gemma3ForCausalLM"
    ]
    prompt = FrontendTokenizer(served).encode(TEXTS[2])
    request = OfflineRequest(prompt, max_tokens=16, num_top=5, prompt_logprob_start=0)
    out = make_engine(served).generate([request])[0]
    assert_matches_oracle(out, prompt, whole, ATOL)
