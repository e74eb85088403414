"""Images on a vision-language model: what an image costs a served request, and whether each rank
should run the whole vision tower for every image (replicated, as the ranks do) or a share of the
images, the features then all-gathered (split).

Run: python benchmarks/images.py [--quick] [--runs 8] [--clients 8] [--duration 30] [--repeats 5]
     [--vision-hidden 256] [--vision-layers 6] [--image-size 224] [--patch 14]
     [--text-hidden 512] [--text-layers 8] [--picture 320x240] [--only serving|tower]

The model: a random float32 llava saved as a Hugging Face directory (tests/vision_fixtures.py
builds a tiny one the same way): a CLIP tower (by default hidden 256, 6 layers, 224-pixel images
in 14-pixel patches: 256 image tokens) and a llama text model (hidden 512, 8 layers, SmolLM2's
vocabulary plus `<image>`), SmolLM2's tokenizer, CLIP's image processor. Pictures are random
noise PNGs (`--picture` pixels), a new one for every request unless said otherwise.

Serving: `celerytp serve DIR --tp 2 --max-batch 8 --model-id vlm` in a subprocess, driven with the
`openai` client. TTFT (streamed; request start to the first chunk with content), median of
`--runs`, the four kinds interleaved run by run: a chat with 1 new image; the same chat text-only,
its text padded to the same prompt token count; a follow-up turn about the image just answered
(its prefix reused); the same follow-up of the text chat. Then throughput: `--clients` clients
for `--duration` s, each sending one request after the other (max_tokens 32, ignore_eos), half
of them 1-image chats and half text chats, against all of them text chats; requests/s and output
tokens/s over the wall time until the last request ends.

Tower: in two spawned processes on a gloo group, one intra-op thread each (a rank's), each with
the model loaded. For 1, 2 and 4 images of one call: the image processor's and the tower's time
on rank 0 alone; replicated (both ranks preprocess and encode all n at once, the slower one
counted); the all-gather of ceil(n/2) images' features (gloo, and the shared-memory path of
distributed/shm.py); the split's estimate, encode(ceil(n/2)) alone + the gloo all-gather; and the
split measured (each rank its share, then the gloo all-gather). Medians of `--repeats`.

Prints one JSON object per part and tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

MODEL_ID = "vlm"
COUNTS = (1, 2, 4)
QUESTION = "Describe this picture in detail: its colours, its shapes and what it might show."
FILLER = " and"  # one token in SmolLM2's vocabulary


@dataclass
class Sizes:
    """The random llava's sizes; heads of 64, llama's KV heads half its heads (TP=2 splits both)."""

    vision_hidden: int = 256
    vision_layers: int = 6
    image_size: int = 224
    patch: int = 14
    text_hidden: int = 512
    text_layers: int = 8
    tokens_per_image: int = field(init=False)

    def __post_init__(self) -> None:
        if self.image_size % self.patch:
            raise ValueError(f"image size {self.image_size} is not a multiple of patch {self.patch}")
        self.tokens_per_image = (self.image_size // self.patch) ** 2  # CLIP's class position dropped


def write_llava(path: Path, sizes: Sizes, seed: int = 5) -> Path:
    """A random llava of `sizes` as a Hugging Face directory (transformers' own initialisation)."""
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )
    from vision_fixtures import _tokenizer, chat_template

    (image,) = _tokenizer(path, ("<image>",), chat_template("<image>"))
    heads = sizes.text_hidden // 64
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=sizes.vision_hidden, intermediate_size=4 * sizes.vision_hidden,
                                       num_hidden_layers=sizes.vision_layers, num_attention_heads=sizes.vision_hidden // 64,
                                       image_size=sizes.image_size, patch_size=sizes.patch),
        text_config=LlamaConfig(hidden_size=sizes.text_hidden, intermediate_size=sizes.text_hidden * 11 // 4,
                                num_hidden_layers=sizes.text_layers, num_attention_heads=heads,
                                num_key_value_heads=heads // 2, vocab_size=image + 1, max_position_embeddings=2048,
                                eos_token_id=2),
        image_token_index=image, vision_feature_layer=-2,
    )  # fmt: skip
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).eval().save_pretrained(path)
    side = sizes.image_size
    CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side}).save_pretrained(path)
    return path


