"""`tokenmill cluster-key FILE`: a new key file for a multi-node server (see --nnodes)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cluster-key",
        help="write a new key file for a multi-node server (--cluster-key-file)",
        description="Writes FILE (mode 0600, never overwritten) with fresh ZeroMQ CURVE keys. "
        "Copy it to every node and pass it to `tokenmill serve --cluster-key-file FILE`: the "
        "sockets between nodes refuse any peer that does not hold it.",
    )
    p.add_argument("file", help="where to write the key file (must not exist)")


def run(args: argparse.Namespace) -> int:
    from tokenmill.protocol.cluster import ClusterKey

    try:
        ClusterKey.generate().write(args.file)
    except FileExistsError:
        raise SystemExit(f"{args.file} exists: tokenmill never overwrites a key file") from None
    except OSError as e:
        raise SystemExit(f"{args.file}: {e.strerror}") from None
    print(f"wrote {args.file}: copy it to every node (it is the cluster's password)")
    return 0
