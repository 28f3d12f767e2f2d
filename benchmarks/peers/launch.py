"""Shared by the peer harness and the benchmarks that measure a peer: start and stop vLLM CPU,
llama.cpp's `llama-server` and `tokenmill serve` on the same weights, each on a free port and
under one served name, and drive any of them with vLLM's load generator, `vllm bench serve`.

Where the peers are (install_vllm_cpu.sh and install_llama_cpp.sh put them there):
VLLM_PY, the vLLM venv's python (~/.cache/tokenmill-peers/vllm/bin/python); LLAMA_CPP, the
llama.cpp tree (~/.cache/tokenmill-peers/llama.cpp), LLAMA_SERVER its server binary.

Scripts in other folders put the repository's root on sys.path and import this as
benchmarks.peers.launch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from benchmarks.serving.server import cpu_seconds
from tokenmill.cli import server_subprocess
from tokenmill.frontend.engine.cluster_layout import free_port

CACHE = Path(os.environ.get("TOKENMILL_PEERS", Path.home() / ".cache" / "tokenmill-peers"))
VLLM_PY = Path(os.environ.get("VLLM_PY", CACHE / "vllm" / "bin" / "python"))
VLLM_CLI = Path(__file__).resolve().with_name("vllm_cli.py")
LLAMA_CPP = Path(os.environ.get("LLAMA_CPP", CACHE / "llama.cpp"))
LLAMA_SERVER = Path(os.environ.get("LLAMA_SERVER", LLAMA_CPP / "build" / "bin" / "llama-server"))
SERVED_NAME = "m"
MAX_MODEL_LEN = 2048
# NOTE: vLLM CPU reserves its KV cache up front (VLLM_CPU_KVCACHE_SPACE, GiB): 4 GiB holds
# the standing workloads' 64 requests of a small model many times over and leaves room for
# the other servers on a 24 GiB machine.
VLLM_KV_GIB = 4
QUIET_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


@dataclass
class Server:
    """One running server: its process group's leader, base URL and log."""

    name: str
    proc: subprocess.Popen
    url: str
    log: Path


def cores() -> str:
    """This process's CPUs as a range list ("0-1"), vLLM's VLLM_CPU_OMP_THREADS_BIND."""
    ids = sorted(os.sched_getaffinity(0))
    spans: list[list[int]] = []
    for i in ids:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


def float_checkpoint(directory: Path) -> Path:
    """`directory` as a checkpoint every peer loads: a converted GGUF file's blocks (which
    only tokenmill reads) dequantized once, to the `gguf` package's float32 values, into
    CACHE/float/<its name>; any other directory as it is."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tokenmill.tp_worker.cpu.quantized import QuantRows, dequantize
    from tokenmill.tp_worker.model.weights import checkpoint_files, gguf_block_types

    blocks = gguf_block_types(directory)
    out = CACHE / "float" / directory.name
    if not blocks or (out / "config.json").exists():
        return out if blocks else directory
    partial = out.with_name(out.name + ".part")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(directory, partial, ignore=shutil.ignore_patterns("*.safetensors", "gguf_*"))
    for shard in checkpoint_files(directory):
        tensors = load_file(str(shard))
        for name in set(tensors) & set(blocks):
            tensors[name] = dequantize(QuantRows.of(blocks[name], tensors[name]))
        save_file(tensors, str(partial / shard.name), metadata={"format": "pt"})
    partial.rename(out)
    return out


def require(path: Path, how: str) -> None:
    if not path.exists():
        raise SystemExit(f"{path} is missing: {how}")


def wait_health(server: Server, timeout: float) -> float:
    """Seconds until `server`'s /health answers 200; raises if it exits or never does."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited ({server.proc.returncode}); see {server.log}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass  # NOTE: not listening yet, or 503 while the model loads (llama.cpp)
        time.sleep(0.5)
    raise RuntimeError(f"{server.name}: no /health after {timeout:.0f} s; see {server.log}")


def start(name: str, command: list[str], env: dict[str, str], port: int, log: Path) -> Server:
    """`command` in a new session (so that stop() ends its children too), output to `log`."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **QUIET_ENV, **env},
            start_new_session=True,
        )
    return Server(name, proc, f"http://127.0.0.1:{port}", log)


def stop(server: Server) -> None:
    """SIGTERM to the server's process group, SIGKILL if it has not exited within a minute."""
    try:
        os.killpg(server.proc.pid, signal.SIGTERM)
        server.proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
    except ProcessLookupError:
        pass


