"""``forerun bench``'s report: per-method summaries of the timed records, predicted speedups from
measured costs, and the results.md a reader opens."""

from __future__ import annotations

from pathlib import Path

from forerun.build import parse_method
from forerun.draft_length import expected_tokens
from forerun.errors import ForerunError


def summarise(records, names, ref_of=None):
    """Totals per method and category; ``ref_of``: the plain-decoding run each method's "vs none"
    compares with (its own backend's, when methods ran on different backends)."""
    ref_of = ref_of or {}

    def agg(rs):
        new = sum(r["new_tokens"] for r in rs)
        wall = sum(r["wall_s"] for r in rs)
        passes = sum(r.get("target_passes", 0) for r in rs)
        drafted = sum(r.get("drafted", 0) for r in rs)
        acc = sum(r.get("accepted", 0) for r in rs)
        rej = sum(r.get("rejections", 0) for r in rs)
        timed = all("prefill_s" in r for r in rs)  # the transformers peers do not split their time
        decode = wall - sum(r.get("prefill_s", 0.0) for r in rs)
        return {
            "tokens_per_s": new / wall if wall else 0.0,
            "decode_tokens_per_s": new / decode if timed and decode > 0 else None,
            "new_tokens": new,
            "wall_s": wall,
            "mean_accepted_len": (acc + passes) / passes if passes else None,
            "acceptance_rate": acc / drafted if drafted else None,
            "alpha": acc / (acc + rej) if acc + rej else None,
            "drafted": drafted,
            "accepted": acc,
            "rejections": rej,
            "target_passes": passes,
            "head_rows": sum(r.get("head_rows", 0) for r in rs),
            "head_calls": sum(r.get("head_calls", 0) for r in rs),
            "verified_rows": sum(r.get("verified_rows", 0) for r in rs),
            "greedy_equal": sum(1 for r in rs if r["equal_none"]),
            "prompts": len(rs),
        }

    out = {}
    for name in names:
        rs = [r for r in records if r["method"] == name]
        if not rs:
            continue
        m = agg(rs)
        m["draft_s"] = sum(r.get("draft_s", 0.0) for r in rs)
        m["read_s"] = sum(r.get("read_s", 0.0) for r in rs)
        m["verify_s"] = sum(r.get("verify_s", 0.0) for r in rs)
        m["prefill_s"] = sum(r.get("prefill_s", 0.0) for r in rs)
        dpp = [0] * 32
        app = [0] * 32
        for r in rs:
            for i, (d, a) in enumerate(zip(r.get("drafted_per_position", []), r.get("accepted_per_position", []))):
                dpp[i] += d
                app[i] += a
        m["acceptance_per_position"] = [a / d for a, d in zip(app, dpp) if d]
        if any("steps_by_choice" in r for r in rs):
            m["steps_by_choice"] = {c: sum(r.get("steps_by_choice", {}).get(c, 0) for r in rs) for c in ("tree", "chain", "none")}
        if len(rs) >= 3:  # in prompt order: a drafter that learns across the run shows it here
            third = len(rs) // 3
            m["tau_first_third"] = agg(rs[:third])["mean_accepted_len"]
            m["tau_last_third"] = agg(rs[-third:])["mean_accepted_len"]
            m["tokens_per_s_first_third"] = agg(rs[:third])["tokens_per_s"]
            m["tokens_per_s_last_third"] = agg(rs[-third:])["tokens_per_s"]
        m["by_category"] = {}
        for cat in sorted({r["category"] for r in rs}):
            m["by_category"][cat] = agg([r for r in rs if r["category"] == cat])
        out[name] = m
    # Speedups, overall and per category.
    for peer in ("none", "hf", "hf-lookup", "llama.cpp"):
        key = "speedup_vs_" + peer.replace("-", "_").replace(".", "_")
        for name, m in out.items():
            ref = ref_of.get(name, peer) if peer == "none" else peer
            if ref not in out:
                continue
            m[key] = m["tokens_per_s"] / out[ref]["tokens_per_s"] if out[ref]["tokens_per_s"] else None
            d, rd = m["decode_tokens_per_s"], out[ref]["decode_tokens_per_s"]
            m["decode_" + key] = d / rd if d and rd else None
            for cat, c in m["by_category"].items():
                rc = out[ref]["by_category"].get(cat)
                c[key] = c["tokens_per_s"] / rc["tokens_per_s"] if rc and rc["tokens_per_s"] else None
    return out


