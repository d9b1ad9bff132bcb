"""Verify cost and plain decoding speed against model size, for timing only: random-weight Llama
GGUFs with SmolLM2's tokenizer, quantized by llama.cpp's own quantizer, on our integer path and on
llama.cpp (exact mode and default settings).

    python bench/experiments/size_sweep.py --out bench/results/size-sweep [--sizes 135m,0.5b,1b] [--types q4_k_m,q8_0]

Writes ``sweep.json`` and ``sweep.md`` (a table, and the machine's measured memory bandwidth with
each path's one-token step as a share of the bandwidth floor), plus a chart ``verify_cost.png``.
The files are made in a scratch folder (``--work``, default the cache folder) and reused."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

# Llama shapes: hidden, layers, feed-forward, heads, KV heads
SIZES = {"135m": (576, 30, 1536, 9, 3), "0.5b": (1024, 32, 4096, 16, 4), "1b": (2048, 16, 8192, 32, 8),
         "3b": (3072, 28, 8192, 24, 8)}
TYPES = {"q4_k_m": 15, "q8_0": 7, "q5_0": 8, "q4_1": 3}


def make_f16(path: Path, shape, template: Path) -> None:
    """A random-weight Llama GGUF (float16) with the template file's tokenizer metadata."""
    import gguf

    hidden, layers, ffn, heads, kv = shape
    r = gguf.GGUFReader(str(template))
    w = gguf.GGUFWriter(str(path), "llama")
    skip = ("general.architecture", "llama.", "general.file_type", "GGUF.")
    for f in r.fields.values():
        if f.name.startswith(skip):
            continue
        t = f.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            w.add_array(f.name, f.contents())
        else:
            w.add_key_value(f.name, f.contents(), t)
    vocab = len(r.fields["tokenizer.ggml.tokens"].contents())
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(1)
    rng = np.random.default_rng(0)

    def t(name, *dims, norm=False):  # ggml order: the contiguous dimension last in numpy
        a = np.ones(dims, np.float32) if norm else (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)
        w.add_tensor(name, a)

    d = hidden // heads
    t("token_embd.weight", vocab, hidden)
    t("output_norm.weight", hidden, norm=True)
    for i in range(layers):
        t(f"blk.{i}.attn_norm.weight", hidden, norm=True)
        t(f"blk.{i}.attn_q.weight", heads * d, hidden)
        t(f"blk.{i}.attn_k.weight", kv * d, hidden)
        t(f"blk.{i}.attn_v.weight", kv * d, hidden)
        t(f"blk.{i}.attn_output.weight", hidden, heads * d)
        t(f"blk.{i}.ffn_norm.weight", hidden, norm=True)
        t(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        t(f"blk.{i}.ffn_up.weight", ffn, hidden)
        t(f"blk.{i}.ffn_down.weight", hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(src: Path, dst: Path, ftype: int) -> None:
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = ftype
    p.nthread = os.cpu_count() or 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), p) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src}")


def bandwidth_gbs() -> float:
    """Sustained read bandwidth with torch's threads: summing a 1 GiB tensor (best of 5), GB/s."""
    a = torch.ones(1 << 28, dtype=torch.float32)
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best / 1e9


def decode_tps(backend, n: int = 48) -> float:
    ids = torch.randint(100, 20000, (64 + n,), generator=torch.Generator().manual_seed(1))
    backend.reset()
    backend.forward(ids[:64], 0)
    t = time.perf_counter()
    for i in range(64, 64 + n):
        backend.forward(ids[i: i + 1], i)
    return n / (time.perf_counter() - t)


