"""An RL loop against a running tokenmill (CPU): rollouts from the server, a GRPO-style update
in a trainer holding the same Hugging Face weights in plain torch (transformers), the new
weights broadcast to the server over gloo, and the next rollout checked against the trainer.

For each model (the medium demo checkpoint and SmolLM2-135M-Instruct, float32):
1. generation throughput (64 sampled tokens for 16 prompts at once) before any update;
2. `--steps` steps: 4 completions of each of 4 prompts (n=4, temperature 1, seeded), with
   `return_token_ids` and the processed logprobs (the behaviour policy's); a reward (how
   many of a completion's tokens are among the 100 lowest ids: anything the policy can move
   towards); group-normalised advantages; one clipped-ratio policy-gradient step (Adam)
   against those logprobs; the new weights broadcast (`cli/weight_sync.py`), timed;
3. every behaviour logprob of a step's rollouts against the trainer's before its step
   (temperature 1, no filter: the same distribution), and the server's greedy rollout after
   the last update: its raw logprobs against the trainer's float32 forward pass over the
   same tokens (max |difference|; target 1e-5) and against the same weights in float64;
4. the same throughput again.

    python benchmarks/serving/rl_loop.py [--steps 3] [--models medium,smollm2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from server import cpu_name, start_server, stop_server

from tokenmill.cli.weight_sync import WeightSync, post

GROUP = 4  # completions per prompt
PROMPTS = [
    "Write a short poem about the sea.",
    "List three colours.",
    "What is two plus two?",
    "Describe a cat in one sentence.",
]


def model_dir(name: str) -> Path:
    if name == "medium":
        from tokenmill.cli.demo_checkpoint import demo_checkpoint

        return demo_checkpoint("llama", "medium")
    if name == "smollm2":
        from tokenmill.cli.default_model import resolve_model

        return resolve_model(None).directory
    return Path(name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def throughput(base_url: str) -> float:
    """Output tok/s of 16 prompts x 64 sampled tokens sent at once."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    prompts = [[100 + 7 * i + j for j in range(32)] for i in range(16)]
    started = time.perf_counter()
    outs = await asyncio.gather(
        *(
            client.completions.create(model="m", prompt=p, max_tokens=64, temperature=1.0,
                                      seed=i, extra_body={"ignore_eos": True})
            for i, p in enumerate(prompts)
        )
    )  # fmt: skip
    seconds = time.perf_counter() - started
    await client.close()
    return sum(o.usage.completion_tokens for o in outs) / seconds


def rollouts(base_url: str, tokenizer: Any, step: int) -> list[dict[str, Any]]:
    """GROUP completions of each prompt: prompt ids, output ids, behaviour logprobs."""
    samples = []
    for p, text in enumerate(PROMPTS):
        ids = tokenizer.encode(text)
        body = {
            "model": "m", "prompt": ids, "max_tokens": 24, "n": GROUP, "temperature": 1.0,
            "seed": 1000 * step + 10 * p, "logprobs": 0, "return_token_ids": True,
            "logprobs_mode": "processed",
        }  # fmt: skip
        answer = post(base_url, "/v1/completions", body)
        for choice in answer["choices"]:
            samples.append(
                {
                    "prompt": choice["prompt_token_ids"],
                    "output": choice["token_ids"],
                    "logprobs": choice["logprobs"]["token_logprobs"],
                    "group": p,
                }
            )
    return samples


def reward(sample: dict[str, Any]) -> float:
    return sum(1.0 for t in sample["output"] if t < 100) / max(1, len(sample["output"]))


def token_logprobs(model: Any, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The trainer's logprobs [n] of `output` after `prompt` (float32, temperature 1)."""
    ids = torch.tensor([prompt + output])
    logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(output)[:, None])[:, 0]


