"""Load test of an unchanged `celerytp serve` with guidellm (the vLLM project's load tool).

Run: .venv/bin/python benchmarks/load_guidellm.py [--rates 0.5 1] [--seconds 60] [--drain 60] [--tp 2]
         [--prompt-tokens 128] [--output-tokens 64] [--results DIR]

Benchmarks only, never CI. guidellm brings its own torch and transformers, so it lives in a venv of
its own, .venv-guidellm (created on the first run: the CPU torch first, as scripts/setup.sh does,
then guidellm), and none of its dependencies reach .venv. Nothing is fetched from a model hub
(HF_HUB_OFFLINE=1): the served model's tokenizer is saved to a directory and given to guidellm,
which counts prompt tokens with it to build its synthetic prompts.

The server is `celerytp serve --tp TP` on the default model (SmolLM2-135M-Instruct) at a free
port. guidellm sends streamed chat completions at a constant rate for each of `--rates` (req/s),
rate x `--seconds` of them, and waits for them to finish (at most `--drain` seconds more: any
still running then are counted as cut), with synthetic prompts of `--prompt-tokens` tokens and
`--output-tokens` output tokens (it asks for ignore_eos, which the server honours). The figures printed are
guidellm's own, read from its JSON report: TTFT median/p99, output tokens/s, request latency.
guidellm runs unchanged: its requests carry vLLM's `stream_options.continuous_usage_stats`, which
the server honours (every chunk with its usage so far).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-guidellm"
GUIDELLM = "guidellm==0.8.1"
TORCH = "torch==2.13.0"  # the CPU build these machines carry; unpinned, pip picks a multi-GB CUDA one
MODEL_ID = "smollm2-135m"


def guidellm_python() -> Path:
    """The python of guidellm's own venv (created on first use)."""
    python = VENV / "bin" / "python"
    if not (VENV / "bin" / "guidellm").exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, TORCH], check=True)
        subprocess.run([*pip, GUIDELLM], check=True)
    return python


def save_tokenizer(directory: Path) -> None:
    """The default model's tokenizer as a Hugging Face directory, for guidellm's AutoTokenizer."""
    sys.path.insert(0, str(ROOT))
    from celerytp.core.model_files import default_model_path
    from celerytp.core.tokenizer import load_tokenizer

    load_tokenizer(default_model_path()).save(directory)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving(url: str) -> bool:
    """True once /v1/models lists the model (the port opens just after the model is loaded)."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as reply:
            return any(m["id"] == MODEL_ID for m in json.load(reply)["data"])
    except OSError:
        return False


def start_server(tp: int, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(log_path, "w")  # noqa: SIM115 - the server writes to it until it stops
    command = [sys.executable, "-m", "celerytp", "serve", "--tp", str(tp), "--port", str(port), "--model-id", MODEL_ID]
    proc = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while not serving(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            sys.exit(f"celerytp serve did not come up; its log:\n{log_path.read_text()}")
        time.sleep(0.5)
    return proc, url


def stop_server(proc: subprocess.Popen) -> None:
    """Ctrl-C, as a person would: the server stops its embedded rank workers and Redis."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_guidellm(python: Path, url: str, tokenizer: Path, rate: float, args: argparse.Namespace, report: Path) -> dict:
    """One constant-rate benchmark; guidellm's report of it (its JSON output)."""
    command = [
        str(python.parent / "guidellm"), "run",
        "--backend", f"kind=openai_http,target={url},model={MODEL_ID}",
        "--profile", f"kind=constant,rate={rate}",
        "--constraint", f"kind=max_requests,count={round(rate * args.seconds)}",  # then waits for them
        "--constraint", f"kind=max_duration,seconds={args.seconds + args.drain}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--output", f"kind=json,path={report}",
        "--disable-console-interactive",
    ]  # fmt: skip
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    return benchmark


def figures(benchmark: dict) -> dict[str, float]:
    """Figures from guidellm's report of one benchmark: latencies of the requests that finished,
    throughput over all of them (as guidellm's "Server Throughput" table)."""
    metrics = benchmark["metrics"]

    def stat(name: str, field: str, status: str = "successful") -> float:
        return metrics[name][status][field]

    totals = metrics["request_totals"]
    return {
        "requests": totals["successful"],
        "errored": totals["errored"],
        "incomplete": totals["incomplete"],  # still running when the drain time was up
        "ttft_median_ms": stat("time_to_first_token_ms", "median"),
        "ttft_p99_ms": stat("time_to_first_token_ms", "percentiles")["p99"],
        "itl_median_ms": stat("inter_token_latency_ms", "median"),
        "output_tokens_per_s": stat("output_tokens_per_second", "mean", "total"),
        "latency_median_s": stat("request_latency", "median"),
        "latency_p99_s": stat("request_latency", "percentiles")["p99"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0], help="requests per second")
    parser.add_argument("--seconds", type=float, default=60.0, help="each rate sends rate x seconds requests")
    parser.add_argument("--drain", type=float, default=60.0, help="then waits up to this long for them to finish")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--results", type=Path, default=None, help="keep guidellm's JSON reports here")
    args = parser.parse_args()
    python = guidellm_python()
    version = subprocess.run([str(python), "-m", "guidellm", "--version"], check=True, capture_output=True,
                             text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="load_guidellm_") as scratch:
        results = args.results or Path(scratch)
        results.mkdir(parents=True, exist_ok=True)
        tokenizer = Path(scratch) / "tokenizer"
        save_tokenizer(tokenizer)
        proc, url = start_server(args.tp, Path(scratch) / "serve.log")
        try:
            rows = [(rate, figures(run_guidellm(python, url, tokenizer, rate, args, results / f"rate-{rate}.json")))
                    for rate in args.rates]  # fmt: skip
        finally:
            stop_server(proc)
    print(f"\n{version}; celerytp serve --tp {args.tp}, {MODEL_ID}; {args.prompt_tokens} prompt tokens, "
          f"{args.output_tokens} output tokens, rate x {args.seconds:g} s requests per rate")
    print("rate req/s | requests ok/err/cut | TTFT median / p99 ms | ITL median ms | output tok/s "
          "| latency median / p99 s")
    for rate, f in rows:
        print(f"{rate:10g} | {f['requests']:6d} / {f['errored']} / {f['incomplete']:<3d} "
              f"| {f['ttft_median_ms']:8.0f} / {f['ttft_p99_ms']:<8.0f} "
              f"| {f['itl_median_ms']:13.1f} | {f['output_tokens_per_s']:12.1f} "
              f"| {f['latency_median_s']:6.2f} / {f['latency_p99_s']:.2f}")


if __name__ == "__main__":
    main()
