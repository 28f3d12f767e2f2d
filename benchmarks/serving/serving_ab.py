"""Two server setups side by side, their runs alternated: 1, 4 and 64 users.

Starts `tokenmill serve` twice on the same checkpoint, A (as is, or --a) and B (--b), and
drives both with tokenmill's own load generator (random token-id prompts, ignore_eos,
streamed through /v1/completions): one user (8 requests one after another, 256 in / 64
out), 4 users (16 requests, 256 / 64) and the side-by-side workloads with 64 users at once
(64 x 256 / 64 and 64 x 64 / 256). Each round runs every load on both servers in turn, the
order flipped from round to round, and B/A is taken round by round (pairing keeps a ratio
meaningful while a shared host's speed drifts); the medians of those ratios are printed.
This is how a flag's default is decided: `--overlap-schedule`, `--decode-steps 4`, an
environment variable.

    python benchmarks/serving/serving_ab.py --b="--overlap-schedule" [--a=FLAGS] [--rounds 3]
        [--model DIR_OR_GGUF | --preset medium] [--dtype bfloat16] [--logprobs 0]
        [--loads 1,4,64]

FLAGS: `tokenmill serve` flags, after leading NAME=VALUE words for the server's environment
("TOKENMILL_CPU_AMX=0 --decode-steps 4"). No --model and no --preset: SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from server import median_tpot_ttft_ms, start_variant, stop_server, stream_random

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.*
from benchmarks.checkpoints import demo_model  # noqa: E402
from tokenmill.cli.default_model import resolve_model  # noqa: E402


@dataclass(frozen=True)
class Load:
    name: str
    users: int
    requests: int
    input_len: int
    output_len: int


# NOTE: keyed by the --loads names; 64 users runs both side-by-side workloads.
LOADS = {
    "1": [Load("1 user, 256 in / 64 out", 1, 8, 256, 64)],
    "4": [Load("4 users, 256 in / 64 out", 4, 16, 256, 64)],
    "64": [
        Load("64 users, 256 in / 64 out", 64, 64, 256, 64),
        Load("64 users, 64 in / 256 out", 64, 64, 64, 256),
    ],
}


@dataclass
class Figures:
    rate: list[float] = field(default_factory=list)  # out tok/s
    tpot_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--b", required=True, help="server B's flags (see the top)")
    p.add_argument("--a", default="", help="server A's flags (default: none, as is)")
    p.add_argument("--model", help="checkpoint dir or GGUF file (default: SmolLM2)")
    p.add_argument("--preset", choices=("small", "medium"), help="a demo checkpoint instead")
    p.add_argument("--dtype", default="bfloat16", help="both servers' --dtype (bfloat16)")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds (3)")
    p.add_argument("--logprobs", type=int, default=0, help="top logprobs asked (0: none)")
    p.add_argument("--loads", default="1,4,64", help="users: any of 1, 4, 64 (1,4,64)")
    args = p.parse_args()
    unknown = set(args.loads.split(",")) - set(LOADS)
    if unknown:
        p.error(f"--loads: {', '.join(sorted(unknown))} not among {', '.join(LOADS)}")
    return args


def start(
    name: str, model: Path, args: argparse.Namespace, flags: str
) -> tuple[subprocess.Popen, str]:
    log = Path(tempfile.mkdtemp(prefix="tokenmill-serving-ab-")) / "server.log"
    print(f"{name}: {flags or '(as is)'} (log: {log})", flush=True)
    return start_variant(model, flags, ["--dtype", args.dtype], log)


async def run_load(
    base_url: str, load: Load, logprobs: int, seed: int
) -> tuple[float, float, float]:
    """(out tok/s, median TPOT ms, median TTFT ms) of one run of `load`."""
    results, wall = await stream_random(
        base_url, load.requests, load.input_len, load.output_len, load.users, seed, logprobs
    )
    rate = sum(r.output_len for r in results) / wall
    return rate, *median_tpot_ttft_ms(results)


def main() -> int:
    args = parse_args()
    model = demo_model(args.preset) if args.preset else resolve_model(args.model).directory
    loads = [load for key in args.loads.split(",") for load in LOADS[key]]
    setups = {"A": args.a, "B": args.b}
    figures = {(s, load.name): Figures() for s in setups for load in loads}
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for name, flags in setups.items():
            servers[name] = start(name, model, args, flags)
            asyncio.run(run_load(servers[name][1], LOADS["4"][0], args.logprobs, seed=1))
        for r in range(args.rounds):
            order = list(setups) if r % 2 == 0 else list(setups)[::-1]
            for load in loads:
                for name in order:
                    rate, tpot, ttft = asyncio.run(
                        run_load(servers[name][1], load, args.logprobs, seed=2 + r)
                    )
                    f = figures[(name, load.name)]
                    f.rate.append(rate)
                    f.tpot_ms.append(tpot)
                    f.ttft_ms.append(ttft)
                    print(
                        f"round {r + 1}, {load.name}, {name}: {rate:.1f} out tok/s, median "
                        f"TPOT {tpot:.2f} ms, TTFT {ttft:.0f} ms",
                        flush=True,
                    )
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    print(f"medians over {args.rounds} rounds (B/A: the median of the rounds' ratios):")
    for load in loads:
        a, b = figures[("A", load.name)], figures[("B", load.name)]
        ratio = statistics.median(y / x for x, y in zip(a.rate, b.rate, strict=True))
        tpot_ratio = statistics.median(y / x for x, y in zip(a.tpot_ms, b.tpot_ms, strict=True))
        print(
            f"  {load.name}: A {statistics.median(a.rate):.1f}, B {statistics.median(b.rate):.1f}"
            f" out tok/s (B/A {ratio:.3f}); median TPOT A {statistics.median(a.tpot_ms):.2f}, "
            f"B {statistics.median(b.tpot_ms):.2f} ms (B/A {tpot_ratio:.3f}); TTFT A "
            f"{statistics.median(a.ttft_ms):.0f}, B {statistics.median(b.ttft_ms):.0f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