def pictures(seeds: range, size: tuple[int, int]) -> list[bytes]:
    from vision_fixtures import picture

    return [picture(seed, size) for seed in seeds]


def median_ms(values: list[float]) -> float:
    return round(1000 * statistics.median(values), 2)


# ---- serving ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`celerytp serve DIR --tp 2 --max-batch 8 --model-id vlm` until stopped with Ctrl-C."""

    def __init__(self, model: Path, log_path: Path, max_batch: int):
        import httpx

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - the server writes to it until stop()
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celerytp", "serve", str(model), "--tp", "2", "--max-batch", str(max_batch),
             "--model-id", MODEL_ID, "--port", str(port), "--no-frontend"],
            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        while not re.search(rf"celerytp serving '{MODEL_ID}'", log_path.read_text()):
            if self.proc.poll() is not None or time.perf_counter() - started > 300:
                raise RuntimeError(f"the server did not come up:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        while True:  # the banner comes just before the port opens
            try:
                if httpx.get(f"{self.url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        self.start_s = time.perf_counter() - started

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(60)
        self._log.close()


def image_chat(tag: str, image: bytes) -> list[dict[str, Any]]:
    from vision_fixtures import user_turn

    return [user_turn(f"{tag} {QUESTION}", image)]


def text_chat(tag: str, filler: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"{tag} {QUESTION}" + FILLER * filler}]


def follow_up(messages: list[dict[str, Any]], answer: str) -> list[dict[str, Any]]:
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "And what else?"}]


def streamed(client, messages: list[dict[str, Any]], tokens: int) -> tuple[float, str, int]:
    """(TTFT s, the reply's text, prompt tokens) of one streamed greedy chat."""
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    ttft, text, prompt = None, [], 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - started
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            prompt = chunk.usage.prompt_tokens
    return ttft if ttft is not None else float("nan"), "".join(text), prompt


def prompt_tokens(client, messages: list[dict[str, Any]]) -> int:
    reply = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=1, temperature=0)
    return reply.usage.prompt_tokens


def matched_filler(client, image: bytes) -> tuple[int, int, int]:
    """(filler tokens, image chat's prompt tokens, text chat's) so that the text chat's prompt is
    as long as the 1-image chat's (also warms both paths up)."""
    target = prompt_tokens(client, image_chat("R000", image))
    filler = 0
    for _ in range(3):
        filler += target - prompt_tokens(client, text_chat("R000", filler))
    return filler, target, prompt_tokens(client, text_chat("R000", filler))


def ttft_runs(client, runs: int, filler: int, picture_size: tuple[int, int]) -> dict[str, dict]:
    kinds = (
        "1 new image",
        "text only, same prompt length",
        "follow-up, same image (prefix reused)",
        "follow-up, text only (prefix reused)",
    )
    seen: dict[str, list[tuple[float, int]]] = {k: [] for k in kinds}
    images = pictures(range(1000, 1000 + runs), picture_size)
    for i, image in enumerate(images):
        tag = f"R{i + 1:03d}"
        for first, again, messages in (
            (kinds[0], kinds[2], image_chat(tag, image)),
            (kinds[1], kinds[3], text_chat(tag, filler)),
        ):
            ttft, answer, prompt = streamed(client, messages, 8)
            seen[first].append((ttft, prompt))
            ttft, _, prompt = streamed(client, follow_up(messages, answer), 4)
            seen[again].append((ttft, prompt))
    return {k: {"prompt_tokens": statistics.median(p for _, p in v), "ttft_ms": median_ms([t for t, _ in v]),
                "min_ms": round(1000 * min(t for t, _ in v), 1), "max_ms": round(1000 * max(t for t, _ in v), 1)}
            for k, v in seen.items()}  # fmt: skip


