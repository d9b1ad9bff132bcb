"""Check a head exported by `forerun export-draft` inside vLLM (its CPU build): lossless, and
accepting as much as in forerun. Three steps, the first and last in forerun's environment, the
middle one in vLLM's (bench/vllm_cpu.sh setup); bench/vllm_eagle3.sh runs them all.

  forerun: the prompts as token ids (chat template applied by forerun), forerun's greedy output
           without and with the head (eagle, chain of K), its acceptance per position
  vllm:    the same token ids through vLLM, greedy, without (--plain) or with the exported head
           (speculative_config method eagle3, K tokens); acceptance from vLLM's spec_decode metrics
  report:  output equality (vLLM with vs without the drafter; forerun with vs without) and mean
           acceptance length side by side, as JSON and a Markdown table

Mean acceptance length is vLLM's definition for both: 1 + accepted draft tokens / verify passes
that carried a draft. Prompts run one at a time in both engines (no batching).

The same check in llama.cpp's own server (bench/llama_cpp_tools.sh builds it):
  forerun:             as above (the head trained with --shape eagle3)
  llama-server:        the same token ids through llama-server, one slot, greedy, without (--plain)
                       or with the head exported by `forerun export-draft --format llama.cpp`
                       (--spec-type draft-eagle3); --exact runs llama-server in forerun's exact mode
                       for llama.cpp (no repacked weights, a Q8_0 cache, ggml's tiled product off: one
                       kernel for every pass size, docs/kernels.md)
  report-llama-server: equality with llama-server's own plain output, and acceptance rates
                       (accepted / drafted tokens, llama-server's counters) beside forerun's
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def run_forerun(args) -> None:
    from forerun.bench import load_prompts
    from forerun.chat import prompt_ids
    from forerun.drafters import make_drafter
    from forerun.engine import Engine
    from forerun.models import load_model

    prompts = load_prompts(args.prompts, None, args.limit_per_category)
    target = load_model(args.model, backend="torch", threads=args.threads)
    drafter = make_drafter("eagle", target, head_path=args.head)
    rows = []
    for i, p in enumerate(prompts):
        ids = prompt_ids(target.tokenizer, p["text"], "auto")
        row = {"category": p["category"], "prompt_ids": ids}
        for name, d in (("plain", None), ("eagle", drafter)):
            res = Engine(target.backend, d, target.eos_token_ids).generate(ids, max_new_tokens=args.max_tokens, k=args.k)
            row[name] = res.token_ids
            if d is not None:
                s = res.stats
                row["drafts"] = sum(1 for k in s.k_history if k > 0)
                row["drafted"] = s.drafted
                row["accepted"] = s.accepted
                row["accepted_per_pos"] = s.accepted_per_position
        rows.append(row)
        print(f"forerun {i + 1}/{len(prompts)}", file=sys.stderr)
    Path(args.out, "forerun.json").write_text(json.dumps({"model": args.model, "k": args.k,
                                                            "max_tokens": args.max_tokens, "rows": rows}))


def run_vllm(args) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    src = json.loads(Path(args.out, "forerun.json").read_text())
    kw = {}
    if not args.plain:
        kw["speculative_config"] = {"model": args.head, "method": "eagle3", "num_speculative_tokens": src["k"]}
    llm = LLM(model=args.target, dtype="float32", max_model_len=4096, disable_log_stats=False, seed=0, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=src["max_tokens"])
    outs, t0 = [], time.time()
    for row in src["rows"]:  # one at a time: batching could change the arithmetic
        out = llm.generate([TokensPrompt(prompt_token_ids=row["prompt_ids"])], params, use_tqdm=False)
        outs.append(list(out[0].outputs[0].token_ids))
    metrics = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            metrics[m.name.split(":")[1]] = getattr(m, "values", None) or getattr(m, "value", None)
    import vllm

    name = "vllm-plain" if args.plain else "vllm-eagle3"
    Path(args.out, f"{name}.json").write_text(json.dumps({"outputs": outs, "metrics": metrics, "seconds": time.time() - t0,
                                                        "vllm": vllm.__version__}))


def run_llama_server(args) -> None:
    """The same token ids through llama.cpp's own llama-server (``--server``: the binary), greedy, one
    request at a time on one slot, without (--plain) or with the exported EAGLE-3 GGUF (``--head``,
    ``--spec-type draft-eagle3``, K tokens); acceptance from each response's ``timings``."""
    import subprocess
    import urllib.request

    from forerun.bench_peers import llama_defaults_env  # here: the vllm step runs where forerun is not installed

    src = json.loads(Path(args.out, "forerun.json").read_text())
    port = 8019
    cmd = [args.server, "-m", args.target, "-t", str(args.threads or 2), "-np", "1", "-c", "4096", "--port", str(port),
           "--host", "127.0.0.1"]
    if not args.plain:
        cmd += ["--spec-type", "draft-eagle3", "-md", args.head, "--spec-draft-n-max", str(src["k"]),
                "--spec-draft-n-min", "0"]
    env = llama_defaults_env()
    if args.exact:  # forerun's exact mode for llama.cpp (docs/kernels.md): one kernel for every pass size
        cmd += ["--no-repack", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"]
        env["GGML_CPU_TILED_MM"] = "0"
    name = ("llama-server-exact" if args.exact else "llama-server") + ("-plain" if args.plain else "-eagle3")
    log = open(Path(args.out, name + ".log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited ({proc.returncode}); see its log in {args.out}")
        outs, drafts, accepted, t0 = [], 0, 0, time.time()
        for row in src["rows"]:
            body = {"prompt": row["prompt_ids"], "n_predict": src["max_tokens"], "temperature": 0.0, "top_k": 1,
                    "cache_prompt": False, "return_tokens": True, "ignore_eos": False}
            req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            r = json.loads(urllib.request.urlopen(req, timeout=600).read())
            outs.append(list(r["tokens"]))
            t = r.get("timings", {})
            drafts += int(t.get("draft_n", 0))
            accepted += int(t.get("draft_n_accepted", 0))
    finally:
        proc.terminate()
        proc.wait(30)
    Path(args.out, f"{name}.json").write_text(json.dumps({"outputs": outs, "seconds": time.time() - t0,
                                                        "draft_tokens": drafts, "accepted_tokens": accepted}))


def report_llama_server(args) -> None:
    """forerun's and llama-server's losslessness and acceptance with the same head on the same ids,
    for llama-server at its defaults and (where run with --exact) without repacked weights or the
    tiled product. llama-server counts drafted tokens, not drafts: its acceptance rate (accepted /
    drafted) is set beside forerun's on the same definition."""
    out = Path(args.out)
    f = json.loads((out / "forerun.json").read_text())
    rows, n = f["rows"], len(f["rows"])
    f_acc = sum(r["accepted"] for r in rows)
    f_drafted = sum(r.get("drafted", 0) for r in rows)
    fr = round(f_acc / f_drafted, 4) if f_drafted else None
    result = {"model": f["model"], "k": f["k"], "max_tokens": f["max_tokens"], "prompts": n,
              "forerun_lossless": sum(r["plain"] == r["eagle"] for r in rows) / n, "forerun_acceptance_rate": fr,
              "forerun_counts": {"drafted": f_drafted, "accepted": f_acc}, "llama_server": {}}
    md = ["| engine | outputs equal with / without the head | drafted tokens | accepted | acceptance rate | "
          "vs forerun's rate | plain output = forerun's plain |", "|---|---|---|---|---|---|---|",
          f"| forerun | {result['forerun_lossless']:.0%} ({sum(r['plain'] == r['eagle'] for r in rows)}/{n}) | "
          f"{f_drafted} | {f_acc} | {fr} | 1 | - |"]
    for mode, label in (("llama-server", "llama-server, its defaults"),
                        ("llama-server-exact", "llama-server in forerun's exact mode (--no-repack, Q8_0 cache, GGML_CPU_TILED_MM=0)")):
        if not (out / f"{mode}-eagle3.json").is_file():
            continue
        plain = json.loads((out / f"{mode}-plain.json").read_text())
        spec = json.loads((out / f"{mode}-eagle3.json").read_text())
        same = sum(a == b for a, b in zip(spec["outputs"], plain["outputs"]))
        ls = round(spec["accepted_tokens"] / spec["draft_tokens"], 4) if spec["draft_tokens"] else None
        r = {"lossless": same / n, "acceptance_rate": ls, "ratio": round(ls / fr, 4) if ls and fr else None,
             "plain_equals_forerun_plain": sum(a == r["plain"] for a, r in zip(plain["outputs"], rows)) / n,
             "counts": {"drafted": spec["draft_tokens"], "accepted": spec["accepted_tokens"]},
             "seconds": {"plain": round(plain["seconds"], 1), "eagle3": round(spec["seconds"], 1)}}
        result["llama_server"][mode] = r
        md.append(f"| {label} (draft-eagle3) | {same / n:.0%} ({same}/{n}) | {spec['draft_tokens']} | "
                  f"{spec['accepted_tokens']} | {ls} | {r['ratio']} | {r['plain_equals_forerun_plain']:.0%} |")
    (out / "report-llama-server.json").write_text(json.dumps(result, indent=1))
    (out / "report-llama-server.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def _mean_len(accepted: int, drafts: int) -> float:
    return 1 + accepted / drafts if drafts else 0.0


def report(args) -> None:
    out = Path(args.out)
    f = json.loads((out / "forerun.json").read_text())
    plain = json.loads((out / "vllm-plain.json").read_text())
    spec = json.loads((out / "vllm-eagle3.json").read_text())
    rows = f["rows"]
    m = spec["metrics"]
    v_len = _mean_len(int(m["spec_decode_num_accepted_tokens"]), int(m["spec_decode_num_drafts"]))
    f_acc, f_drafts = sum(r["accepted"] for r in rows), sum(r["drafts"] for r in rows)
    f_len = _mean_len(f_acc, f_drafts)
    n = len(rows)
    f_pos = [sum(r["accepted_per_pos"][i] if i < len(r["accepted_per_pos"]) else 0 for r in rows) / f_drafts
             for i in range(f["k"])]
    v_pos = [a / int(m["spec_decode_num_drafts"]) for a in m.get("spec_decode_num_accepted_tokens_per_pos") or []]
    result = {
        "model": f["model"], "k": f["k"], "max_tokens": f["max_tokens"], "prompts": n, "vllm": spec["vllm"],
        "vllm_lossless": sum(a == b for a, b in zip(spec["outputs"], plain["outputs"])) / n,
        "forerun_lossless": sum(r["plain"] == r["eagle"] for r in rows) / n,
        "vllm_plain_equals_forerun_plain": sum(a == r["plain"] for a, r in zip(plain["outputs"], rows)) / n,
        "vllm_mean_acceptance_length": round(v_len, 4), "forerun_mean_acceptance_length": round(f_len, 4),
        "ratio": round(v_len / f_len, 4) if f_len else None,
        "vllm_acceptance_per_position": [round(x, 4) for x in v_pos],
        "forerun_acceptance_per_position": [round(x, 4) for x in f_pos],
        "vllm_counts": {"drafts": int(m["spec_decode_num_drafts"]), "accepted": int(m["spec_decode_num_accepted_tokens"])},
        "forerun_counts": {"drafts": f_drafts, "accepted": f_acc},
        "vllm_seconds": {"plain": round(plain["seconds"], 1), "eagle3": round(spec["seconds"], 1)},
    }
    (out / "report.json").write_text(json.dumps(result, indent=1))
    md = ["| engine | outputs equal with / without the head | mean acceptance length | acceptance per position |",
          "|---|---|---|---|",
          f"| forerun | {result['forerun_lossless']:.0%} | {f_len:.3f} | {' / '.join(f'{x:.2f}' for x in f_pos)} |",
          f"| vLLM {spec['vllm']} (CPU) | {result['vllm_lossless']:.0%} | {v_len:.3f} | {' / '.join(f'{x:.2f}' for x in v_pos)} |",
          "", f"vLLM / forerun mean acceptance length: {result['ratio']}; vLLM's plain output equal to forerun's "
              f"plain output on {result['vllm_plain_equals_forerun_plain']:.0%} of {n} prompts."]
    (out / "report.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=["forerun", "vllm", "report", "llama-server", "report-llama-server"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--head", default=None, help="forerun: head folder (default: shipped); vllm: the exported folder")
    ap.add_argument("--target", default=None, help="vllm: the target's HF folder; llama-server: its GGUF file")
    ap.add_argument("--server", default=None, help="llama-server: the binary (bench/llama_cpp_tools.sh builds it)")
    ap.add_argument("--plain", action="store_true", help="vllm, llama-server: without the drafter")
    ap.add_argument("--exact", action="store_true",
                    help="llama-server: forerun's exact mode (no repacked weights, Q8_0 cache, tiled product off)")
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parents[1].parent / "shared/data/spec_bench/question.jsonl"))
    ap.add_argument("--limit-per-category", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    {"forerun": run_forerun, "vllm": run_vllm, "report": report, "llama-server": run_llama_server,
     "report-llama-server": report_llama_server}[args.step](args)


if __name__ == "__main__":
    main()
