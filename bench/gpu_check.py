"""The GPU check behind ``bench/gpu_check.sh``: random-weight Llama models made here, then one table.

For each model (SmolLM2-135M's shape and Llama-3.2-1B's, random weights, a byte-level tokenizer:
timing and equality only, no acceptance figures) and dtype, in a process of its own with its own
time limit:
- the one-token step, and its ratio to the memory floor (the weights' bytes over the bandwidth of
  a device-to-device copy measured here), and a profile of it (the 15 costliest kernels, kernels
  and host calls per step, kernels per layer of the eager pass);
- the verify cost: a pass of K + 1 rows over a one-token step, K = 1..15;
- plain decoding, ngram, suffix chains and suffix trees: decode-only tokens/s over the prompts
  (greedy; every output checked equal to plain decoding);
- the batch check: 16 requests in one batch engine (suffix trees) give each the text it gets alone;
- CUDA graphs captured and replayed; a failed capture is an error of the row.
Then the CUDA test subset (``bench/gpu/cuda_tests.txt``, its whole log kept), then the peers:
transformers' ``generate()`` on the same prompts, dynamic and static cache, each with its own limit.
Every part writes its figures as it finishes (``gpu_check.json``, ``gpu_check.md`` in ``--out``),
so a part that fails or runs out of time loses only itself; the time each part took is printed.

    python bench/gpu_check.py --out DIR [--device cuda] [--models m135,m1b] [--dtypes bfloat16,float16]
                              [--tests] [--budget SECONDS]

``--quick`` makes it small enough for a CPU (tiny shapes, short prompts): what the tests and the
GPU rehearsal (``bench/gpu/rehearse.py``) run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SHAPES = {  # Llama shapes: SmolLM2-135M's and Llama-3.2-1B's
    "m135": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, rope_theta=100000.0, vocab_size=49152),
    "m1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, rope_theta=500000.0, vocab_size=49152),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=10000.0, vocab_size=512),
}
METHODS = {"ngram": ("ngram", None), "suffix": ("suffix", None), "suffix-tree": ("suffix", (16, None))}
LIMIT_OURS, LIMIT_TESTS, LIMIT_PEER = 100, 170, 75  # seconds a part may take (the budget may cut them)
RESERVE_TESTS = 90  # seconds of the budget our rows leave to the tests
# "MODEL-DTYPE:STAGE": that row stops at the start of that stage until it is cut (the tests' way to
# show that a part which runs out of time loses only what it had not finished)
STALL = os.environ.get("FORERUN_GPU_CHECK_STALL", "")


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
    """(outputs, decode-only tokens/s over all prompts: the prefill left out)."""
    from forerun.engine import Engine

    eng = Engine(be, drafter, ())  # no EOS: every answer is ``new`` tokens long
    outs, decode_s = [], 0.0
    for ids in ids_list:
        res = eng.generate(ids, max_new_tokens=new, k=k)
        outs.append(res.token_ids)
        decode_s += res.stats.wall_s - res.stats.prefill_s
    return outs, sum(len(o) for o in outs) / decode_s


# -- one model in one dtype, in a process of its own -------------------------------------------
class Row:
    """A row of the table, written to ``path`` whenever a stage ends (a killed process leaves what
    it finished); a stage that raises is noted in ``errors`` and the next stage still runs."""

    def __init__(self, path: Path, **fields):
        self.path, self.data = path, {**fields, "errors": []}
        self.save()

    def save(self):
        self.path.write_text(json.dumps(self.data, indent=1))

    def stage(self, name, fn, log):
        if STALL == f"{self.data['model']}-{self.data['dtype']}:{name}":
            time.sleep(1e6)
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one stage's failure is reported in the table, not fatal
            self.data["errors"].append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
            log(f"{self.data['model']} {self.data['dtype']}: {name} FAILED\n{traceback.format_exc()}")
        self.data.setdefault("stage_s", {})[name] = round(time.perf_counter() - t0, 1)
        self.save()


def profile_step(be, run, dev, steps: int = 20) -> dict:
    """The one-token step under torch's profiler: its 15 costliest kernels (CUDA) or operators (CPU)
    with calls and microseconds per step, kernels and host calls per step; and the eager pass's
    kernels per layer (graphs off), which is what a graph replays."""
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def trace(fn):
        fn()
        sync(dev)
        with profile(activities=acts) as prof:
            for _ in range(steps):
                fn()
            sync(dev)
        return prof.events()

    def device_events(events):
        if not cuda:  # operators on the CPU: the top-level aten calls
            return [(e.name, e.self_cpu_time_total) for e in events if e.name.startswith("aten::") and e.cpu_parent is None]
        return [(e.name, e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
                for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]

    out = {"unit": "kernels" if cuda else "operators"}
    events = trace(run)
    kern = device_events(events)
    top: dict = {}
    for name, us in kern:
        c, t = top.get(name, (0, 0.0))
        top[name] = (c + 1, t + us)
    out["top"] = [{"name": n[:90], "per_step": round(c / steps, 2), "us_per_step": round(t / steps, 2)}
                  for n, (c, t) in sorted(top.items(), key=lambda kv: -kv[1][1])[:15]]
    out["kernels_per_step"] = round(len(kern) / steps, 1)
    out["device_us_per_step"] = round(sum(us for _, us in kern) / steps, 1)
    host = {}
    for e in events:
        if e.name.startswith("cuda") and e.name[4:5].isupper():  # runtime calls: launches, copies, syncs
            host[e.name] = host.get(e.name, 0) + 1
    out["host_calls_per_step"] = {k: round(v / steps, 2) for k, v in sorted(host.items(), key=lambda kv: -kv[1])}
    fixed = be.model.fixed
    if fixed is not None:  # the eager pass: what a graph holds
        off = fixed.graphs_off
        fixed.graphs_off = True
        try:
            eager = device_events(trace(run))
        finally:
            fixed.graphs_off = off
        out["eager_kernels_per_step"] = round(len(eager) / steps, 1)
        out["eager_kernels_per_layer"] = round(len(eager) / steps / be.num_layers, 1)
    return out


def check_model(shape, dtype, dev, args, bandwidth, log, path: Path, full: bool) -> None:
    """One model in one dtype, its row written to ``path`` stage by stage. ``full``: the profile too
    (the first dtype: the check's time goes where the comparison is)."""
    from forerun.backends.native import NativeBackend
    from forerun.batching import BatchEngine, BatchRequest
    from forerun.drafters import make_drafter
    from forerun.engine import Engine
    from forerun.models import LoadedModel

    model = make_model(shape, dtype, dev)
    tok = byte_tokenizer(model.config.vocab_size)
    be = NativeBackend(model, fixed_rows=True if args.fixed_rows else None)
    lm = LoadedModel(name=f"random-{shape}", hf_model=model, tokenizer=tok, backend=be, eos_token_ids=set())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    row = Row(path, model=shape, dtype=str(dtype).replace("torch.", ""), params_M=round(weight_bytes / 2 / 1e6, 1),
              fixed_rows=be.model.fixed is not None)
    d = row.data
    ids = torch.randint(300, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(0))

    def prepare():
        t0 = time.perf_counter()
        if be.model.fixed is not None:  # the graphs of every key span the prompts reach
            d["graphs_prepared"] = be.prepare_graphs(4096, progress=False)
        d["capture_s"] = round(time.perf_counter() - t0, 2)
        be.reset()
        t0 = time.perf_counter()
        be.forward(ids[:256], 0, logits=False)
        be.forward(ids[256:257], 256)
        sync(dev)
        d["first_passes_s"] = round(time.perf_counter() - t0, 2)

    def run(n):
        be.truncate(257)
        be.forward(ids[257: 257 + n], 257)

    def steps():
        step = timed(lambda: run(1), dev, args.reps)
        d["step_ms"] = round(step * 1e3, 3)
        d["floor_ms"] = round(weight_bytes / bandwidth * 1e3, 3)
        d["step_vs_floor"] = round(step * bandwidth / weight_bytes, 2)
        d["verify_cost"] = {k: round(timed(lambda k=k: run(k + 1), dev, args.reps) / step, 3) for k in range(1, 16)}
        log(f"{shape} {d['dtype']}: step {d['step_ms']} ms ({d['step_vs_floor']}x the floor), "
            f"16 rows {d['verify_cost'][15]} steps")

    plist = prompts(args.prompts, tok, args.prompt_chars)
    plain = []

    def decoding():
        outs, d["tok_s_none"] = generate_all(be, None, plist, args.new)
        plain.extend(outs)
        d["equal"] = {}
        for name, (method, tree) in METHODS.items():
            outs, d[f"tok_s_{name}"] = generate_all(be, make_drafter(method, lm, tree=tree), plist, args.new)
            d["equal"][name] = f"{sum(a == b for a, b in zip(outs, plain))}/{len(plain)}"
            row.save()
        log(f"{shape} {d['dtype']}: decode tok/s none {d['tok_s_none']:.1f}, "
            + ", ".join(f"{n} {d['tok_s_' + n]:.1f}" for n in METHODS) + f"; equal {d['equal']}")

    def batch():  # 16 requests at once (suffix trees), each the text it gets alone
        new = args.new // 2
        reqs = [BatchRequest(prompt=list(plist[i % len(plist)]), max_new_tokens=new) for i in range(16)]
        drafter = lambda: make_drafter("suffix", lm, tree=(16, None))  # noqa: E731
        alone = [Engine(be, drafter(), ()).generate(r.prompt, max_new_tokens=new).token_ids for r in reqs]
        eng = BatchEngine(be, (), drafter=drafter(), max_batch=16)
        got: dict = {}
        for r in reqs:
            r.on_event = (lambda r: lambda toks, fin: got.setdefault(r.id, []).extend(toks))(r)
            eng.submit(r)
        while eng.active or eng.waiting:
            eng.step()
        d["batch16_equal"] = f"{sum(got.get(r.id) == a for r, a in zip(reqs, alone))}/16"

    def profile():
        be.reset()  # the decoding and batch stages used the cache: the step's context again
        be.forward(ids[:257], 0, logits=False)
        d["profile"] = profile_step(be, lambda: run(1), dev)

    row.stage("prepare", prepare, log)
    row.stage("steps", steps, log)
    row.stage("decoding", decoding, log)
    row.stage("batch", batch, log)
    if full:
        row.stage("profile", profile, log)
    if be.model.fixed is not None:
        d["graphs"] = {**be.model.fixed.stats(), "off": be.model.fixed.graphs_off}
        if d["graphs"]["failed"]:
            d["errors"].append(f"CUDA graph capture failed {len(d['graphs']['failed'])} times: {d['graphs']['failed'][0]}")
    for k in [k for k in d if k.startswith("tok_s_")]:
        d[k] = round(d[k], 1)
    row.save()


def hf_peers(shape, dtype, dev, args, log, path: Path) -> None:
    """transformers' ``generate()`` on the same prompts, dynamic then static cache, each under its
    own alarm (``LIMIT_PEER``); tokens/s (prefill included) written as each finishes."""
    model = make_model(shape, dtype, dev)
    tok = byte_tokenizer(model.config.vocab_size)
    plist = prompts(args.prompts, tok, args.prompt_chars)
    row = Row(path, model=shape, dtype=str(dtype).replace("torch.", ""))

    def alarm(*_):
        raise TimeoutError(f"over {args.peer_limit} s")

    signal.signal(signal.SIGALRM, alarm)
    for static in (False, True):
        key = "tok_s_hf_static" if static else "tok_s_hf_dynamic"
        kw = dict(max_new_tokens=args.hf_new, min_new_tokens=args.hf_new, do_sample=False, pad_token_id=0)
        if static:
            kw["cache_implementation"] = "static"
        t0 = time.perf_counter()
        signal.alarm(args.peer_limit)
        try:
            model.generate(torch.tensor([plist[0]], device=dev), **kw)  # warm-up (and compilation)
            sync(dev)
            row.data[key.replace("tok_s", "warmup_s")] = round(time.perf_counter() - t0, 1)
            total, n = 0.0, 0
            for ids in plist:
                sync(dev)
                t = time.perf_counter()
                out = model.generate(torch.tensor([ids], device=dev), **kw)
                sync(dev)
                total += time.perf_counter() - t
                n += out.shape[1] - len(ids)
            row.data[key] = round(n / total, 1)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run (or runs out of time) is reported, not fatal
            row.data[key] = f"failed: {type(e).__name__}: {str(e)[:120]}"
        finally:
            signal.alarm(0)
        row.data[key.replace("tok_s", "s")] = round(time.perf_counter() - t0, 1)
        row.save()
        log(f"{shape} {row.data['dtype']}: transformers generate() {'static' if static else 'dynamic'} {row.data[key]}")


# -- the driver --------------------------------------------------------------------------------
def table(info: dict, rows: list[dict], peers: dict, tests: dict | None, times: list) -> str:
    cols = ["model", "dtype", "step ms", "floor ms", "step/floor", "16 rows / step", "none tok/s", "ngram",
            "suffix", "suffix tree", "hf dynamic", "hf static", "greedy = none (ngram, suffix, tree)",
            "batch of 16 = alone", "graphs captured/replayed", "errors"]
    lines = [f"{info['device']}, torch {info['torch']}, device copy {info['copy_GBps']} GB/s, {info['date']}", "",
             "Decode-only tokens/s (prefill left out); transformers' generate(): tokens/s with its prefill.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    shown = set()  # the peers go on each model's first row
    for r in rows:
        g = r.get("graphs")
        eq = r.get("equal", {})
        p = {} if r["model"] in shown else peers.get(r["model"], {})
        shown.add(r["model"])
        cells = [r["model"], r["dtype"], r.get("step_ms", "-"), r.get("floor_ms", "-"), r.get("step_vs_floor", "-"),
                 r.get("verify_cost", {}).get("15", r.get("verify_cost", {}).get(15, "-")), r.get("tok_s_none", "-"),
                 r.get("tok_s_ngram", "-"), r.get("tok_s_suffix", "-"), r.get("tok_s_suffix-tree", "-"),
                 p.get("tok_s_hf_dynamic", "-"), p.get("tok_s_hf_static", "-"),
                 ", ".join(eq.get(m, "-") for m in METHODS), r.get("batch16_equal", "-"),
                 "off" if not g or g.get("off") else f"{g['captured']}/{g['replayed']}",
                 "; ".join(r.get("errors", [])) or "-"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "Verify cost (pass of K + 1 rows / one-token step), K = 1..15:"]
    for r in rows:
        if r.get("verify_cost"):
            lines.append(f"- {r['model']} {r['dtype']}: " + ", ".join(f"{v:.2f}" for v in r["verify_cost"].values()))
    for r in rows:
        prof = r.get("profile")
        if not prof:
            continue
        u = prof.get("unit", "kernels")
        lines += ["", f"Profile of the one-token step, {r['model']} {r['dtype']}: {prof['kernels_per_step']} {u} "
                  f"a step ({prof['device_us_per_step']} us); eager pass: "
                  f"{prof.get('eager_kernels_per_step', '-')} {u} a step, {prof.get('eager_kernels_per_layer', '-')} "
                  f"a layer; host calls a step: {prof['host_calls_per_step'] or '-'}", "",
                  f"| {u[:-1]} | calls a step | us a step |", "|---|---|---|"]
        lines += [f"| `{t['name']}` | {t['per_step']} | {t['us_per_step']} |" for t in prof["top"]]
    if tests is not None:
        lines += ["", f"CUDA test subset: {tests.get('summary', '-')} (rc {tests.get('rc')}; log: tests.log)"]
        lines += [f"- {f}" for f in tests.get("failed", [])]
    lines += ["", "Time per part: " + ", ".join(f"{name} {s:.0f} s" for name, s in times)]
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
    ap.add_argument("--tests", action="store_true", help="run the CUDA test subset (bench/gpu/cuda_tests.txt) too")
    ap.add_argument("--fixed-rows", action="store_true", help="fixed-shape passes on the CPU too (as on a GPU)")
    ap.add_argument("--budget", type=float, default=330.0, help="seconds for the whole check; parts past it are cut")
    ap.add_argument("--row-limit", type=int, default=LIMIT_OURS, help="seconds one model and dtype may take")
    ap.add_argument("--peer-limit", type=int, default=LIMIT_PEER, help="seconds one transformers peer may take")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, short prompts: a CPU run of the script itself")
    ap.add_argument("--part", help=argparse.SUPPRESS)  # internal: one part, in its own process
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.prompt_chars, args.new, args.reps, args.hf_new = "tiny", 60, 16, 2, 16
    dev = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    if args.part:
        kind, shape, dtype, target = args.part.split(":", 3)
        if kind == "ours":
            bandwidth = float(os.environ["FORERUN_GPU_CHECK_BW"])
            check_model(shape, getattr(torch, dtype), dev, args, bandwidth, log, Path(target),
                        full=os.environ.get("FORERUN_GPU_CHECK_FULL") == "1")
        else:
            hf_peers(shape, getattr(torch, dtype), dev, args, log, Path(target))
        return 0

    start = time.perf_counter()
    left = lambda: args.budget - (time.perf_counter() - start)  # noqa: E731
    bandwidth = copy_bandwidth(dev)
    info = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
            "copy_GBps": round(bandwidth / 1e9, 1), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    log(f"{info['device']}, torch {info['torch']}, device copy {info['copy_GBps']} GB/s")
    rows, peers, tests, times = [], {}, None, []
    parts = Path(tempfile.mkdtemp(prefix="forerun-gpu-check-"))  # per-part files (``--out`` keeps few files)
    passthrough = list(argv if argv is not None else sys.argv[1:])

    def write():
        (out / "gpu_check.json").write_text(json.dumps({"machine": info, "rows": rows, "peers": peers, "tests": tests,
                                                         "times": times}, indent=1))
        (out / "gpu_check.md").write_text(table(info, rows, peers, tests, times) + "\n")

    def part(name, spec, limit, env=None, reserve=0.0):
        """One part in its own process, cut at ``limit`` seconds or where the budget, less
        ``reserve`` seconds kept for later parts, runs out; what its file holds by then."""
        target = parts / f"{name}.json"
        limit = int(min(limit, left() - reserve))
        t0 = time.perf_counter()
        if limit < 5:
            log(f"[{name}] skipped: the budget is spent")
            times.append((name, 0.0))
            return {"errors": ["skipped: the check's time budget was spent"]}
        cmd = [sys.executable, __file__, *passthrough, "--part", f"{spec}:{target}"]
        try:
            r = subprocess.run(cmd, timeout=limit, env={**os.environ, **(env or {})}, text=True,
                               stdout=sys.stdout, stderr=subprocess.STDOUT)
            why = None if r.returncode == 0 else f"exit {r.returncode}"
        except subprocess.TimeoutExpired:
            why = f"over its {limit} s limit"
        took = time.perf_counter() - t0
        times.append((name, took))
        log(f"[{name}] {took:.0f} s" + (f": {why}" if why else ""))
        got = json.loads(target.read_text()) if target.exists() else {}
        if why:
            got.setdefault("errors", []).append(f"cut: {why}")
        return got

    for shape in args.models.split(","):
        for i, name in enumerate(args.dtypes.split(",")):
            got = part(f"{shape}-{name}", f"ours:{shape}:{name}", args.row_limit,
                       {"FORERUN_GPU_CHECK_BW": str(bandwidth), "FORERUN_GPU_CHECK_FULL": "1" if i == 0 else "0"},
                       reserve=RESERVE_TESTS if args.tests else 0.0)
            rows.append({"model": shape, "dtype": name, **got})
            write()
    if args.tests:
        tests = run_tests(dev, out, int(min(LIMIT_TESTS, left())), log)
        times.append(("tests", tests["s"]))
        write()
    if not args.no_hf:
        for shape in args.models.split(","):
            first = args.dtypes.split(",")[0]
            peers[shape] = part(f"{shape}-transformers", f"peers:{shape}:{first}", 2 * args.peer_limit + 30)
            write()
    write()
    text = table(info, rows, peers, tests, times)
    print(text)
    whole = lambda v: "/" in v and v.split("/")[0] == v.split("/")[1]  # noqa: E731
    bad = [r for r in rows if r.get("errors") or not r.get("equal") or not all(whole(v) for v in r["equal"].values())
           or not whole(r.get("batch16_equal", "-"))]
    if tests is not None and tests["rc"] != 0:
        bad.append(tests)
    return 1 if bad else 0


def run_tests(dev, out: Path, limit: int, log) -> dict:
    """The CUDA test subset, its whole log in ``out/tests.log``: summary, failures, exit status."""
    ids = [l.strip() for l in (ROOT / "bench/gpu/cuda_tests.txt").read_text().splitlines()
           if l.strip() and not l.startswith("#")]
    env = {**os.environ, "FORERUN_TEST_DEVICE": dev.type}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-m", "not bundled", *ids]
    t0 = time.perf_counter()
    with open(out / "tests.log", "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=max(limit, 1)).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    took = time.perf_counter() - t0
    text = (out / "tests.log").read_text(errors="replace").splitlines()
    summary = next((l.strip("= ") for l in reversed(text) if " in " in l and ("passed" in l or "failed" in l
                                                                               or "error" in l)), None)
    res = {"rc": rc, "s": took, "summary": summary or (f"cut at {limit} s" if rc == 124 else "no summary"),
           "failed": [l for l in text if l.startswith(("FAILED", "ERROR"))][:20]}
    log(f"[tests] {took:.0f} s: {res['summary']} (rc {rc})")
    return res


if __name__ == "__main__":
    sys.exit(main())