def load(url: str, clients: int, duration: float, imaging: int, filler: int, picture_size: tuple[int, int]) -> dict:
    """`clients` closed-loop clients for `duration` s; the first `imaging` send 1-image chats."""
    import openai

    pool = pictures(range(5000, 5000 + 40 * imaging), picture_size) if imaging else []
    done: dict[str, list[tuple[float, int]]] = {"image": [], "text": []}
    failures: list[str] = []
    lock = threading.Lock()
    started = time.perf_counter()

    def client_loop(c: int) -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        kind, n = ("image" if c < imaging else "text"), 0
        while time.perf_counter() - started < duration:
            tag = f"C{c:02d}N{n:03d}"
            messages = image_chat(tag, pool[(c * 40 + n) % len(pool)]) if kind == "image" else text_chat(tag, filler)
            sent = time.perf_counter()
            try:
                reply = client.chat.completions.create(
                    model=MODEL_ID, messages=messages, max_tokens=32, temperature=0, extra_body={"ignore_eos": True}
                )
            except openai.OpenAIError as exc:  # counted: the figures say how many failed
                with lock:
                    failures.append(repr(exc)[:200])
                continue
            with lock:
                done[kind].append((time.perf_counter() - sent, reply.usage.completion_tokens))
            n += 1

    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    every = [r for rs in done.values() for r in rs]
    out = {
        "wall_s": round(wall, 1),
        "requests_per_s": round(len(every) / wall, 2),
        "output_tokens_per_s": round(sum(t for _, t in every) / wall, 1),
        "failures": failures[:5],
    }
    for kind, rs in done.items():
        if rs:
            out[kind] = {"requests": len(rs), "latency_median_ms": median_ms([s for s, _ in rs])}
    return out


def serving(model: Path, args: argparse.Namespace) -> dict:
    import openai

    server = Server(model, Path(tempfile.mkdtemp(prefix="bench-images-")) / "serve.log", args.max_batch)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
        filler, image_prompt, text_prompt = matched_filler(client, pictures(range(1), args.picture)[0])
        report = {
            "server_start_s": round(server.start_s, 1),
            "log": str(server.log_path),
            "prompt_tokens": {"image": image_prompt, "text": text_prompt, "filler": filler},
            "ttft": ttft_runs(client, args.runs, filler, args.picture),
        }
        half = args.clients // 2
        report["load"] = {
            "mixed": load(server.url, args.clients, args.duration, half, filler, args.picture),
            "text": load(server.url, args.clients, args.duration, 0, filler, args.picture),
        }
        return report
    finally:
        server.stop()


def print_serving(report: dict, args: argparse.Namespace) -> None:
    print("\nload average (1 min) at the start / end: {:.2f} / {:.2f}".format(*report["load_average"]))
    print(
        f"\nserving: celerytp serve --tp 2 --max-batch {args.max_batch}, server up in {report['server_start_s']} s; "
        f"prompt tokens: 1 image {report['prompt_tokens']['image']}, text {report['prompt_tokens']['text']}"
    )
    print("\n| request (streamed, max_tokens 8 / follow-ups 4) | prompt tokens | TTFT median | min - max |")
    print("|---|---|---|---|")
    for kind, row in report["ttft"].items():
        print(
            f"| {kind} | {row['prompt_tokens']:.0f} | {row['ttft_ms']:.0f} ms | {row['min_ms']:.0f} - {row['max_ms']:.0f} ms |"
        )
    ttft = list(report["ttft"].values())
    print(
        f"1 image / text only: {ttft[0]['ttft_ms'] / ttft[1]['ttft_ms']:.2f}x; "
        f"follow-up / first turn with the image: {ttft[2]['ttft_ms'] / ttft[0]['ttft_ms']:.2f}x"
    )
    print(
        f"\n| {args.clients} clients, {args.duration:.0f} s, max_tokens 32 | requests/s | output tok/s | "
        "image requests (latency median) | text requests (latency median) |"
    )
    print("|---|---|---|---|---|")
    for name, row in report["load"].items():
        cells = [
            f"{row[k]['requests']} ({row[k]['latency_median_ms'] / 1000:.2f} s)" if k in row else "-"
            for k in ("image", "text")
        ]
        label = "half 1-image chats, half text" if name == "mixed" else "all text"
        print(f"| {label} | {row['requests_per_s']:.2f} | {row['output_tokens_per_s']:.1f} | {cells[0]} | {cells[1]} |")
        if row["failures"]:
            print(f"  failures ({name}): {row['failures']}")
    mixed, text = report["load"]["mixed"], report["load"]["text"]
    print(
        f"mixed / all text: requests/s {mixed['requests_per_s'] / text['requests_per_s']:.2f}x, "
        f"output tok/s {mixed['output_tokens_per_s'] / text['output_tokens_per_s']:.2f}x"
    )


