"""Quantized GGUF files served as they are: tokenmill (its kernels on the file's blocks) and
llama.cpp's `llama-server` on the same file, side by side under vLLM's client
(benchmarks/peers/side_by_side.py), with what a decode step cannot beat.

For each file (benchmarks/serving/quantized_files.py makes them): at one user the median TPOT
of each server, next to the file's floor (its bytes over this machine's measured read
bandwidth: a decode step reads every weight once); at --users more, each one's out tok/s;
then tokenmill's resident memory (every process of the server, summed) with a KV cache of
16,384 tokens, against the file's size + that cache + 1.5 GiB. Random prompts of 256 tokens,
64 out, greedy, no logprobs; medians over --rounds.

    python benchmarks/serving/quantized.py [--files 1b-q4km,1b-q8,8b-q4km] [--users 16]
        [--rounds 1] [--dense]

--dense adds tokenmill with the blocks dequantized to bfloat16 at load
(TOKENMILL_CPU_GGUF_BLOCKS=0: what every start did before), the baseline. Run it on a quiet
machine; llama.cpp's build is named in the header (install_llama_cpp.sh builds it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.*
sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantized_files import llama_1b, llama_8b_q4_k_m  # noqa: E402

from benchmarks.peers import launch  # noqa: E402

FILES = {
    "1b-q4km": lambda: llama_1b("Q4_K_M"),
    "1b-q8": lambda: llama_1b("Q8_0"),
    "8b-q4km": llama_8b_q4_k_m,
}
SIDE_BY_SIDE = Path(__file__).resolve().parents[1] / "peers" / "side_by_side.py"
KV_TOKENS = 16384
SLACK_GIB = 1.5


def read_bandwidth(rounds: int = 5) -> float:
    """GB/s a sum over 2 GiB of float32 reads on torch's threads, the best of `rounds`."""
    data = torch.ones(1 << 29)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best / 1e9


def side_by_side(
    file: Path, users: int, prompts: int, rounds: int, servers: str, env: dict
) -> dict:
    """side_by_side.py's runs (server / variant -> list of figures), no logprobs."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs.json"
        command = [sys.executable, str(SIDE_BY_SIDE), "--model", str(file), "--gguf", str(file)]
        command += ["--only", servers, "--input-len", "256", "--output-len", "64"]
        command += ["--concurrency", str(users), "--prompts", str(prompts)]
        command += ["--rounds", str(rounds), "--json", str(out)]
        subprocess.run(command, check=True, env={**os.environ, **env}, stdout=sys.stderr)
        return json.loads(out.read_text())["runs"]


def median(runs: list[dict], key: str) -> float:
    values = sorted(r[key] for r in runs)
    return values[len(values) // 2]


def resident_gib(file: Path, env: dict) -> float:
    """tokenmill serving `file` with a KV cache of KV_TOKENS, after one request: the resident
    memory of all its processes, summed (GiB)."""
    from tokenmill.cli.default_model import resolve_model

    directory = resolve_model(str(file)).directory
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(env)
        server = launch.start_tokenmill(
            directory, "bfloat16", Path(tmp) / "server.log", ["--kv-cache-tokens", str(KV_TOKENS)]
        )
        try:
            body = {"model": launch.SERVED_NAME, "prompt": "The module", "max_tokens": 8}
            request = urllib.request.Request(
                server.url + "/v1/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            urllib.request.urlopen(request, timeout=600).read()
            return _session_rss(server.proc.pid) / 2**30
        finally:
            launch.stop(server)
            for key in env:
                os.environ.pop(key, None)


def _session_rss(session: int) -> int:
    """Bytes resident in every process of session `session` (the server's own)."""
    total = 0
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = status.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) != session:  # NOTE: the session id, after state, ppid, pgrp
                continue
            rss = (status.parent / "status").read_text().split("VmRSS:")[1].split()[0]
            total += int(rss) * 1024
        except (OSError, IndexError, ValueError):
            continue
    return total


def kv_gib(file: Path) -> float:
    from tokenmill.cli.default_model import resolve_model

    config = json.loads((resolve_model(str(file)).directory / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2
    return per_token * KV_TOKENS / 2**30


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", default=",".join(FILES), help="comma list of " + ",".join(FILES))
    p.add_argument("--users", type=int, default=16, help="concurrent users of the batch run")
    p.add_argument("--rounds", type=int, default=1, help="rounds of each run (1)")
    p.add_argument("--dense", action="store_true", help="also tokenmill dequantized to bf16")
    args = p.parse_args()
    bandwidth = read_bandwidth()
    tm = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    build = launch.LLAMA_CPP / "build-info.txt"
    print(
        f"tokenmill {tm.stdout.strip()}; llama.cpp: install_llama_cpp.sh's build "
        f"({build.read_text().strip() if build.exists() else 'native, GGML_NATIVE=ON'}), "
        f"llama-server -t all cores, one slot per user; read bandwidth {bandwidth:.1f} GB/s"
    )
    print(
        "\n| file | MiB | floor ms | server | TPOT ms, 1 user | TTFT ms, 1 user "
        f"| out tok/s, {args.users} users | resident GiB (limit) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.files.split(","):
        file = FILES[name]()
        size = file.stat().st_size
        floor = size / bandwidth / 1e6
        variants = {
            "tokenmill": {},
            **({"tokenmill dense": {"TOKENMILL_CPU_GGUF_BLOCKS": "0"}} if args.dense else {}),
        }
        one = side_by_side(file, 1, 6, args.rounds, "llamacpp,tokenmill", {})
        many = side_by_side(file, args.users, 2 * args.users, args.rounds, "llamacpp,tokenmill", {})
        rows = {"llamacpp": ("llamacpp", one, many, None)}
        for label, env in variants.items():
            if env:
                one_d = side_by_side(file, 1, 6, args.rounds, "tokenmill", env)
                many_d = side_by_side(
                    file, args.users, 2 * args.users, args.rounds, "tokenmill", env
                )
            else:
                one_d, many_d = one, many
            limit = size / 2**30 + kv_gib(file) + SLACK_GIB
            rows[label] = ("tokenmill", one_d, many_d, (resident_gib(file, env), limit))
        for label, (server, one_r, many_r, memory) in rows.items():
            runs_1, runs_n = one_r[f"{server} / no logprobs"], many_r[f"{server} / no logprobs"]
            resident = "" if memory is None else f"{memory[0]:.2f} ({memory[1]:.2f})"
            print(
                f"| {file.name} | {size / 2**20:.0f} | {floor:.1f} | {label} "
                f"| {median(runs_1, 'tpot_ms'):.1f} | {median(runs_1, 'ttft_ms'):.0f} "
                f"| {median(runs_n, 'out_tok_s'):.1f} | {resident} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