def grpo_step(model: Any, optimizer: Any, samples: list[dict[str, Any]]) -> float:
    """One clipped-ratio policy-gradient step; returns the largest |server - trainer|
    behaviour logprob over the batch (before the step)."""
    rewards = torch.tensor([reward(s) for s in samples])
    groups = torch.tensor([s["group"] for s in samples])
    advantages = torch.zeros_like(rewards)
    for g in groups.unique():
        members = groups == g
        r = rewards[members]
        advantages[members] = (r - r.mean()) / (r.std() + 1e-6)
    optimizer.zero_grad()
    worst = 0.0
    for sample, advantage in zip(samples, advantages, strict=True):
        new = token_logprobs(model, sample["prompt"], sample["output"])
        old = torch.tensor(sample["logprobs"], dtype=torch.float32)
        worst = max(worst, float((new.detach() - old).abs().max()))
        ratio = torch.exp(new - old)
        clipped = torch.clamp(ratio, 0.8, 1.2)
        loss = -torch.min(ratio * advantage, clipped * advantage).mean() / len(samples)
        loss.backward()
    optimizer.step()
    return worst


def greedy_check(base_url: str, model: Any, tokenizer: Any) -> tuple[float, float, float]:
    """Over a greedy rollout of 24 tokens, max |difference| of the server's raw logprobs from
    the trainer's float32 forward pass and from the same weights in float64 (the exact
    numbers), and the trainer's float32 from float64."""
    import copy

    ids = tokenizer.encode(PROMPTS[0])
    body = {"model": "m", "prompt": ids, "max_tokens": 24, "temperature": 0, "logprobs": 0,
            "return_token_ids": True}  # fmt: skip
    choice = post(base_url, "/v1/completions", body)["choices"][0]
    exact_model = copy.deepcopy(model).double()
    with torch.no_grad():
        trainer = token_logprobs(model, ids, choice["token_ids"]).double()
        exact = token_logprobs(exact_model, ids, choice["token_ids"])
    server = torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64)
    return (
        float((server - trainer).abs().max()),
        float((server - exact).abs().max()),
        float((trainer - exact).abs().max()),
    )


def run_model(name: str, args: argparse.Namespace, logs: Path) -> None:
    from transformers import AutoTokenizer

    from tokenmill.cli.gguf_checkpoint import transformers_model

    path = model_dir(name)
    model = transformers_model(Path(path), torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    server_args = ["--served-model-name", "m", "--dtype", "float32", "--enable-rl-control",
                   "--max-model-len", "1024"]  # fmt: skip
    proc, url = start_server(path, server_args, logs / f"{name}.log")
    try:
        before = asyncio.run(throughput(url))
        sync = WeightSync.connect(url, master_port=free_port(), num_ranks=1)
        times, worst = [], 0.0
        for step in range(1, args.steps + 1):
            samples = rollouts(url, tokenizer, step)
            model.train()
            worst = grpo_step(model, optimizer, samples)
            model.eval()
            weights = {n: p.detach() for n, p in model.named_parameters()}
            started = time.perf_counter()
            sync.update(weights, weight_version=f"step-{step}")
            times.append(time.perf_counter() - started)
            mean_reward = sum(reward(s) for s in samples) / len(samples)
            print(f"{name} step {step}: mean reward {mean_reward:.3f}, behaviour logprobs "
                  f"against the trainer's max |diff| {worst:.2e}, weights broadcast in "
                  f"{times[-1]:.2f} s", flush=True)  # fmt: skip
        after_update = greedy_check(url, model, tokenizer)
        sync.close()
        after = asyncio.run(throughput(url))
    finally:
        stop_server(proc)
    params = sum(p.numel() for p in model.parameters())
    to_trainer, to_exact, trainer_to_exact = after_update
    print(
        f"{name}: {params / 1e6:.0f} M parameters; update (broadcast and load) "
        f"{sum(times) / len(times):.2f} s a step (median of {len(times)}: "
        f"{sorted(times)[len(times) // 2]:.2f} s); greedy rollout after the last update, max "
        f"|logprob diff|: server - trainer float32 {to_trainer:.2e} (target 1e-5), server - "
        f"float64 {to_exact:.2e}, trainer float32 - float64 {trainer_to_exact:.2e}; out tok/s "
        f"before {before:.1f}, after {after:.1f} ({after / before:.2f})",
        flush=True,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--models", default="medium,smollm2", help="comma list, or directories")
    args = p.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            run_model(name, args, Path(tmp))
    print(f"\n{os.cpu_count()} CPUs: {cpu_name()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