# ---- the tower, replicated vs split ---------------------------------------------------------------


def _max_over_ranks(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed_on_both(fn, *args: Any) -> tuple[float, Any]:
    """The slower rank's time for `fn(*args)`, both ranks starting together."""
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    result = fn(*args)
    return _max_over_ranks(time.perf_counter() - started), result


def _gather_time(gather, rows, iters: int = 20) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(iters + 3):
        dist.barrier()
        started = time.perf_counter()
        gather(rows)
        times.append(time.perf_counter() - started)
    return statistics.median(times[3:])


def _tower_rank(rank: int, init_file: str, path: str, repeats: int, picture_size: tuple[int, int], out) -> None:
    import torch
    import torch.distributed as dist

    from celerytp.distributed import shm
    from celerytp.distributed.tp import TPContext
    from celerytp.models import load_model
    from celerytp.worker.image_features import ImageFeatures

    torch.set_num_threads(1)
    model = load_model(path, TPContext(), max_batch=1, max_context=64)  # the tower needs no group
    features = ImageFeatures(Path(path), model)
    tokens, hidden = model.vision.tokens_per_image, model.config.hidden_size
    os.environ[shm.ENV_MAX_BYTES] = str(math.ceil(max(COUNTS) / 2) * tokens * hidden * 4)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    fast = shm.attach("images", os.path.basename(init_file), rank, 2, 60.0)

    def gloo_gather(rows: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(rows) for _ in range(2)]
        dist.all_gather(parts, rows)
        return torch.cat(parts)

    def split(images: list[bytes]) -> torch.Tensor:
        per = math.ceil(len(images) / 2)
        mine = images[rank * per : (rank + 1) * per]
        rows = features(mine)[0] if mine else torch.zeros(0, hidden)
        rows = torch.cat([rows, torch.zeros((per - len(mine)) * tokens, hidden)])  # all-gather takes equal sizes
        return gloo_gather(rows)[: len(images) * tokens]

    features(pictures(range(1), picture_size) * max(COUNTS))  # warm-up
    runs: dict[int, dict[str, list[float]]] = {n: {} for n in COUNTS}
    largest = 0.0  # the split's features against the replicated ones (a batch of 1 vs of n)
    for r in range(repeats):
        for n in COUNTS:
            images = pictures(range(100 * r + 10 * n, 100 * r + 11 * n), picture_size)
            got = runs[n]
            dist.barrier()
            if rank == 0:  # alone: the other rank waits
                started = time.perf_counter()
                processed = features.processor(images=[_opened(i) for i in images], return_tensors="pt")
                middle = time.perf_counter()
                model.encode_images(processed)
                got.setdefault("preprocess", []).append(middle - started)
                got.setdefault("tower", []).append(time.perf_counter() - middle)
            dist.barrier()
            seconds, (replicated, _) = _timed_on_both(features, images)
            got.setdefault("replicated", []).append(seconds)
            seconds, gathered = _timed_on_both(split, images)
            got.setdefault("split", []).append(seconds)
            difference = float((gathered - replicated).abs().max())
            assert difference < 1e-4, f"the split's features differ from the replicated ones by {difference}"
            largest = max(largest, difference)
            rows = torch.randn(math.ceil(n / 2) * tokens, hidden)
            got.setdefault("gather_gloo", []).append(_gather_time(gloo_gather, rows))
            if fast is not None:
                got.setdefault("gather_shm", []).append(_gather_time(fast.all_gather, rows))
    if rank == 0:
        out.put(
            {
                "tokens_per_image": tokens,
                "hidden": hidden,
                "shm": fast is not None,
                "split_max_difference": largest,
                "runs": {n: {k: median_ms(v) for k, v in got.items()} for n, got in runs.items()},
            }
        )
    shm.detach()
    dist.destroy_process_group()


def _opened(data: bytes):
    import io

    from PIL import Image

    return Image.open(io.BytesIO(data))


def tower(model: Path, args: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    init_file = str(model.parent / "gloo-init")
    mp.start_processes(
        _tower_rank, args=(init_file, str(model), args.repeats, args.picture, out), nprocs=2, start_method="spawn"
    )
    report = out.get()
    for n, row in report["runs"].items():
        half = report["runs"][math.ceil(n / 2)]
        row["split_estimate"] = round(half["preprocess"] + half["tower"] + row["gather_gloo"], 1)
        row["feature_bytes"] = math.ceil(n / 2) * report["tokens_per_image"] * report["hidden"] * 4
    return report


def print_tower(report: dict) -> None:
    tokens, hidden = report["tokens_per_image"], report["hidden"]
    print("\nload average (1 min) at the start / end: {:.2f} / {:.2f}".format(*report["load_average"]))
    print(
        f"\ntower alone, rank 0, 1 thread ({tokens} tokens x {hidden} hidden a picture, "
        f"{tokens * hidden * 4 / 1024:.0f} KiB of float32 features)"
    )
    print("\n| images in one call | preprocess | tower + projector | (preprocess + tower) / image |")
    print("|---|---|---|---|")
    for n, row in report["runs"].items():
        print(
            f"| {n} | {row['preprocess']:.1f} ms | {row['tower']:.1f} ms | "
            f"{(row['preprocess'] + row['tower']) / n:.1f} ms |"
        )
    print(
        "\n| images | replicated (both ranks, all n) | all-gather of ceil(n/2) images (bytes a rank) gloo / shm | "
        "split estimate: encode(ceil(n/2)) + gloo | split measured | split measured / replicated |"
    )
    print("|---|---|---|---|---|---|")
    for n, row in report["runs"].items():
        shm_ms = f"{row['gather_shm']:.2f}" if "gather_shm" in row else "-"
        print(
            f"| {n} | {row['replicated']:.1f} ms | {row['gather_gloo']:.2f} / {shm_ms} ms "
            f"({row['feature_bytes'] / 1024:.0f} KiB) | {row['split_estimate']:.1f} ms | {row['split']:.1f} ms | "
            f"{row['split'] / row['replicated']:.2f}x |"
        )


# ---- main -----------------------------------------------------------------------------------------


def run(model: Path, sizes: Sizes, args: argparse.Namespace) -> None:
    print(json.dumps({"sizes": asdict(sizes), "model": str(model)}), flush=True)
    if args.only in (None, "tower"):
        loads = os.getloadavg()[0]
        report = {**tower(model, args), "load_average": [loads, os.getloadavg()[0]]}
        print(json.dumps({"tower": report}), flush=True)
        print_tower(report)
    if args.only in (None, "serving"):
        loads = os.getloadavg()[0]
        report = {**serving(model, args), "load_average": [loads, os.getloadavg()[0]]}
        print(json.dumps({"serving": report}), flush=True)
        print_serving(report, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run: 3 TTFT runs, 4 clients for 10 s, 2 repeats")
    parser.add_argument("--only", choices=("serving", "tower"), default=None)
    parser.add_argument("--runs", type=int, default=8, help="TTFT runs of each kind")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of each load run")
    parser.add_argument("--repeats", type=int, default=5, help="tower measurements of each count")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--picture", default="320x240", help="the pictures' pixels, WxH")
    for name, default in asdict(Sizes()).items():
        if name != "tokens_per_image":
            parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    args = parser.parse_args()
    if args.quick:
        args.runs, args.clients, args.duration, args.repeats = 3, 4, 10.0, 2
    args.picture = tuple(int(x) for x in args.picture.split("x"))
    sizes = Sizes(**{k: getattr(args, k) for k in asdict(Sizes()) if k != "tokens_per_image"})
    with tempfile.TemporaryDirectory(prefix="bench-images-") as scratch:  # the model: ~300 MB by default
        model = write_llava(Path(scratch) / "llava", sizes)
        run(model, sizes, args)


if __name__ == "__main__":
    main()