def predicted_speedup(m: dict, none: dict, ratios: dict, rows: int | str | None = None,
                       tree: bool = False) -> float | None:
    """Leviathan et al.'s speedup with measured inputs.

    alpha = per-token acceptance estimated from the drafts the target tested (accepted /
    (accepted + rejections), ``GenerationStats.alpha``; a draft after a rejected one is never
    tested, so accepted / drafted would undercount it), gamma = mean draft length per verify
    pass, c = measured draft time per drafted token over our plain step time (none's wall time
    per token), and the verify pass costs the measured ratio r(gamma) of a step instead of 1:
    speedup = E[tokens per pass](alpha, gamma) / (gamma c + r).

    A token tree has no one chain to put into the formula: its tokens per pass are the measured
    tau, gamma is its depth per pass, and the pass is charged the ratio of a pass of ``rows``, the
    mean number of nodes it verified (head tree and any lookup branch; on the CPU, greedy:
    ``"N+headH/C"``, the body on N + 1 rows and the LM head on the H rows its walks took, in C
    calls). For trees the prediction thus checks the cost side alone.
    """
    if not m.get("drafted") or not m.get("target_passes") or not none.get("new_tokens"):
        return None
    alpha = min(m["alpha"], 0.999)
    gamma = m["drafted"] / m["target_passes"]
    step = none["wall_s"] / none["new_tokens"]
    c = m["draft_s"] / m["drafted"] / step
    r = ratios.get(str(rows)) if rows else None
    r = r or ratios.get(str(min(8, max(1, round(gamma)))), 1.0)
    expected = m["mean_accepted_len"] if tree and m.get("mean_accepted_len") else expected_tokens(alpha, gamma)
    return expected / (gamma * c + r)


def k_text(cfg: dict) -> str:
    """The draft lengths a run used: each method's own where methods carry one (``ngram:auto``)."""
    own = {m: k for m, k in (cfg.get("method_k") or {}).items() if m not in cfg.get("peers", []) and not m.startswith("none")}
    if not own:
        return f"k={cfg['k']}"
    if len(set(map(str, own.values()))) == 1:
        return f"k={next(iter(own.values()))}"
    return "k per method: " + ", ".join(f"{m} {k}" for m, k in own.items())


def _tg_how(tg: dict) -> str:
    """How the tg128 figure was taken: one run before the bench, or runs between the prompts' methods."""
    if not tg.get("interleaved"):
        return ""
    before = tg["before"]["tokens_per_s"]
    return (f" (over {tg['runs']} runs of `-p 0 -n 128 -r 1`, one between each prompt's methods, in the same "
            f"minutes as ours; spread {tg['stddev']:.1f}; {before:.1f} in the run before the bench)")


def llama_bench_text(lb: dict, methods: dict) -> str:
    """llama.cpp's own llama-bench beside our prompt pass and each method's decode rate."""
    pp, tg = lb.get("pp512", {}).get("tokens_per_s"), lb.get("tg128", {}).get("tokens_per_s")
    text = (f"llama.cpp's own `{lb['command']}` (build {lb.get('build')}) on the same file, same run: pp512 "
            f"{pp:.1f} tok/s (ours, one 512-token pass: {lb['forerun_pp512']:.1f}, {lb['forerun_pp512'] / pp:.2f}x), "
            f"tg128 {tg:.1f} tok/s{_tg_how(lb['tg128'])}. Decode tokens/s against tg128: ")
    text += ", ".join(f"{name} {m['decode_tokens_per_s'] / tg:.2f}x" for name, m in methods.items()
                      if m.get("decode_tokens_per_s") and tg)
    return text + "."


