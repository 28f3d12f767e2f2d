"""The house rules a change must keep (CONTRIBUTING.md): the repository holds everything it
needs, each process's folder imports no other process's logic, and no folder grows past
what one can walk."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROCESS_FOLDERS = ("controller", "detokenizer", "frontend", "tp_worker")
MAX_MODULES = 25


def _tracked() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    return [REPO / line for line in out.splitlines() if (REPO / line).is_file()]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_nothing_refers_to_files_outside_the_repository() -> None:
    outside = "../" + "shared"  # NOTE: split, so that this file does not name it itself
    offenders = []
    for path in _tracked():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if outside in text:
            offenders.append(str(path.relative_to(REPO)))
    assert not offenders, f"these refer to {outside}: {offenders}"


def test_a_process_imports_no_other_process() -> None:
    """The worker imports nothing of the controller, and so on; protocol/ is what they share,
    offline/ (the in-process engine) stands above them all."""
    offenders = []
    for folder in PROCESS_FOLDERS:
        others = [f"tokenmill.{o}" for o in PROCESS_FOLDERS + ("offline",) if o != folder]
        if folder == "frontend":  # NOTE: it starts the others with their configs, and checks
            # a grammar with the controller's engine before a request is accepted
            others = ["tokenmill.offline"]
        for path in (REPO / folder).rglob("*.py"):
            bad = sorted(name for name in _imports(path) if any(name.startswith(o) for o in others))
            if bad:
                offenders.append(f"{path.relative_to(REPO)}: {bad}")
    assert not offenders, offenders


def test_no_package_folder_holds_more_than_25_modules() -> None:
    counts: dict[Path, int] = {}
    for path in _tracked():
        if path.suffix == ".py" and "tests" not in path.relative_to(REPO).parts:
            counts[path.parent] = counts.get(path.parent, 0) + 1
    crowded = {str(p.relative_to(REPO)): n for p, n in counts.items() if n > MAX_MODULES}
    assert not crowded, crowded