def measure(path: Path, threads: int) -> dict:
    from forerun.backends.llamacpp import LlamaCppBackend, LlamaCppModel
    from forerun.bench import verify_cost_ratios
    from forerun.models import load_model

    out = {}
    lm = load_model(str(path), backend="torch", threads=threads)
    paths = {"forerun": lm.backend}
    for name, exact in (("llama.cpp exact", True), ("llama.cpp default", False)):
        paths[name] = LlamaCppBackend(LlamaCppModel(str(path), exact=exact), threads=threads, max_context=512,
                                      fast_greedy=False)
    for name, be in paths.items():
        r = verify_cost_ratios(be, context=200, ks=range(1, 9), reps=5)
        out[name] = {"step_ms": r["step_ms"], "ratios": {k: r[str(k)] for k in range(1, 9)},
                     "decode_tps": decode_tps(be)}
        print(f"  {name}: step {r['step_ms']:.1f} ms, K=1 {r['1']:.2f}, K=4 {r['4']:.2f}, "
              f"decode {out[name]['decode_tps']:.1f} tok/s", flush=True)
    out["forerun"]["weight_mb"] = (sum(q.nbytes for q in lm.backend.model.quant) + lm.backend.model.lm_head.qlin.nbytes) / 1e6 \
        if lm.backend.model.quant else None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="135m,0.5b,1b,3b")
    ap.add_argument("--types", default="q4_k_m,q8_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from forerun.models import smollm2_gguf_path
    from forerun.paths import cache_dir

    work = Path(args.work) if args.work else cache_dir() / "size-sweep"
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"bandwidth_gbs": bandwidth_gbs(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "threads": args.threads, "runs": {}}
    print(f"memory bandwidth {res['bandwidth_gbs']:.1f} GB/s", flush=True)
    for size in args.sizes.split(","):
        f16 = work / f"random-{size}-f16.gguf"
        if not f16.exists():
            make_f16(f16, SIZES[size], smollm2_gguf_path())
        for typ in args.types.split(","):
            q = work / f"random-{size}-{typ}.gguf"
            if not q.exists():
                quantize(f16, q, TYPES[typ])
            print(f"{size} {typ} ({q.stat().st_size / 1e6:.0f} MB):", flush=True)
            res["runs"][f"{size} {typ}"] = {"file_mb": q.stat().st_size / 1e6, **measure(q, args.threads)}
            (out / "sweep.json").write_text(json.dumps(res, indent=1))
    write_md(res, out)
    return 0


def write_md(res: dict, out: Path) -> None:
    bw = res["bandwidth_gbs"]
    lines = [f"Size sweep, {res['date']}, {res['threads']} threads; memory bandwidth (torch sum of 1 GiB) "
             f"{bw:.1f} GB/s. Random weights, SmolLM2's tokenizer; timing only.", "",
             "| model | file MB | path | one-token step ms | floor ms (file / bandwidth) | K=1 | K=2 | K=4 | K=8 | plain decoding tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key, run in res["runs"].items():
        floor = run["file_mb"] / 1e3 / bw * 1e3
        for name in ("forerun", "llama.cpp exact", "llama.cpp default"):
            r = run[name]
            lines.append(f"| {key} | {run['file_mb']:.0f} | {name} | {r['step_ms']:.1f} | {floor:.1f} | "
                         + " | ".join(f"{r['ratios'][k]:.2f}" for k in (1, 2, 4, 8)) + f" | {r['decode_tps']:.1f} |")
    (out / "sweep.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(res["runs"]), figsize=(4 * len(res["runs"]), 3.4), squeeze=False)
        for ax, (key, run) in zip(axes[0], res["runs"].items()):
            for name, style in (("forerun", "-o"), ("llama.cpp exact", "--s"), ("llama.cpp default", ":^")):
                ax.plot(range(1, 9), [run[name]["ratios"][k] for k in range(1, 9)], style, label=name)
            ax.axhline(1.0, color="grey", lw=0.5)
            ax.set_title(key)
            ax.set_xlabel("K (pass of K + 1 rows)")
        axes[0][0].set_ylabel("pass / one-token step")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "verify_cost.png", dpi=110)
    except ImportError:
        pass


if __name__ == "__main__":
    sys.exit(main())
