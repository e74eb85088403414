"""lm-evaluation-harness, unchanged, against `celerytp serve` on the default model: its
`local-completions` model scores a small multiple-choice task by log-likelihood, the batched,
token-id, `echo` + `logprobs` completions it sends (docs/serving.md). No hub: the task is a local
YAML over a local JSON file, and the tokenizer lm-eval uses is the served model's own, written out.

Run: pip install lm-eval; python benchmarks/lm_eval_local.py [--tp 2] [--batch-size 4]

Prints lm-eval's accuracy and the wall time. Too slow for CI (lm-eval and its dependencies
install in minutes); the completions surface it relies on is tested in tests/test_openai_sampling.py.
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
from pathlib import Path

import httpx

from celerytp.core.model_files import default_model_path
from celerytp.core.tokenizer import load_tokenizer

MODEL = "smol"
QUESTIONS = [  # (context, choices, index of the right one): facts a 135M model mostly knows
    ("The capital of France is", [" Paris", " London", " Berlin"], 0),
    ("The capital of Japan is", [" Madrid", " Tokyo", " Rome"], 1),
    ("Water freezes at zero degrees", [" Fahrenheit", " Kelvin", " Celsius"], 2),
    ("The sun rises in the", [" east", " west", " north"], 0),
    ("A week has seven", [" months", " days", " years"], 1),
    ("Two plus two equals", [" five", " three", " four"], 2),
    ("The opposite of hot is", [" cold", " warm", " loud"], 0),
    ("Bees make", [" milk", " honey", " silk"], 1),
    ("The largest ocean on Earth is the", [" Atlantic", " Arctic", " Pacific"], 2),
    ("Cats are often kept as", [" pets", " tools", " vehicles"], 0),
    ("The color of the sky on a clear day is", [" green", " blue", " red"], 1),
    ("A triangle has three", [" wheels", " legs", " sides"], 2),
    ("We breathe", [" air", " sand", " glass"], 0),
    ("Ice is frozen", [" fire", " water", " wood"], 1),
    ("The first month of the year is", [" March", " June", " January"], 2),
    ("Fish live in", [" water", " trees", " clouds"], 0),
]
TASK = """task: celerytp_local_qa
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="celerytp-lm-eval-"))
    data = work / "questions.jsonl"
    data.write_text("".join(json.dumps({"context": c, "choices": ch, "label": i}) + "\n" for c, ch, i in QUESTIONS))
    (work / "task.yaml").write_text(TASK.format(data=data))
    load_tokenizer(default_model_path()).save(work / "tokenizer")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "celerytp", "serve", "--tp", str(args.tp), "--port", str(port),
                               "--model-id", MODEL], start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the server did not come up")
            time.sleep(0.5)
        model_args = (f"model={MODEL},base_url={url}/v1/completions,tokenizer={work / 'tokenizer'},"
                      "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
             "--tasks", "celerytp_local_qa", "--include_path", str(work), "--batch_size", str(args.batch_size),
             "--output_path", str(work / "out")],
            env=env, capture_output=True, text=True,
        )
        took = time.perf_counter() - started
        print(done.stdout[-3000:])
        if done.returncode:
            print(done.stderr[-5000:], file=sys.stderr)
            raise SystemExit(f"lm_eval exited {done.returncode}")
        results = [json.loads(p.read_text()) for p in (work / "out").rglob("results_*.json")]
        acc = results[-1]["results"]["celerytp_local_qa"]["acc,none"] if results else None
        print(json.dumps({"questions": len(QUESTIONS), "acc": acc, "seconds": round(took, 1), "tp": args.tp}))
    finally:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(60)


if __name__ == "__main__":
    main()