def write_markdown(results: dict, path: Path) -> None:
    methods = results["methods"]
    cats = sorted({c for m in methods.values() for c in m["by_category"]})
    lines = [f"# forerun bench — {results['machine']['date']}", ""]
    mc = results["machine"]
    cfg = results["config"]
    lines.append(f"Machine: {mc['cpu']}, {mc['cores']} cores, torch {mc['torch']} ({mc['torch_threads']} threads), "
                 f"dtype {mc['dtype']}. Model: {cfg['model']}, backend {cfg.get('backend')} ({cfg.get('threads')} threads). "
                 f"{_decoding(cfg)}, max_new_tokens={cfg['max_new_tokens']}, "
                 f"{k_text(cfg)}, {cfg['prompts']} prompts."
                 + (f" Greedy head: {cfg['greedy_head']}; body kernel: {cfg['body_kernel']}." if "greedy_head" in cfg else ""))
    if "batch_invariant" in cfg:
        lines.append((f"llama.cpp: {cfg['llama_cpp']}; " if "llama_cpp" in cfg else "")
                     + f"verify passes bit-identical to one-token steps (batch-invariant): {cfg['batch_invariant']}.")
    lines.append("")
    by_method = cfg.get("backend_by_method") or {}
    at = cfg.get("auto_backend_timing")
    if at and "torch" in at:
        lines += [f"`--backend auto` measured both backends on this machine ({at['measured']}, load {at['load_per_core']:.2f} "
                  f"per core): one-token step torch {at['torch']['step_ms']:.1f} ms, llama.cpp {at['llama.cpp']['step_ms']:.1f} ms; "
                  f"pass of 5 rows torch {at['torch']['pass5_ms']:.1f} ms, llama.cpp {at['llama.cpp']['pass5_ms']:.1f} ms "
                  "(the shorter sum runs every method both backends can run).", ""]
    if len(set(by_method.values())) > 1:
        lines += [f"`--backend auto` chose per method; each method's speedup \"vs none\" and its greedy equality "
                  f"compare with plain decoding on its own backend ({', '.join(sorted(set(by_method.values())))}).", ""]
    lines.append("| method | backend | tokens/s | vs none | vs hf | vs hf-lookup | vs llama.cpp | decode tokens/s | "
                 f"decode vs llama.cpp | tau | acceptance | {'greedy' if cfg.get('greedy', True) else 'text'} = none |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")

    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    def x(v):
        return "-" if v is None else f"{v:.2f}x"

    for name, m in methods.items():
        lines.append(f"| {name} | {by_method.get(name, 'peer')} | {f(m['tokens_per_s'])} | {x(m.get('speedup_vs_none'))} | "
                     f"{x(m.get('speedup_vs_hf'))} | "
                     f"{x(m.get('speedup_vs_hf_lookup'))} | {x(m.get('speedup_vs_llama_cpp'))} | {f(m.get('decode_tokens_per_s'))} | "
                     f"{x(m.get('decode_speedup_vs_llama_cpp'))} | {f(m['mean_accepted_len'])} | {f(m['acceptance_rate'])} | "
                     f"{m['greedy_equal']}/{m['prompts']} |")
    lb = results.get("llama_bench")
    if lb:
        lines += ["", llama_bench_text(lb, methods)]
    if any("tau_first_third" in m for m in methods.values()):
        lines += ["", "Over the run, in prompt order (drafters that learn across prompts: suffix, +adapt):", "",
                  "| method | tau, first third | tau, last third | tokens/s, first third | tokens/s, last third |",
                  "|---|---|---|---|---|"]
        for name, m in methods.items():
            if "tau_first_third" in m:
                lines.append(f"| {name} | {f(m['tau_first_third'])} | {f(m['tau_last_third'])} | "
                             f"{f(m['tokens_per_s_first_third'])} | {f(m['tokens_per_s_last_third'])} |")
    for name, m in methods.items():
        if "adaptation" in m:
            a = m["adaptation"]
            lines += ["", f"{name}: {a['updates']} weight updates ({a['update_s']:.1f} s in all, inside the timed "
                          f"generations), {a['reverts']} reverts to the shipped weights."]
    for name, m in methods.items():
        if "steps_by_choice" in m:
            sc = m["steps_by_choice"]
            lines += ["", f"{name}: steps that verified the tree {sc['tree']}, the lookup chain alone {sc['chain']}, "
                          f"no draft {sc['none']}."]
    lines += ["", "Tokens/s by category (speedup over our `none` in brackets):", ""]
    lines.append("| category | " + " | ".join(methods) + " |")
    lines.append("|---|" + "---|" * len(methods))
    for cat in cats:
        cells = []
        for m in methods.values():
            c = m["by_category"].get(cat)
            cells.append("-" if c is None else f"{c['tokens_per_s']:.1f} ({x(c.get('speedup_vs_none'))}, tau {f(c['mean_accepted_len'])})")
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    vr = results.get("verify_cost_ratio")
    if vr:
        on = (f"timed on {vr['texts']} prompts followed by the target's own greedy output, mean context {vr['context']}"
              if vr.get("texts") else f"timed on random tokens, context {vr['context']}")
        lines += ["", f"Verify cost ratio (time of a K+1-token pass over a 1-token step of {vr['step_ms']:.1f} ms; {on}):", ""]
        ks = [k for k in vr if k not in ("step_ms", "context", "texts")]
        lines.append("| K | " + " | ".join(ks) + " |")
        lines.append("|---|" + "---|" * len(ks))
        lines.append("| ratio | " + " | ".join(f"{vr[k]:.2f}" for k in ks) + " |")
        if any("+head" in k for k in ks):
            lines += ["", "N+headH/C: a greedy tree pass of N draft nodes and the root (the nodes verified per pass on "
                      "average), with the LM head on H rows only in C calls (the rows and calls the acceptance walk took "
                      "on average)."]
    hk = results.get("lm_head_kernels_ms")
    if hk:
        kernels = [k for k in next(iter(hk.values())) if k != "chosen"]
        lines += ["", "LM head alone, milliseconds (median of 7) per kernel; the backend uses the one chosen on first use:", ""]
        lines.append("| rows | " + " | ".join(kernels) + " | chosen |")
        lines.append("|---|" + "---|" * (len(kernels) + 1))
        for n, t in hk.items():
            lines.append(f"| {n} | " + " | ".join(f"{t[k]:.1f}" for k in kernels) + f" | {t.get('chosen') or '-'} |")
    pred = {n: m.get("predicted_speedup_vs_none") for n, m in methods.items() if m.get("predicted_speedup_vs_none")}
    if pred:
        lines += ["", "| method | measured speedup vs none | predicted (Leviathan, measured costs) | acceptance per position |",
                  "|---|---|---|---|"]
        tree_rows = [n for n in pred if _is_tree(n)]
        for n, p in pred.items():
            m = methods[n]
            app = ", ".join(f"{x:.2f}" for x in m.get("acceptance_per_position", [])[:8])
            lines.append(f"| {n} | {x(m.get('speedup_vs_none'))} | {p:.2f}x | {app} |")
        if tree_rows:
            lines += ["", f"Trees ({', '.join(tree_rows)}): tokens per pass are the measured tau; the prediction prices "
                          "the measured pass (nodes, head rows and calls above) and the drafting, so it checks the cost side."]
        mixed = [n for n, m in methods.items() if "steps_by_choice" in m]
        if mixed:
            lines += ["", f"Not predicted: {', '.join(mixed)} (each step verifies a tree, a chain or nothing, so no one "
                          "draft shape prices it)."]
    split = time_split(methods)
    if split:
        lines += ["", "Where the time goes: milliseconds per generated token, prompt passes apart (draft: the "
                  "drafter; read: of that, a draft model reading what it had not read, its prompt mostly; verify: the "
                  "target's passes; other: acceptance, rollback, the loop); draft/step: drafting seconds per drafted "
                  "token over plain decoding's seconds per pass, the reading left out (with it, in brackets):", "",
                  "| method | draft | read | verify | other | prompt | draft/step |", "|---|---|---|---|---|---|---|"]
        for n, t in split.items():
            per_step = "-" if t["draft_per_step"] is None else (
                f"{t['draft_per_step']:.2f}" + (f" ({t['draft_per_step_read']:.2f})" if t["read"] else ""))
            lines.append(f"| {n} | {t['draft']:.2f} | {t['read']:.2f} | {t['verify']:.2f} | {t['other']:.2f} | "
                         f"{t['prompt']:.2f} | {per_step} |")
    path.write_text("\n".join(lines) + "\n")


