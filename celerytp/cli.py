"""Command line: `celerytp worker` runs a rank; the other commands drive a group as its leader."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator

from celerytp.app import DEFAULT_GROUP


def _worker(args: argparse.Namespace) -> int:
    from celerytp.worker.config import RankConfig
    from celerytp.worker.main import run_worker

    try:
        config = RankConfig(
            rank=args.rank, world_size=args.world_size, group=args.group, broker_url=args.broker,
            device=args.device, threads=args.threads, model_roots=tuple(args.model_root),
        )
    except ValueError as exc:
        print(f"celerytp worker: {exc}", file=sys.stderr)
        return 2
    return run_worker(config, args.loglevel)


@contextlib.contextmanager
def leader_for(args: argparse.Namespace) -> Iterator:
    """The leader of the group named by --broker, or of a fresh LocalCluster without it."""
    from celerytp.cluster import LocalCluster
    from celerytp.leader import Leader

    if args.broker:
        yield Leader(args.broker, args.group, args.tp)
        return
    print(f"starting a local cluster of {args.tp} rank(s)...", file=sys.stderr)
    with LocalCluster(world_size=args.tp) as cluster:
        yield cluster.leader


def _check(args: argparse.Namespace) -> int:
    with leader_for(args) as leader:
        if args.broker:
            leader.init()
        report = {
            "ping": [r.model_dump() for r in leader.ping()],
            "sanity": [r.model_dump() for r in leader.sanity_check()],
        }
    print(json.dumps(report, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="celerytp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    worker = sub.add_parser("worker", help="run one rank worker (consumes only its rank queue)")
    worker.add_argument("--rank", type=int, required=True)
    worker.add_argument("--world-size", type=int, required=True)
    worker.add_argument("--group", default=DEFAULT_GROUP)
    worker.add_argument("--broker", default="redis://127.0.0.1:6379/0", help="Redis URL")
    worker.add_argument("--device", default="auto", help="auto, cpu or cuda:K")
    worker.add_argument("--threads", type=int, default=0, help="torch threads (0: cores / world size)")
    worker.add_argument("--model-root", action="append", default=[], help="directory models may be loaded from")
    worker.add_argument("--loglevel", default="INFO")
    worker.set_defaults(func=_worker)

    check = sub.add_parser("check", help="ping every rank and run the all-reduce sanity check")
    add_leader_args(check)
    check.set_defaults(func=_check)
    return parser


def add_leader_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (world size)")
    parser.add_argument("--group", default=DEFAULT_GROUP)
    parser.add_argument("--broker", default=None, help="Redis URL of running workers; omitted: a LocalCluster")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
