"""Quantized shards per ggml type: bytes per parameter, resident memory, decode tokens/s, error.

Each type runs in a fresh process (clean RSS) on the same model and thread count:
    python benchmarks/quant.py [--model PATH] [--threads 2] [--tokens 32] [--repeats 3] [--types f32,q8_0,...]
Default model: the SmolLM2-135M Q4_1 GGUF (quant=f32 dequantizes it; other types requantize
its float weights, except q4_1, which keeps the file's blocks). TP=1, in-process. The f32 run
goes first and saves its prompt logits; every other type reports its max |logit error| over a
37-token prompt relative to the f32 logits' range, and the types its linears ended up in
(SmolLM2's hidden 576 is not whole 256-blocks, so K-quants keep those tensors in their fallback).

--files (the precision table of docs/performance.md, "Quantized kernels"):
    python benchmarks/quant.py --files [--types ...] [--kernels auto,int8pack,dequant] [--compile 0]
Per type, a GGUF of the model with its linear weights in that type (quantized from the file's
float weights, the default Q4_1 file dequantized; a tensor whose rows are not whole blocks of
the type, K-quants on SmolLM2's 576-wide inputs, in llama.cpp's fallback type, as llama.cpp
writes it; token_embd and norms as in the source). One process per (type, kernel mode) loads it
kept (quant=None: each tensor in its own type, through the kernel chosen for it) and measures
RSS after load, bytes per linear parameter and decode tokens/s (CausalLM.decode, best of
--repeats after a warm-up), then loads the same file dequantized (quant="f32") and reports the
max and mean |logit difference| over every position of the 37-token chat prompt. The table
compares each row with the f32 row (a GGUF of float32 linears) and the mean error with q8_0's
under the same mode. --kernels: CELERYTP_QUANT_KERNEL modes, each block type under each (types
with no int4split format only under the first). CELERYTP_COMPILE=0 throughout unless --compile
(auto or 1: the kept load's decode compiles; the float32 reference never does).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


PROMPT = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5356,
    5646,
    11173,
    3365,
    3511,
    308,
    34519,
    28,
    7018,
    411,
    407,
    19712,
    8182,
    2,
    198,
    1,
    4093,
    198,
    1780,
    314,
    260,
    3575,
    282,
    4649,
    47,
    2,
    198,
    1,
    520,
    9531,
    198,
]


def one(path: str, quant: str, threads: int, tokens: int, kernel: str, ref_file: str, repeats: int) -> dict:
    import torch

    from celerytp.distributed.tp import TPContext
    from celerytp.layers.quantized import QuantizedWeight
    from celerytp.models import load_model
    from celerytp.quant.plan import quant_summary

    os.environ["CELERYTP_QUANT_KERNEL"] = kernel
    torch.set_num_threads(threads)
    base = _rss()
    t0 = time.perf_counter()
    model = load_model(path, TPContext(), quant=quant, max_context=256)
    load_s = time.perf_counter() - t0
    import gc

    gc.collect()
    rss = _rss()
    embedding = model.model.embed_tokens.qweight  # kept q8_0 on quantized loads; not a linear
    q = [m for m in model.modules() if isinstance(m, QuantizedWeight) and m is not embedding]
    linear_bytes = sum(b.nbytes for m in q for b in m.buffers())
    linear_params = sum(m.out_features * m.in_features for m in q)
    logits = model.forward_tokens(torch.tensor(PROMPT), 0)
    if quant == "f32":
        torch.save(logits, ref_file)
        err = 0.0
    else:
        ref = torch.load(ref_file)
        err = float((logits - ref).abs().max() / ref.abs().max())
    best = float("inf")  # the fastest of `repeats` runs: other processes only ever slow a run down
    for _ in range(repeats):
        model.clear_cache()
        model.forward_tokens(torch.arange(1, 17), 0)
        nxt = torch.tensor([1])
        t0 = time.perf_counter()
        for _ in range(tokens):
            nxt = model.forward_tokens(nxt, model.cache_len)[-1:].argmax(-1)
        best = min(best, time.perf_counter() - t0)
    tps = tokens / best
    types = quant_summary(model)[0]
    return {
        "quant": quant,
        "kernel": sorted({p.kernel for m in q for p in m.parts}) or ["float"],
        "types": {t: v["tensors"] for t, v in types.items()},
        "load_s": round(load_s, 2),
        "rss_mib": round((rss - base) / 2**20, 1),
        "linear_mib": round(linear_bytes / 2**20, 1),
        "bytes_per_param": round(linear_bytes / linear_params, 3) if q else 4.0,
        "linear_vs_f32": round(linear_bytes / (4 * linear_params), 3) if q else 1.0,
        "decode_tok_s": round(tps, 2),
        "logit_err": round(err, 4),
    }


LINEARS = ("attn_q.", "attn_k.", "attn_v.", "attn_output.", "ffn_gate.", "ffn_up.", "ffn_down.", "output.")
FLOAT_NAMES = ("f32", "f16", "bf16")


def write_type_gguf(src: str, dst: str, name: str) -> dict[str, int]:
    """Copy GGUF `src` to `dst` with its linear weights in ggml type `name` (quantized from the
    source's dequantized float32; rows that are not whole blocks: formats.FALLBACK, as llama.cpp);
    returns {type: tensors} of the linears written."""
    import gguf
    import numpy as np
    import torch

    from celerytp.quant import quantize_blocks
    from celerytp.quant.formats import FALLBACK, GGML_TYPES

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # the writer's own
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        if not any(k in t.name for k in LINEARS) or len(t.shape) != 2:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        fmt = name
        while fmt not in FLOAT_NAMES and w.shape[1] % gguf.GGML_QUANT_SIZES[GGML_TYPES[fmt]][0]:
            fmt = FALLBACK[fmt]
        counts[fmt] = counts.get(fmt, 0) + 1
        if fmt == "f32":
            writer.add_tensor(t.name, w)
        elif fmt == "f16":
            writer.add_tensor(t.name, w.astype(np.float16))
        else:
            qtype = GGML_TYPES[fmt]  # our codecs: gguf's bytes where gguf has a quantizer (test_quant_blocks)
            blocks = gguf.quants.quantize(w, qtype) if fmt == "bf16" else quantize_blocks(torch.from_numpy(w), qtype)
            writer.add_tensor(t.name, np.asarray(blocks), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def one_file(path: str, name: str, threads: int, tokens: int, kernel: str, repeats: int, compile_mode: str) -> dict:
    """The kept load of a --files GGUF against the same file dequantized to float32."""
    import torch

    from celerytp.distributed.tp import TPContext
    from celerytp.layers.quantized import QuantizedWeight
    from celerytp.models import load_model
    from celerytp.quant.plan import quant_summary
    from celerytp.worker.loaded_model import release_memory

    os.environ["CELERYTP_QUANT_KERNEL"] = kernel
    os.environ["CELERYTP_COMPILE"] = compile_mode
    torch.set_num_threads(threads)
    prompt = torch.tensor(PROMPT)
    release_memory()
    base = _rss()
    model = load_model(path, TPContext(), quant=None, max_context=256)
    release_memory()
    rss = _rss()
    embedding = getattr(model.model.embed_tokens, "qweight", None)  # the q8_0 embedding, not a linear
    q = [m for m in model.modules() if isinstance(m, QuantizedWeight) and m is not embedding]
    linear_bytes = sum(b.nbytes for m in q for b in m.buffers())
    linear_params = sum(m.out_features * m.in_features for m in q)
    kernels = sorted({p.kernel for m in q for p in m.parts}) or ["float"]
    types = {t: v["tensors"] for t, v in quant_summary(model)[0].items()}
    with torch.inference_mode():
        kept = model.forward_tokens(prompt, 0)
        best = float("inf")  # the fastest of `repeats` runs: other processes only ever slow a run down
        for i in range(repeats + 1):  # the serving loop's decode (compiled layers when --compile); 0: warm-up
            model.clear_cache()
            nxt = int(model.forward_tokens(torch.arange(1, 17), 0, row=0)[-1].argmax())
            t0 = time.perf_counter()
            for _ in range(tokens):
                nxt = int(model.decode([nxt], [True])[0].argmax())
            if i:
                best = min(best, time.perf_counter() - t0)
    del model
    release_memory()
    os.environ["CELERYTP_COMPILE"] = "0"
    ref_model = load_model(path, TPContext(), quant="f32", max_context=64)
    with torch.inference_mode():
        ref = ref_model.forward_tokens(prompt, 0)
    diff = (kept - ref).abs()
    agree = kept.argmax(-1) == ref.argmax(-1)
    top = ref.topk(2, dim=-1).values
    clear = top[:, 0] - top[:, 1] > 0.5
    return {
        "type": name,
        "mode": kernel,
        "kept_as": types or {"float32 (plain)": None},
        "kernel": kernels,
        "max_err": round(float(diff.max()), 4),
        "mean_err": round(float(diff.mean()), 5),
        "logit_max": round(float(ref.abs().max()), 2),
        "argmax_agree": round(float(agree.float().mean()), 3),
        "argmax_agree_clear": round(float(agree[clear].float().mean()), 3),  # f32 top-2 gap > 0.5
        "bytes_per_param": round(linear_bytes / linear_params, 3) if q else 4.0,
        "rss_mib": round((rss - base) / 2**20, 1),
        "decode_tok_s": round(tokens / best, 2),
    }


def run_files(args: argparse.Namespace) -> None:
    """--files: one GGUF per type, one process per (type, kernel mode); a markdown table out."""
    modes = args.kernels.split(",")
    root = tempfile.mkdtemp()
    print(
        f"model {args.model}, threads {args.threads}, {args.tokens} decode tokens (best of {args.repeats}), "
        f"CELERYTP_COMPILE={args.compile} for decode, load avg {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    from celerytp.layers.quantized import SPLIT_TYPES
    from celerytp.quant.formats import GGML_TYPES

    rows = []
    for name in args.types.split(","):
        path = os.path.join(root, f"{name}.gguf")
        written = write_type_gguf(args.model, path, name)
        split = any(GGML_TYPES[t] in SPLIT_TYPES for t in written)  # other modes change nothing else
        for mode in modes if split else modes[:1]:
            cmd = [sys.executable, __file__, "--model", args.model, "--threads", str(args.threads), "--tokens",
                   str(args.tokens), "--repeats", str(args.repeats), "--kernel", mode, "--compile", args.compile,
                   "--one", name, "--file", path]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{name} {mode}: failed: {out.stderr.strip().splitlines()[-1]}", flush=True)
                continue
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
        os.remove(path)
    f32 = next((r for r in rows if r["type"] == "f32"), None)
    q8 = {r["mode"]: r for r in rows if r["type"] == "q8_0"}  # each mode's q8_0 row
    print(f"\nload avg {os.getloadavg()[0]:.2f} at the end\n")
    print("| type | kernel mode | kept as (linears) | kernel | max \\|logit err\\| | mean \\|logit err\\| | "
          "mean vs q8_0 | bytes/param | RSS MiB | vs f32 | decode tok/s | vs f32 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        kept = ", ".join(t if n is None else f"{t} {n}" for t, n in r["kept_as"].items())
        ref = q8.get(r["mode"], q8.get(modes[0]))
        rel = f"{r['mean_err'] / ref['mean_err']:.2f}x" if ref and ref["mean_err"] else "-"
        rss = f"{r['rss_mib'] / f32['rss_mib']:.2f}x" if f32 else "-"
        tps = f"{r['decode_tok_s'] / f32['decode_tok_s']:.2f}x" if f32 else "-"
        print(f"| {r['type']} | {r['mode']} | {kept} | {'+'.join(r['kernel'])} | {r['max_err']} | {r['mean_err']} | "
              f"{rel} | {r['bytes_per_param']} | {r['rss_mib']:.0f} | {rss} | {r['decode_tok_s']} | {tps} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="decode runs per type; the fastest counts")
    ap.add_argument("--types", default="f32,q8_0,q8_1,q8_k,q6_k,q5_0,q5_1,q5_k,q4_0,q4_1,q4_k,q3_k,q2_k,f16,bf16")
    ap.add_argument(
        "--kernel", default="auto", help="auto (fast torch kernels), int8pack (no int4split) or dequant (exact)"
    )
    ap.add_argument("--files", action="store_true", help="per type a GGUF kept vs the same file in float32")
    ap.add_argument("--kernels", default="auto", help="--files: CELERYTP_QUANT_KERNEL modes to run, comma-separated")
    ap.add_argument("--compile", default="0", help="--files: CELERYTP_COMPILE for the kept load's decode")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ref", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from celerytp.core.model_files import default_model_path

        args.model = default_model_path()
    if args.one and args.file:
        result = one_file(args.file, args.one, args.threads, args.tokens, args.kernel, args.repeats, args.compile)
        print(json.dumps(result))
        return
    if args.files:
        run_files(args)
        return
    if args.one:
        print(json.dumps(one(args.model, args.one, args.threads, args.tokens, args.kernel, args.ref, args.repeats)))
        return
    ref = os.path.join(tempfile.mkdtemp(), "f32_logits.pt")
    print(f"model {args.model}, threads {args.threads}, {args.tokens} decode tokens, load avg {os.getloadavg()[0]:.2f}")
    for quant in args.types.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--model",
            args.model,
            "--threads",
            str(args.threads),
            "--tokens",
            str(args.tokens),
            "--kernel",
            args.kernel,
            "--one",
            quant,
            "--ref",
            ref,
            "--repeats",
            str(args.repeats),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = (
            out.stdout.strip().splitlines()[-1]
            if out.returncode == 0
            else f"{quant}: failed: {out.stderr.strip().splitlines()[-1]}"
        )
        print(line, flush=True)


if __name__ == "__main__":
    main()