def time_split(methods: dict) -> dict:
    """Per method of ours (those with a target pass count), milliseconds per generated token spent
    drafting (``read``: of that, a draft model's reading), verifying, elsewhere in the loop and on
    the prompt; and drafting seconds per drafted token against plain decoding's seconds per pass,
    without the reading (``draft_per_step``) and with it (``draft_per_step_read``; None without
    drafts or plain decoding). A reading is paid once per prompt (and per stretch the model did
    not draft for), not per drafted token."""
    none = methods.get("none") or {}
    step = none["verify_s"] / none["target_passes"] if none.get("target_passes") else None
    out = {}
    for n, m in methods.items():
        if not m.get("target_passes") or not m.get("new_tokens") or "draft_s" not in m:
            continue
        per = 1000.0 / m["new_tokens"]
        decode = m["wall_s"] - m.get("prefill_s", 0.0)
        read = min(m.get("read_s", 0.0), m["draft_s"])
        priced = bool(step and m.get("drafted") and m["draft_s"])
        out[n] = {"draft": m["draft_s"] * per, "read": read * per, "verify": m["verify_s"] * per,
                  "other": max(0.0, decode - m["draft_s"] - m["verify_s"]) * per, "prompt": m.get("prefill_s", 0.0) * per,
                  "draft_per_step": (m["draft_s"] - read) / m["drafted"] / step if priced else None,
                  "draft_per_step_read": m["draft_s"] / m["drafted"] / step if priced else None}
    return out


