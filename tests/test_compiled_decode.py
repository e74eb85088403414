"""Compiled decode (CELERYTP_COMPILE=1) gives the eager decode's greedy ids and logits.

Two cache rows decode together with prompts of different lengths (the ragged mask path), then
one row alone (a passenger row). Layers compile in runs with fullgraph=True, so a graph break
(e.g. a collective the compiler cannot trace) would leave decode eager and fail the check that
the model decodes through compiled runs, and no step may compile again after the load's warm-up
(ragged rows, a passenger, a batch of one, at any length). The 3-layer model compiles as one run at TP=2 and as
two runs of different lengths at TP=1 (two graphs per width, one after the other). TP=2 runs the
collectives as custom ops through shared memory, and a rank lost inside one must reach the
caller as a CollectiveFailed, as in eager decode. Float linears are packed for oneDNN
(CELERYTP_PACK_LINEARS=1): the eager model's all of them, the compiled model's only its LM head,
which runs outside the graphs (layers/packed_linear.py).
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from model_fixtures import TINY_CONFIGS, make_hf_model, make_prompt

from celerytp.core.switches import PACK_ENV
from celerytp.distributed import shm
from celerytp.distributed.control import CollectiveFailed
from celerytp.distributed.tp import TPContext
from celerytp.models import compiled, load_model
from celerytp.models.compiled import COMPILE_ENV, compile_requested, layer_runs, use_persistent_cache

pytestmark = pytest.mark.slow
STEPS = 12


def decode_both_rows(model, prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy ids per row and every decode step's logits: both rows, then row 0 beside a
    passenger, then row 0 alone (a batch of one)."""
    ids: list[list[int]] = [[], []]
    logits = []
    for row, prompt in enumerate(prompts):
        ids[row].append(int(model.forward_tokens(torch.tensor(prompt), 0, last_only=True, row=row).argmax()))
    for step in range(STEPS):
        active = [True, step < STEPS // 2]
        out = model.decode([ids[0][-1], ids[1][-1]], active)  # (active rows, V)
        logits.append(out[0])
        for row, a in enumerate(active):
            if a:
                ids[row].append(int(out[row].argmax()))
    out = model.decode([ids[0][-1]], [True])
    logits.append(out[0])
    ids[0].append(int(out[0].argmax()))
    return ids, torch.stack(logits)


def eager_and_compiled(path: str, tp: TPContext, prompts: list[list[int]]) -> tuple[dict, torch.nn.Module]:
    """The figures to compare, and the compiled model."""
    os.environ[COMPILE_ENV] = "0"
    eager = decode_both_rows(load_model(path, tp, max_context=64, max_batch=2), prompts)
    os.environ[COMPILE_ENV] = "1"
    model = load_model(path, tp, max_context=64, max_batch=2)
    runs = len(model.model.decode_runs or [])
    # The load's warm-up compiled every graph decode needs: a compile now would stall a request.
    with torch.compiler.set_stance("fail_on_recompile"):
        compiled_figures = decode_both_rows(model, prompts)
    packed = [m.onednn_weight is not None for m in model.model.layers.modules() if "onednn_weight" in m._buffers]
    return {"eager": eager, "compiled": compiled_figures, "runs": runs,
            "packed": (sum(packed), len(packed), model.lm_head.onednn_weight is not None)}, model


def _check(result: dict, runs: int) -> None:
    assert result["runs"], "decode fell back to eager (see the log for the graph break)"
    assert result["runs"] == runs
    assert result["packed"] == (0, 4 * 3, True)  # traced layers plain (4 linears a layer), the head packed
    (eager_ids, eager_logits), (ids, logits) = result["eager"], result["compiled"]
    assert ids == eager_ids
    torch.testing.assert_close(logits, eager_logits, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[list[int]]]:
    model_type, kwargs = TINY_CONFIGS["llama_gqa_bias"]
    hf = make_hf_model(model_type, kwargs | {"num_hidden_layers": 3}, seed=11)
    path = tmp_path_factory.mktemp("compiled")
    hf.save_pretrained(path)
    vocab = hf.config.vocab_size
    return str(path), [make_prompt(vocab, 7, seed=1), make_prompt(vocab, 4, seed=2)]


def test_compiled_decode_matches_eager_tp1(checkpoint: tuple[str, list[list[int]]], monkeypatch) -> None:
    path, prompts = checkpoint
    monkeypatch.setenv(COMPILE_ENV, "0")  # restored afterwards: the suite's setting (tests/conftest.py)
    monkeypatch.setattr(compiled, "LAYERS_PER_GRAPH", 2)  # runs of 1 and 2 layers
    monkeypatch.setenv(PACK_ENV, "1")
    _check(eager_and_compiled(path, TPContext(), prompts)[0], runs=2)


def test_layers_are_cut_into_even_consecutive_runs() -> None:
    layers = list(range(30))
    assert [len(run) for run in layer_runs(layers, 5)] == [5] * 6
    assert layer_runs([], 5) == []
    for count in (1, 2, 3, 7, 24, 31):
        runs = layer_runs(list(range(count)), 5)
        assert [layer for run in runs for layer in run] == list(range(count))  # all, in order
        assert len(runs) == -(-count // 5) and max(map(len, runs)) - min(map(len, runs)) <= 1


def _rank(rank: int, path: str, prompts: list[list[int]], init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ[PACK_ENV] = "1"
    out = Path(out_dir) / f"rank{rank}.pt"
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=180))
        assert shm.attach("compiled", "test", rank, 2, 180.0) is not None
        result, model = eager_and_compiled(path, TPContext(rank, 2), prompts)
        if rank == 1:
            torch.save(result, out)
            _die_in_a_compiled_all_reduce()
        else:
            shm.active().timeout_s = 3.0  # rank 1 dies in the next decode: its deadline
        try:
            model.decode([0], [True])
            result["fault"] = "no error"
        except CollectiveFailed as exc:
            result["fault"] = ("CollectiveFailed", exc.timed_out)
        except BaseException as exc:  # noqa: BLE001 - reported as the test's failure
            result["fault"] = f"{type(exc).__name__}: {exc}"[:300]
        torch.save(result, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise
    os._exit(0)  # the peer is gone: no group teardown to wait on


def _die_in_a_compiled_all_reduce() -> None:
    """Exit this process at the first all-reduce a compiled layer calls (through the
    celerytp::all_reduce op), as a rank lost in the middle of a decode step."""
    entered = shm.ShmGroup.all_reduce

    def all_reduce(self, *args, **kwargs):
        if any(frame.name == "_all_reduce_op" for frame in traceback.extract_stack()):
            os._exit(0)
        return entered(self, *args, **kwargs)

    shm.ShmGroup.all_reduce = all_reduce


def test_compiled_decode_matches_eager_tp2(checkpoint: tuple[str, list[list[int]]], tmp_path: Path) -> None:
    path, prompts = checkpoint
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank, args=(r, path, prompts, str(tmp_path / "pg"), str(tmp_path)), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        if p.is_alive():
            p.kill()
    for r in range(2):
        out = tmp_path / f"rank{r}.pt"
        assert out.exists(), f"rank {r} wrote no result"
        result = torch.load(out)
        assert "error" not in result, result.get("error")
        _check(result, runs=1)
    # A peer lost inside a compiled layer's collective reaches the worker as the collectives'
    # own error (worker/state.py marks the group broken on it), not as a compiler's RuntimeError.
    assert torch.load(tmp_path / "rank0.pt")["fault"] == ("CollectiveFailed", True)


@pytest.mark.parametrize(("value", "device", "quant", "compiles"), [
    ("auto", "cpu", "q4_1+q8_0", True),  # kept quantized: compiling pays on CPU
    ("auto", "cpu", None, False),  # float32 on CPU: it does not (docs/benchmarks.md)
    ("auto", "cpu", "bf16", False),
    ("auto", "cuda", None, True),
    ("1", "cpu", None, True),
    ("0", "cuda", "q4_0", False),
])
def test_compile_by_default_where_it_pays(monkeypatch, value, device, quant, compiles) -> None:
    monkeypatch.setenv(COMPILE_ENV, value)
    model = type("Model", (), {"device": torch.device(device), "quant": quant})()
    assert compile_requested(model) is compiles


def test_a_mistyped_switch_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(COMPILE_ENV, "yes please")
    with pytest.raises(ValueError, match="CELERYTP_COMPILE must be auto, 1 or 0"):
        compile_requested(type("Model", (), {"device": torch.device("cpu"), "quant": None})())


def test_the_compile_cache_lives_in_the_workers_cache_directory(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("CELERYTP_CACHE_DIR", str(tmp_path))
    use_persistent_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor") and (tmp_path / "inductor").is_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")  # an operator's own choice stays
    use_persistent_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"


def test_bucketed_decode_gives_the_same_tokens_from_a_few_shapes(checkpoint) -> None:
    """Where decode runs as CUDA graphs (one recorded graph per shape), it pads its batch width and
    the keys it reads to powers of two (`decode_buckets`, models/compiled.py turns it on with
    CUDA graphs). No GPU here: the padding runs eagerly on CPU. Three rows of different lengths,
    one of which stops half-way (a passenger), decode 20 steps after the first decoded 3 alone: the
    same greedy ids and logits as without padding, while the layers see three shapes instead of
    one per step."""
    path, prompts = checkpoint
    prompts = [*prompts, make_prompt(100, 10, seed=3)]
    os.environ[COMPILE_ENV] = "0"
    runs = {}
    for bucketed in (False, True):
        model = load_model(path, TPContext(), max_context=64, max_batch=5)
        model.decode_buckets = bucketed
        shapes = set()
        model.model.layers[0].register_forward_pre_hook(
            lambda _, args: shapes.add((args[0].shape[0], args[3].length)) if args[3].writes is not None else None)
        ids = [[int(model.forward_tokens(torch.tensor(p), 0, last_only=True, row=r).argmax())] for r, p in enumerate(prompts)]
        logits = []
        for _ in range(3):  # row 0 alone first: no ragged rows, yet the padded keys must stay hidden
            out = model.decode([ids[0][-1]], [True])
            logits.append(out[0])
            ids[0].append(int(out[0].argmax()))
        for step in range(20):
            active = [True, True, step < 10]
            out = model.decode([row[-1] for row in ids], active)
            logits.append(out[0])
            for row, a in enumerate(active):
                if a:
                    ids[row].append(int(out[row].argmax()))
        runs[bucketed] = ids, torch.stack(logits), shapes
    (plain_ids, plain_logits, plain_shapes), (ids, logits, shapes) = runs[False], runs[True]
    assert ids == plain_ids
    torch.testing.assert_close(logits, plain_logits, atol=1e-5, rtol=0)
    assert len(plain_shapes) > 10 and shapes == {(1, 16), (4, 16), (4, 32)}  # widths 1, 3 -> 4; keys up to 33