def start_vllm(
    model: Path, dtype: str, log: Path, extra: list[str] | None = None, timeout: float = 900.0
) -> Server:
    """`vllm serve MODEL` (vLLM CPU, its OpenMP threads bound to this process's CPUs), once
    /health answers; a converted GGUF file's blocks as their floats (float_checkpoint)."""
    require(VLLM_PY, "run benchmarks/peers/install_vllm_cpu.sh (or set VLLM_PY)")
    model = float_checkpoint(model)
    port = free_port()
    command = [str(VLLM_PY), str(VLLM_CLI), "serve", str(model), "--dtype", dtype]
    command += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME]
    command += ["--max-model-len", str(MAX_MODEL_LEN), *(extra or [])]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_GIB), "VLLM_CPU_OMP_THREADS_BIND": cores()}
    server = start("vllm", command, env, port, log)
    wait_health(server, timeout)
    return server


def start_llamacpp(
    gguf: Path, slots: int, context: int, log: Path, extra: list[str] | None = None
) -> Server:
    """`llama-server -m GGUF` with `slots` parallel slots sharing `context` tokens and a
    thread per CPU, once /health answers."""
    require(LLAMA_SERVER, "run benchmarks/peers/install_llama_cpp.sh (or set LLAMA_SERVER)")
    port = free_port()
    command = [str(LLAMA_SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    command += ["-t", str(len(os.sched_getaffinity(0))), "-c", str(context), "-np", str(slots)]
    command += ["--alias", SERVED_NAME, *(extra or [])]
    server = start("llamacpp", command, {}, port, log)
    wait_health(server, 900.0)
    return server


def start_tokenmill(model: Path, dtype: str, log: Path, extra: list[str] | None = None) -> Server:
    """`tokenmill serve --model MODEL` (this python's tokenmill, as its tests start it: in a
    session of its own, on a free port), once /health answers."""
    flags = ["--dtype", dtype, "--served-model-name", SERVED_NAME]
    flags += ["--max-model-len", str(MAX_MODEL_LEN), *(extra or [])]
    proc, url = server_subprocess.launch(model, flags, log, env=QUIET_ENV, timeout=900.0)
    return Server("tokenmill", proc, url, log)


@dataclass(frozen=True)
class Workload:
    """`vllm bench serve`'s random dataset: `prompts` prompts of `input_len` random tokens,
    `output_len` tokens each (ignore_eos, greedy), `concurrency` in flight (0: all)."""

    input_len: int
    output_len: int
    prompts: int
    concurrency: int = 0


def bench_serve(
    server: Server, tokenizer: Path, load: Workload, seed: int, logprobs: int, out: Path
) -> dict:
    """One `vllm bench serve` run against `server`; its saved result (output_throughput,
    median_ttft_ms, median_tpot_ms, completed, failed, ...)."""
    require(VLLM_PY, "run benchmarks/peers/install_vllm_cpu.sh (or set VLLM_PY)")
    name = f"{server.name}-{seed}-lp{logprobs}.json"
    command = [str(VLLM_PY), str(VLLM_CLI), "bench", "serve", "--backend", "openai"]
    command += ["--base-url", server.url, "--endpoint", "/v1/completions"]
    command += ["--model", SERVED_NAME, "--tokenizer", str(tokenizer), "--dataset-name", "random"]
    command += ["--random-input-len", str(load.input_len)]
    command += ["--random-output-len", str(load.output_len), "--num-prompts", str(load.prompts)]
    command += ["--ignore-eos", "--temperature", "0", "--seed", str(seed), "--disable-tqdm"]
    command += ["--save-result", "--result-dir", str(out), "--result-filename", name]
    if load.concurrency:
        command += ["--max-concurrency", str(load.concurrency)]
    if logprobs:
        command += ["--logprobs", str(logprobs)]
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, **QUIET_ENV}, timeout=3600
    )
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed against {server.name}:\n{done.stderr[-3000:]}")
    return dict(json.loads((out / name).read_text()))


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of `root` and every process under it (Linux /proc)."""
    by_role = cpu_seconds(root)
    return sum(seconds for role, seconds in by_role.items() if role != "client")