def _is_tree(name: str) -> bool:
    """Whether a bench method name (or a reference like none@llama.cpp) verifies token trees."""
    try:
        return parse_method(name).tree is not None
    except ForerunError:
        return False


def tree_pricing(summary: dict, tree_methods: list, backend):
    """What each tree method's verify pass was on average, to price it: (nodes by method, greedy
    CPU trees' (nodes, head rows, head calls) by method, the pass widths to time)."""
    tree_nodes = {}
    for name in tree_methods:
        m = summary.get(name)
        if m and m.get("target_passes") and m.get("verified_rows") and "steps_by_choice" not in m:
            tree_nodes[name] = max(1, round(m["verified_rows"] / m["target_passes"]) - 1)
    ks = list(range(1, 9)) + sorted({n for n in tree_nodes.values() if n > 8})
    lazy = {}
    if backend.capabilities.lazy_tree_head:
        for name, nodes in tree_nodes.items():
            m = summary[name]
            lazy[name] = (nodes, max(1, round(m["head_rows"] / m["target_passes"])),
                          max(1, round(m.get("head_calls", 0) / m["target_passes"])))
    return tree_nodes, lazy, ks


def _decoding(cfg: dict) -> str:
    """How the run decoded: greedy, or sampled at its temperature (seeded per prompt or not)."""
    if cfg.get("greedy", True):
        return "Greedy"
    how = "each prompt seeded (every method samples plain decoding's text)" if cfg.get("seeded") else \
        "unseeded (the rejection sampler; texts differ between methods)"
    return f"Sampled at temperature {cfg['temperature']}, {how}"
