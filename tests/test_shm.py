"""Shared-memory collectives on real processes joined by a real gloo group.

Bit-identity with gloo: at world size 2 a sum has one order (a + b == b + a), so random floats
must agree to the bit. At 3 and 4 gloo's ring folds each chunk starting at a different rank, so
float sums are compared on values whose sums are exact (multiples of 1/64, small), and random
floats are checked against a rank-order fold of the gathered inputs and across ranks.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from celerytp.core.switches import SHM_ENV
from celerytp.distributed import shm
from celerytp.distributed.control import CollectiveFailed, ControlGroup

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
NUMELS = [1, 512, 16384, 1 << 18]  # 4 B .. 1 MiB of float32: up to the slot size


def _maps(pid: int | str, name: str) -> int:
    return sum(name in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


def _values(dtype: torch.dtype, numel: int, seed: int, exact: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-(1 << 40), 1 << 40, (numel,), generator=g)
    if exact:  # small multiples of 1/64: every partial sum is representable, in any order
        return (torch.randint(-64, 64, (numel,), generator=g).float() / 64).to(dtype)
    return torch.randn(numel, generator=g).to(dtype)


def _gather(t: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t)
    return parts


def _check_collectives(rank: int, world_size: int, group: shm.ShmGroup) -> None:
    for dtype in DTYPES:
        for numel in NUMELS:
            if numel * dtype.itemsize > group.slot_bytes or (numel == NUMELS[-1] and dtype != torch.float32):
                continue  # the full slot once (float32) is enough: big cases cost the test's time
            for exact in (False, True):
                seed = 1000 * rank + 100 * DTYPES.index(dtype) + 10 * NUMELS.index(numel) + exact
                x = _values(dtype, numel, seed, exact)
                ours, theirs = group.all_reduce(x.clone()), x.clone()
                dist.all_reduce(theirs)
                what = f"{dtype} x{numel} exact={exact} at world size {world_size}"
                everyone = _gather(ours, world_size)
                assert all(torch.equal(o, ours) for o in everyone), f"ranks disagree: {what}"
                if exact or world_size == 2 or dtype == torch.int64:
                    assert torch.equal(ours, theirs), f"shm sum != gloo sum: {what}"
                inputs = _gather(x, world_size)
                fold = inputs[0] + inputs[1]
                for part in inputs[2:]:
                    fold = fold + part
                assert torch.equal(ours, fold), f"not the rank-order sum: {what}"
            for op, reduce_op in (("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
                ours, theirs = group.all_reduce(x.clone(), op), x.clone()
                dist.all_reduce(theirs, op=reduce_op)
                assert torch.equal(ours, theirs), f"{op} differs: {dtype} x{numel}"
            for src in range(world_size):
                ours, theirs = x.clone(), x.clone()
                group.broadcast(ours, src)
                dist.broadcast(theirs, src)
                assert torch.equal(ours, theirs), f"broadcast from {src} differs: {dtype} x{numel}"
    assert not group.fits(torch.zeros(group.slot_bytes // 4 + 1))  # larger tensors go to gloo
    kept, shm._MAX_VIEWS = shm._MAX_VIEWS, 1  # the slot views kept per (set, size, dtype) dropped at every new one: made again
    for numel in (*NUMELS[:3], *NUMELS[:3]):
        x = _values(torch.float32, numel, rank, exact=True)
        assert torch.equal(group.all_reduce(x.clone()), sum(_gather(x, world_size))), f"x{numel} after a drop"
    shm._MAX_VIEWS = kept
    _check_inference_mode(rank, world_size, group)


def _check_inference_mode(rank: int, world_size: int, group: shm.ShmGroup) -> None:
    """A size first met under inference mode (a compiled decode's warm-up at load) is usable outside
    it (the serving loop's whole-logits gather), and a caller's own error inside a collective (an
    inference tensor written outside inference mode) raises as it is, not as a lost peer, and
    leaves the group in step."""
    x = _values(torch.float32, 96, rank, exact=True)
    expected = sum(_gather(x, world_size))
    with torch.inference_mode():
        group.all_reduce(x.clone())
        group.all_gather(x.clone())
    assert torch.equal(group.all_reduce(x.clone()), expected)
    assert torch.equal(group.all_gather(x.clone()), torch.stack(_gather(x, world_size)))
    with torch.inference_mode():
        frozen = x.clone()
    control = ControlGroup(rank, world_size, None, group)
    with pytest.raises(RuntimeError, match="inference tensor") as raised:
        control.all_reduce(frozen)
    assert not isinstance(raised.value, CollectiveFailed)
    assert torch.equal(control.all_reduce(x.clone()), expected)


def _check_rank_order(rank: int, world_size: int) -> None:
    """The model group's all-reduce of a tensor too large for the segment (gloo's path, as a long
    prefill's) sums each row to the same bits as the same rows alone through the segment (as
    decode's): both fold in rank order."""
    from celerytp.distributed.tp import TPContext

    # the default group takes the segment when a tensor fits; a group named takes gloo's path always
    tp, off_segment = TPContext(rank, world_size), TPContext(rank, world_size, dist.group.WORLD)
    g = torch.Generator().manual_seed(rank)
    rows = torch.randn(301, 4097, generator=g)  # 4.7 MiB, not a whole number of chunks: folded in chunks
    whole = tp.all_reduce(rows.clone())
    for start, stop in ((0, 63), (37, 38), (300, 301)):  # under 1 MiB: the segment's fold, or gathered whole
        for ctx in (tp, off_segment):
            assert torch.equal(ctx.all_reduce(rows[start:stop].clone()), whole[start:stop]), (start, ctx.group)


def _rank_main(rank: int, world_size: int, init_file: str, scenario: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir) / f"rank{rank}.txt"
    try:
        timeout_s = 3.0 if scenario == "dead_peer" else 60.0  # the shared-memory deadline
        dist.init_process_group(  # gloo keeps a long one: spawned ranks start seconds apart on a busy machine
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        group_name = f"test{os.getppid()}-{world_size}"  # one segment name per case
        name = shm.segment_name(group_name, scenario)
        group = shm.attach(group_name, scenario, rank, world_size, timeout_s)
        assert group is shm.active() and group is not None
        dist.barrier()  # rank 0 unlinks the name before attach returns there; the others may return first
        assert not (Path(shm.SHM_DIR) / name).exists(), "segment name left in /dev/shm after setup"
        assert _maps("self", name) == 1
        if scenario == "collectives":
            _check_collectives(rank, world_size, group)
            shm.detach()
            assert _maps("self", name) == 0, "segment still mapped after detach"
            out.write_text("ok")
        elif scenario == "rank_order":
            _check_rank_order(rank, world_size)
            out.write_text("ok")
        elif scenario == "dead_peer":
            if rank == world_size - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            _expect_timeout(rank, group, timeout_s, out)
        elif scenario == "abort":
            _expect_abort(rank, group)
            out.write_text("ok")
    except BaseException:
        out.write_text(traceback.format_exc())
        raise


def _expect_timeout(rank: int, group: shm.ShmGroup, timeout_s: float, out: Path) -> None:
    """A rank whose peer was SIGKILLed: the all-reduce raises the timeout, and a rank worker
    turns it into a typed TIMEOUT error like gloo's."""
    from celerytp.core.errors import CeleryTPError, ErrorKind
    from celerytp.worker.config import RankConfig
    from celerytp.worker.state import RankState

    state = RankState(RankConfig(rank, group.world_size, "unused", "redis://127.0.0.1:1", device="cpu"))
    time.sleep(0.5)  # the peer is gone by now
    start = time.monotonic()
    try:
        control = ControlGroup(rank, group.world_size, None, group)  # its collectives go through shm
        state.collective(lambda: control.all_reduce(torch.ones(4)))
    except CeleryTPError as exc:
        waited = time.monotonic() - start
        assert exc.kind == ErrorKind.TIMEOUT, exc
        failed = exc.__cause__
        assert isinstance(failed, CollectiveFailed) and isinstance(failed.__cause__, dist.DistBackendError)
        assert "Timed out" in str(failed)
        assert timeout_s - 0.1 <= waited <= timeout_s + 5, f"raised after {waited:.2f}s"
        out.write_text("ok")
        os._exit(0)  # skip destroy_process_group: its peer is dead
    raise AssertionError("all-reduce with a dead peer returned")


def _expect_abort(rank: int, group: shm.ShmGroup) -> None:
    """Rank 0 aborts the segment from another thread (as its deadman does when a peer is gone)
    while it and rank 1 wait in an all-reduce that the last rank, busy or stopped, has not
    reached: both waits fail at once, not at the 60 s deadline, and the last rank's all-reduce
    fails when it comes, before it waits."""
    last = group.world_size - 1
    if rank == 0:
        threading.Timer(0.5, group.abort, ("rank 2: its worker was replaced",)).start()
    if rank == last:
        time.sleep(2.0)
    start = time.monotonic()
    with pytest.raises(shm.ShmFailure, match="aborted by rank 0") as info:
        group.all_reduce(torch.ones(4))
    assert time.monotonic() - start < (0.1 if rank == last else 10), f"failed after {time.monotonic() - start:.2f}s"
    assert rank != 0 or "replaced" in str(info.value)


def _run(world_size: int, scenario: str, tmp_path: Path, expect_ok: list[int], timeout: float = 120) -> None:
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, str(tmp_path / "pg"), scenario, str(tmp_path)))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    for r in expect_ok:
        out = tmp_path / f"rank{r}.txt"
        assert out.exists(), f"rank {r} wrote nothing (exit code {procs[r].exitcode})"
        assert out.read_text() == "ok", f"rank {r}:\n{out.read_text()}"
    leaked = [f for f in os.listdir(shm.SHM_DIR) if f.startswith(f"celerytp-test{os.getpid()}-")]
    assert not leaked, f"segments left in /dev/shm: {leaked}"


# 4 ranks on CI's 2 cores once waited out the 60 s deadline in a full run (alone it passes in
# seconds); until that is understood, CI covers 2 and 3 (docs/performance.md).
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_reduce_and_broadcast_match_gloo(world_size: int, tmp_path: Path) -> None:
    _run(world_size, "collectives", tmp_path, list(range(world_size)))


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rows_sum_is_the_same_bits_through_gloo_and_the_segment(world_size: int, tmp_path: Path) -> None:
    """A row's sum through the model group is the same bits alone, in a tensor the segment takes,
    gathered whole off it, or folded in chunks. At three ranks gloo's own ring gives a row other
    bits than the segment's rank-order fold (this fails with CELERYTP_BATCH_INVARIANT=0)."""
    _run(world_size, "rank_order", tmp_path, list(range(world_size)))


def test_dead_peer_raises_the_timeout_within_the_deadline(tmp_path: Path) -> None:
    _run(3, "dead_peer", tmp_path, [0, 1], timeout=60)


def test_an_abort_fails_every_ranks_waits_at_once(tmp_path: Path) -> None:
    _run(3, "abort", tmp_path, [0, 1, 2], timeout=60)


def test_switch_and_segment_names() -> None:
    assert shm.segment_name("my group", "a/b") == "celerytp-my_group-a_b"
    os.environ[SHM_ENV] = "0"
    try:
        assert not shm.enabled()
        assert shm.attach("g", "c", 0, 2, 1.0) is None  # off: no collective is entered at all
    finally:
        del os.environ[SHM_ENV]
    assert shm.enabled()
