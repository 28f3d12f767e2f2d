"""Every user-facing flag is documented: in `--help` (generated) and in the README."""

from __future__ import annotations

import re
from pathlib import Path

from tokenmill.cli.main import build_parser

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _flags(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    help_text = sub.choices[command].format_help()  # type: ignore[union-attr]
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", help_text)) - {"--help", "--no-"}


def test_every_serve_flag_is_in_the_readme() -> None:
    flags = {f for f in _flags("serve") if not f.startswith("--no-")}
    missing = sorted(f for f in flags if f"`{f}" not in README and f"{f}`" not in README)
    assert len(flags) >= 15 and not missing, f"serve flags missing from README.md: {missing}"


def test_every_flag_has_help() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, command in sub.choices.items():  # type: ignore[union-attr]
        for action in command._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"tokenmill {name} {action.option_strings[0]} has no help"
