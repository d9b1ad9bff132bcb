"""The GPU check behind ``bench/gpu_check.sh``: random-weight Llama models made here, then one table.

For each model (SmolLM2-135M's shape and Llama-3.2-1B's, random weights, a byte-level tokenizer:
timing and equality only, no acceptance figures) and dtype:
- the one-token step, and its ratio to the memory floor (the weights' bytes over the bandwidth of
  a device-to-device copy measured here);
- the verify cost: a pass of K + 1 rows over a one-token step, K = 1..15;
- plain decoding, ngram and suffix, tokens/s over the prompts (greedy, every output checked equal
  to plain decoding), and transformers' ``generate()`` on the same prompts (dynamic and static cache);
- the batch check: 16 requests in one batch engine give each the text it gets alone.

    python bench/gpu_check.py --out DIR [--device cuda] [--models m135,m1b] [--dtypes bfloat16,float16]

``--quick`` makes it small enough for a CPU (tiny shapes, short prompts): what the tests run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from forerun.backends.native import NativeBackend  # noqa: E402
from forerun.batching import BatchEngine, BatchRequest  # noqa: E402
from forerun.drafters import make_drafter  # noqa: E402
from forerun.engine import Engine  # noqa: E402
from forerun.models import LoadedModel  # noqa: E402

SHAPES = {  # Llama shapes: SmolLM2-135M's and Llama-3.2-1B's
    "m135": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, rope_theta=100000.0, vocab_size=49152),
    "m1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, rope_theta=500000.0, vocab_size=49152),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=10000.0, vocab_size=512),
}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs (after one untimed run)."""
    fn()
    out = []
    for _ in range(reps):
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def copy_bandwidth(dev: torch.device) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read + write counted once each)."""
    n = (1 << 30) if dev.type == "cuda" else (1 << 26)
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    return 2 * n / timed(lambda: b.copy_(a), dev, 5)


def byte_tokenizer(vocab: int):
    """A byte-level tokenizer (256 byte tokens, the rest of the vocabulary unused): no files needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_map = {bytes([i]).decode("latin-1"): i for i in range(256)}
    vocab_map.update({f"<unused{i}>": i for i in range(256, vocab)})
    tk = Tokenizer(models.BPE(vocab=vocab_map, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def make_model(shape: str, dtype, dev):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    return model


def prompts(path: Path, tok, limit_chars: int) -> list[list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [tok(r["turns"][0][:limit_chars]).input_ids or [65] for r in rows]


def generate_all(be, drafter, ids_list, new, k="auto"):
    """(outputs, tokens/s over all prompts, prefill included)."""
    eng = Engine(be, drafter, ())  # no EOS: every answer is ``new`` tokens long
    outs, total = [], 0.0
    for ids in ids_list:
        sync(be.device)
        t = time.perf_counter()
        outs.append(eng.generate(ids, max_new_tokens=new, k=k).token_ids)
        sync(be.device)
        total += time.perf_counter() - t
    return outs, sum(len(o) for o in outs) / total


def hf_generate(model, ids_list, new, static: bool):
    dev = model.device
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"
    model.generate(torch.tensor([ids_list[0]], device=dev), **kw)  # warm-up (and compilation)
    total, n = 0.0, 0
    for ids in ids_list:
        sync(dev)
        t = time.perf_counter()
        out = model.generate(torch.tensor([ids], device=dev), **kw)
        sync(dev)
        total += time.perf_counter() - t
        n += out.shape[1] - len(ids)
    return n / total


def check_model(shape, dtype, dev, args, bandwidth, log, full: bool = True) -> dict:
    """One model in one dtype; ``full``: also the batch check and the transformers peers (the first
    dtype only: the check's time goes where the comparison is)."""
    model = make_model(shape, dtype, dev)
    tok = byte_tokenizer(model.config.vocab_size)
    be = NativeBackend(model, fixed_rows=True if args.fixed_rows else None)
    lm = LoadedModel(name=f"random-{shape}", hf_model=model, tokenizer=tok, backend=be, eos_token_ids=set())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    row = {"model": shape, "dtype": str(dtype).replace("torch.", ""), "params_M": round(weight_bytes / 2 / 1e6, 1),
           "fixed_rows": be._fixed is not None}
    ids = torch.randint(300, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    if be._fixed is not None:  # the graphs of every key span the prompts reach, with a progress bar
        row["graphs"] = be._fixed.prepare(be, 4096)
    row["capture_s"] = round(time.perf_counter() - t0, 2)
    be.reset()
    t0 = time.perf_counter()
    be.forward(ids[:256], 0, logits=False)
    be.forward(ids[256:257], 256)  # first passes: CUDA graphs captured here
    sync(dev)
    row["first_passes_s"] = round(time.perf_counter() - t0, 2)

    def run(n):
        be.truncate(257)
        be.forward(ids[257: 257 + n], 257)

    step = timed(lambda: run(1), dev, args.reps)
    row["step_ms"] = round(step * 1e3, 3)
    row["floor_ms"] = round(weight_bytes / bandwidth * 1e3, 3)
    row["step_vs_floor"] = round(step * bandwidth / weight_bytes, 2)
    row["verify_cost"] = {k: round(timed(lambda k=k: run(k + 1), dev, args.reps) / step, 3) for k in range(1, 16)}
    log(f"{shape} {row['dtype']}: step {row['step_ms']} ms ({row['step_vs_floor']}x the floor), "
        f"16 rows {row['verify_cost'][15]} steps")
    plist = prompts(args.prompts, tok, args.prompt_chars)
    plain, row["tok_s_none"] = generate_all(be, None, plist, args.new)
    row["equal"] = {}
    for method in ("ngram", "suffix"):
        outs, row[f"tok_s_{method}"] = generate_all(be, make_drafter(method, lm), plist, args.new)
        row["equal"][method] = f"{sum(a == b for a, b in zip(outs, plain))}/{len(plain)}"
    log(f"{shape} {row['dtype']}: none {row['tok_s_none']:.1f} tok/s, ngram {row['tok_s_ngram']:.1f}, "
        f"suffix {row['tok_s_suffix']:.1f}; equal {row['equal']}")
    row["batch16_equal"] = "-"
    if full:
        # the batch check: 16 requests at once, each the text it gets alone
        reqs = [BatchRequest(prompt=list(plist[i % len(plist)]), max_new_tokens=args.new // 2) for i in range(16)]
        alone = [Engine(be, make_drafter("ngram", lm), ()).generate(r.prompt, max_new_tokens=args.new // 2).token_ids
                 for r in reqs]
        eng = BatchEngine(be, (), drafter=make_drafter("ngram", lm), max_batch=16)
        got: dict = {}
        for r in reqs:
            r.on_event = (lambda r: lambda toks, fin: got.setdefault(r.id, []).extend(toks))(r)
            eng.submit(r)
        while eng.active or eng.waiting:
            eng.step()
        row["batch16_equal"] = f"{sum(got.get(r.id) == a for r, a in zip(reqs, alone))}/16"
    if full and not args.no_hf:
        for static in (False, True):
            key = "tok_s_hf_static" if static else "tok_s_hf_dynamic"
            try:
                row[key] = round(hf_generate(model, plist, args.hf_new, static), 1)
            except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                row[key] = f"failed: {type(e).__name__}"
        log(f"{shape} {row['dtype']}: transformers generate() dynamic {row['tok_s_hf_dynamic']}, static {row['tok_s_hf_static']}")
    for k in ("tok_s_none", "tok_s_ngram", "tok_s_suffix"):
        row[k] = round(row[k], 1)
    return row  # the model and its caches go with this frame (main empties CUDA's cache after)


def table(rows: list[dict]) -> str:
    head = ("| model | dtype | step ms | floor ms | step/floor | 16 rows / step | none tok/s | ngram | suffix "
            "| hf dynamic | hf static | greedy = none (ngram, suffix) | batch of 16 = alone |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        lines.append(f"| {r['model']} | {r['dtype']} | {r['step_ms']} | {r['floor_ms']} | {r['step_vs_floor']} "
                     f"| {r['verify_cost'][15]} | {r['tok_s_none']} | {r['tok_s_ngram']} | {r['tok_s_suffix']} "
                     f"| {r.get('tok_s_hf_dynamic', '-')} | {r.get('tok_s_hf_static', '-')} "
                     f"| {r['equal']['ngram']}, {r['equal']['suffix']} | {r['batch16_equal']} |")
    lines.append("")
    lines.append("Verify cost (pass of K + 1 rows / one-token step), K = 1..15:")
    for r in rows:
        lines.append(f"- {r['model']} {r['dtype']}: " + ", ".join(f"{v:.2f}" for v in r["verify_cost"].values()))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default="m135,m1b")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--prompts", type=Path, default=ROOT / "bench/data/gpu_prompts.jsonl")
    ap.add_argument("--prompt-chars", type=int, default=1200, help="each prompt's first N characters (bytes = tokens)")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--hf-new", type=int, default=64, help="tokens per prompt for transformers' generate() (slow: fewer)")
    ap.add_argument("--no-hf", action="store_true", help="leave transformers' generate() out")
    ap.add_argument("--fixed-rows", action="store_true", help="fixed-shape passes on the CPU too (as on a GPU)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, short prompts: a CPU run of the script itself")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.prompt_chars, args.new, args.reps, args.hf_new = "tiny", 60, 16, 2, 16
    dev = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    bandwidth = copy_bandwidth(dev)
    info = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
            "copy_GBps": round(bandwidth / 1e9, 1), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    log(f"{info['device']}, torch {info['torch']}, device copy {info['copy_GBps']} GB/s")
    rows = []
    for shape in args.models.split(","):
        for i, name in enumerate(args.dtypes.split(",")):
            rows.append(check_model(shape, getattr(torch, name), dev, args, bandwidth, log, full=i == 0))
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            (out / "gpu_check.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    text = table(rows)
    (out / "gpu_check.md").write_text(f"{info['device']}, torch {info['torch']}, {info['date']}\n\n{text}\n")
    print(text)
    whole = lambda v: v.split("/")[0] == v.split("/")[1]  # noqa: E731
    bad = [r for r in rows if (r["batch16_equal"] != "-" and not whole(r["batch16_equal"]))
           or not all(whole(v) for v in r["equal"].values())]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
