"""The `tokenmill` command: one subcommand per job (runs in the main process).

Each subcommand module adds its own parser and runs with the parsed arguments; heavy
imports (torch) happen inside the subcommand, so `tokenmill --help` stays instant.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from tokenmill.cli import (
    cluster_key_command,
    generate_command,
    make_model_command,
    serve_command,
)
from tokenmill.cli.bench import command as bench_command
from tokenmill.frontend import VERSION

Subcommand = tuple[
    Callable[[argparse._SubParsersAction], None], Callable[[argparse.Namespace], int]
]

SUBCOMMANDS: dict[str, Subcommand] = {
    "serve": (serve_command.add_parser, serve_command.run),
    "generate": (generate_command.add_parser, generate_command.run),
    "make-model": (make_model_command.add_parser, make_model_command.run),
    "bench": (bench_command.add_parser, bench_command.run),
    "cluster-key": (cluster_key_command.add_parser, cluster_key_command.run),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill",
        description="An LLM inference server whose token log-probabilities you can trust.",
    )
    parser.add_argument("--version", action="version", version=f"tokenmill {VERSION}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_parser, _ in SUBCOMMANDS.values():
        add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return SUBCOMMANDS[args.command][1](args)


if __name__ == "__main__":
    sys.exit(main())
