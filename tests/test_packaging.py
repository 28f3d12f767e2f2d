"""The package installs (not only in editable mode) into one `tokenmill.*` namespace, and its
console script works from outside the repository."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUBPACKAGES = [
    "cli",
    "cli.bench",
    "cli.make_model",
    "controller",
    "detokenizer",
    "frontend",
    "frontend.api",
    "frontend.app",
    "frontend.engine",
    "offline",
    "protocol",
    "tp_worker",
    "tp_worker.cpu",
    "tp_worker.cuda",
    "tp_worker.model",
    "tp_worker.sample",
]


def test_plain_install_imports_from_outside_the_repo(tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(REPO),
        ],
        check=True,
        cwd=tmp_path,
        capture_output=True,
    )
    assert not (target / "protocol").exists(), "nothing generic may land in site-packages"
    code = "; ".join(
        [f"import tokenmill.{p}" for p in SUBPACKAGES]
        + [
            "import tokenmill.tp_worker.cpu.kernels as k",
            "assert all(s.exists() for s in k.SOURCES + k.HEADERS), k.SOURCES",
            "import tokenmill.cli.main as c",
            "print(c.__file__)",
        ]
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    ).stdout
    assert out.strip().startswith(str(target))
    help_text = subprocess.run(
        [str(target / "bin" / "tokenmill"), "serve", "--help"],
        check=True,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    ).stdout
    for flag in ("--model", "--kv-cache-tokens", "--max-logprobs", "--served-model-name"):
        assert flag in help_text


def test_make_model_and_generate_commands(tmp_path: Path) -> None:
    model = tmp_path / "m"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.cli.main",
            "make-model",
            str(model),
            "--arch",
            "qwen2",
            "--preset",
            "tiny",
        ],
        check=True,
        capture_output=True,
    )
    assert (model / "config.json").exists() and (model / "tokenizer.json").exists()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.cli.main",
            "generate",
            "--model",
            str(model),
            "--max-tokens",
            "4",
            "--json",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    import json

    result = json.loads(out)
    assert len(result["tokens"]) >= 1
    assert all(t["logprob"] <= 0 and len(t["top"]) == 3 for t in result["tokens"])
