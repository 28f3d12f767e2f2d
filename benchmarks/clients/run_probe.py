"""Runs probe.py in every library's venv (setup_venvs.sh) against a running server and
prints the table: each case's result, and the totals.

    python benchmarks/clients/run_probe.py --venvs /work/probe-venvs \\
        --base-url http://127.0.0.1:8123/v1 --model SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# venv -> the probe's --lib
VENVS = {
    "openai-3.63": "openai",
    "openai-3.3": "openai",
    "instructor": "instructor",
    "langchain-openai": "langchain-openai",
    "pydantic-ai": "pydantic-ai",
    "openai-agents": "openai-agents",
    "litellm": "litellm",
    "inspect-ai": "inspect-ai",
}
PROBE = Path(__file__).resolve().parent / "probe.py"


def run(venv: Path, lib: str, base_url: str, model: str, timeout: float) -> list[dict]:
    command = [str(venv / "bin" / "python"), str(PROBE), "--lib", lib]
    command += ["--base-url", base_url, "--model", model]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{"lib": venv.name, "version": "?", "case": "*", "result": "fail",
                 "error": f"timed out after {timeout:.0f} s"}]  # fmt: skip
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if not rows:
        error = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        rows = [{"lib": venv.name, "version": "?", "case": "*", "result": "fail", "error": error}]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venvs", type=Path, default=Path("/work/probe-venvs"))
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per library")
    args = parser.parse_args()
    rows = []
    for name, lib in VENVS.items():
        venv = args.venvs / name
        if not (venv / "bin" / "python").exists():
            print(f"{name}: no venv at {venv}", file=sys.stderr)
            continue
        for row in run(venv, lib, args.base_url, args.model, args.timeout):
            rows.append({**row, "lib": name})
            print(json.dumps(row), file=sys.stderr, flush=True)
    print("| library | version | case | result | error |")
    print("|---|---|---|---|---|")
    for r in rows:
        error = r["error"].replace("|", "\\|").replace("\n", " ")
        print(f"| {r['lib']} | {r['version']} | {r['case']} | {r['result']} | {error} |")
    counts = {k: sum(r["result"] == k for r in rows) for k in ("pass", "model", "fail")}
    print(
        f"\n{counts['pass']} of {len(rows)} pass; {counts['model']} read but rejected the "
        f"model's content; {counts['fail']} fail"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
