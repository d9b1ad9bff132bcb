"""``forerun bench``: methods and peers side by side, same process, same model, same dtype."""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from forerun.backend_timing import kept_timing
from forerun.bench_peers import (
    LLAMA_BENCH_TG,
    PEERS,
    PER_PROMPT,
    LlamaCppPeer,
    hf_generate,
    interleaved_tg,
    llama_bench,
    llama_bench_tg,
    prompt_rate,
)
from forerun.bench_report import predicted_speedup, summarise, tree_pricing, write_markdown
from forerun.build import Options, backend_for, build, load_draft_model, load_target, parse_method
from forerun.chat import prompt_ids, uses_chat
from forerun.draft_length import K_MAX
from forerun.drafters import method_row
from forerun.errors import ForerunError
from forerun.machine import cpu_name
from forerun.models import resolve_source
from forerun.plots import bench_charts
from forerun.sampling import SamplingParams
from forerun.split_models import default_draft


def load_prompts(path: str, categories=None, limit_per_category=None) -> list[dict]:
    p = Path(path)
    if not p.exists():
        raise ForerunError(f"prompts file not found: {path}")
    rows = []
    with open(p) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                text = obj["turns"][0]
            except (json.JSONDecodeError, KeyError, IndexError, TypeError):
                raise ForerunError(f"{path}:{i}: expected a JSON object with a non-empty 'turns' list") from None
            rows.append({"id": obj.get("question_id", i), "category": obj.get("category", "default"), "text": text})
    if categories:
        known = {r["category"] for r in rows}
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise ForerunError(f"unknown categories {unknown}; the file has {sorted(known)}")
        rows = [r for r in rows if r["category"] in categories]
    if limit_per_category is not None:
        if limit_per_category < 1:
            raise ForerunError("--limit-per-category must be >= 1")
        seen: dict[str, int] = {}
        kept = []
        for r in rows:
            if seen.get(r["category"], 0) < limit_per_category:
                seen[r["category"]] = seen.get(r["category"], 0) + 1
                kept.append(r)
        rows = kept
    if not rows:
        raise ForerunError(f"no prompts selected from {path}")
    return rows


def machine_info(dtype) -> dict:
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": str(dtype).replace("torch.", ""),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def verify_cost_ratios(backend, context: int = 200, ks=range(1, 9), reps: int = 7, lazy_trees=(), texts=None,
                       max_texts: int = 4) -> dict:
    """Time of a (K+1)-token verify pass over a 1-token step, at a context of about ``context`` tokens.

    Timed the way greedy generation runs it: where the backend verifies through exact argmaxes,
    that path is timed, else a forward with logits at every position; the pass sizes take turns
    on one cached context per text (medians of ``reps`` rounds). ``texts`` (token
    id lists: the bench's prompts followed by the target's own greedy continuations) are timed at
    their own positions, and the ratio is that of the summed medians over texts: a head whose cost
    depends on how peaked the next-token distribution is (the screened exact argmax on the CPU)
    sees the rows that decoding sees. Without texts, random tokens are timed (flatter rows).
    """
    widest = max([*ks, *(rows for rows, _, _ in lazy_trees)])
    context = max(1, min(context, backend.max_context - widest - 2))
    # (context, ids) per text: a short text is timed at a shorter context, one shorter than 16 not at all
    seqs = [(c, torch.tensor(t)) for t in (texts or ()) if (c := min(context, len(t) - widest - 1)) >= 16][:max_texts]
    n_texts = len(seqs)
    if not seqs:  # no text long enough: random tokens
        g = torch.Generator().manual_seed(0)
        seqs = [(context, torch.randint(10, min(backend.vocab_size, 20000), (context + widest + 1,), generator=g))]
    fn = backend.argmax_forward if backend.capabilities.exact_argmax else backend.forward
    # what is timed: (rows, callable) per key; "step" is the one-token step every ratio divides by
    passes = {"step": (1, fn), **{str(k): (k + 1, fn) for k in ks}}
    for rows, head_rows, calls in sorted(lazy_trees):  # "N+headH/C": N draft nodes and the root, the LM head on H rows in C calls
        passes[lazy_tree_key(rows, head_rows, calls)] = (rows + 1, _lazy_tree_pass(backend, head_rows, calls))
    cuda = backend.device.type == "cuda"
    medians = {key: 0.0 for key in passes}
    for c, ids in seqs:
        backend.reset()
        backend.forward(ids[:c], 0, last_only=True)
        # Every pass size in turn, round after round, on the same cached context: a machine whose
        # speed drifts (this kind of CPU does, by tens of percent within minutes) slows all sizes
        # alike instead of the step measured in one minute and the K-row passes in another. The
        # first round is not timed (allocator and kernel warm-up of each shape).
        times = {key: [] for key in passes}
        for rnd in range(reps + 1):
            for key, (n, run) in passes.items():
                backend.truncate(c)
                t = time.perf_counter()
                run(ids[c: c + n], c)
                if cuda:
                    torch.cuda.synchronize()
                if rnd:
                    times[key].append(time.perf_counter() - t)
        for key, ts in times.items():
            medians[key] += sorted(ts)[len(ts) // 2]
    backend.reset()
    one = medians.pop("step")
    out = {"step_ms": one / len(seqs) * 1000, "context": round(sum(c for c, _ in seqs) / len(seqs)), "texts": n_texts}
    out.update({key: total / one for key, total in medians.items()})
    return out


def lazy_tree_key(rows: int, head_rows: int, calls: int) -> str:
    return f"{rows}+head{head_rows}/{calls}"


def _lazy_tree_pass(backend, head_rows: int, calls: int):
    """A greedy tree's verify pass as the engine runs it on the CPU: every row through the body,
    then the LM head on ``head_rows`` rows in ``calls`` calls (the walk's rounds)."""
    calls = max(1, min(calls, head_rows))
    bounds = [round(i * head_rows / calls) for i in range(calls + 1)]

    def run(tokens, pos):
        h = backend.forward(tokens, pos, logits=False, return_hidden=True).hidden
        for a, b in zip(bounds, bounds[1:]):
            backend.argmax_hidden(h[a:b])

    return run


def _weights_kind(target, report: dict, hf_model) -> str:
    """What the target's weights are, for the report: GGUF blocks (integer path or llama.cpp, as
    its backend's ``report`` says) or the transformers model's dtype."""
    said = report.get("weights")
    if said is not None:
        return said
    hf_model = hf_model if hf_model is not None else target.hf_model
    return "gguf (llama.cpp)" if hf_model is None else str(hf_model.dtype)


def _llamacpp_peer(spec, threads, n_ctx):
    """llama.cpp decoding plainly with its own sampler, on the same GGUF file with llama.cpp's default
    settings in a process of its own (``bench_peers.LlamaCppPeer``): its fastest plain decoding, not
    the exact-mode settings forerun verifies with."""
    kind, loc = resolve_source(spec)
    if kind != "gguf":
        raise ForerunError("the llama.cpp peer needs a .gguf model (or bundled)")
    return LlamaCppPeer(loc, threads, n_ctx)


def _peer_generate(name, hf_model, llama_peer, ids, max_new, eos):
    if name == "llama.cpp":
        return llama_peer.generate(ids, max_new, eos)
    return (*hf_generate(hf_model, ids, max_new, eos, name == "hf-lookup"), None)


def default_peers(spec: str) -> str:
    """``--peers auto``: the tools a user of this model already has. llama.cpp (and transformers)
    for a GGUF file where llama-cpp-python is installed, else transformers' ``generate()``."""
    try:
        kind, _ = resolve_source(spec)
    except ForerunError:
        return "hf"  # the load reports the bad name
    return "llama.cpp,hf" if kind == "gguf" and importlib.util.find_spec("llama_cpp") is not None else "hf"


def run_bench(args) -> dict:
    # A method may carry its own draft length: "ngram:6", "layerskip:auto"; else --k applies. A head
    # method may end in "+adapt": its head keeps learning over the run (online adaptation).
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    parsed = {m: parse_method(m) for m in methods}
    peers = [p.strip() for p in (default_peers(args.model) if args.peers == "auto" else args.peers or "").split(",")
             if p.strip()]
    for p in peers:
        if p not in PEERS:
            raise ForerunError(f"unknown peer {p!r} (choose {', '.join(PEERS)})")
    if args.max_new_tokens < 1:
        raise ForerunError("--max-new-tokens must be >= 1")
    temperature = getattr(args, "temperature", 0.0)
    sampled_params = SamplingParams(temperature=temperature)  # a bad temperature fails here
    if "llama-bench" in peers and resolve_source(args.model)[0] != "gguf":
        raise ForerunError("the llama-bench peer needs a .gguf model (or bundled)")
    if not sampled_params.greedy and peers:
        raise ForerunError("the peers decode greedily: give --peers '' for a sampled bench (--temperature > 0)")
    unseeded = getattr(args, "unseeded", False)
    seed = getattr(args, "seed", 0)
    if "none" not in methods:
        methods.insert(0, "none")  # the reference for speedups and greedy equality
        parsed["none"] = parse_method("none")
    method_k = {m: p.k if p.k is not None else args.k for m, p in parsed.items()}
    if getattr(args, "lookup_from", "ngram") != "ngram":
        raise ForerunError("bench names the lookup branch's source per method: use eagle-tree+suffix or "
                           "eagle-tree+suffix-auto in --methods instead of --lookup-from")
    if getattr(args, "tree_lookup", False):
        raise ForerunError("bench names the lookup branch per method: use eagle-tree+lookup or eagle-tree+auto (or "
                           "medusa-tree+...) in --methods instead of --tree-lookup")
    options = Options.from_args(args, method="none")
    skip = options.skip  # before the slow load: a typo fails at once
    cats = [c.strip() for c in args.categories.split(",")] if args.categories else None
    prompts = load_prompts(args.prompts, cats, args.limit_per_category)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    needs_draft = any(p.kind == "draft" for p in parsed.values())
    if needs_draft and not (args.draft or default_draft(args.model)):
        raise ForerunError("method draft needs a draft model (--draft MODEL)")
    threads = getattr(args, "threads", None)

    # "eagle-tree" (a head method + "-tree"): the same head verifying trees of --tree-nodes (default 32);
    # "eagle-tree+lookup": those trees plus the prompt-lookup branch; "eagle-tree+auto": that tree or
    # the lookup chain alone, chosen per step.
    tree_methods = {m for m in methods if parsed[m].tree}
    tree = options.tree  # validated whether or not a tree method asks for it
    tree = (tree or (32, None)) if tree_methods else None
    # --backend auto picks per method (llama.cpp where a method runs there, torch where it needs
    # layers or hidden states); plain decoding then runs on every backend used, as each one's reference.

    kinds = {m: parsed[m].kind for m in methods}
    backend_of = {m: backend_for(options, [kinds[m]]) for m in methods}
    primary = backend_of["none"]
    for b in sorted(set(backend_of.values()) - {primary}):  # right after none: each prompt's references run first
        methods.insert(methods.index("none") + 1, f"none@{b}")
        method_k[f"none@{b}"] = args.k
        kinds[f"none@{b}"] = "none"
        backend_of[f"none@{b}"] = b
    ref_of = {m: "none" if b == primary else f"none@{b}" for m, b in backend_of.items()}
    targets = {b: load_target(options, backend=b) for b in sorted(set(backend_of.values()))}
    target = targets[primary]
    draft_method = next((m for m in methods if kinds[m] == "draft"), None)
    draft = load_draft_model(replace(options, method="draft"), backend_of[draft_method]) if draft_method else None
    hf_model = None
    if any(p.startswith("hf") for p in peers):  # the transformers peers need a torch model (built on first use)
        hf_model = next((t.hf_model for t in targets.values() if t.hf_model is not None), None)
        if hf_model is None:
            hf_model = load_target(options, backend="hf").hf_model
    n_ctx = min(t.backend.max_context for t in targets.values())
    limit = n_ctx - args.max_new_tokens  # the longest prompt kept
    llama_peer = _llamacpp_peer(args.model, threads, n_ctx) if "llama.cpp" in peers else None
    library = llama_peer.info if llama_peer is not None else None
    heads = {"eagle": args.eagle_head, "medusa": args.medusa_head}

    def setup_of(m):
        tree_m = tree if m in tree_methods else None
        opts = replace(options, method=kinds[m], draft=heads.get(kinds[m]) if method_row(kinds[m]).head else args.draft,
                       tree_nodes=tree_m[0] if tree_m else 0, tree_depth=tree_m[1] if tree_m else None,
                       tree_lookup=parsed[m].lookup if m in parsed else None,
                       lookup_from=parsed[m].lookup_from if m in parsed else "ngram", adapt=m in parsed and parsed[m].adapt,
                       skip_layers=skip,
                       draft_lookup=((parsed[m].draft_lookup if m in parsed else None) or options.draft_lookup)
                       if kinds[m] == "draft" else None)
        return build(opts, target=targets[backend_of[m]], draft_model=draft if kinds[m] == "draft" else None)

    setups = {m: setup_of(m) for m in methods}
    drafters = {m: s.drafter for m, s in setups.items()}
    engines = {m: s.engine() for m, s in setups.items()}
    params = SamplingParams()  # warm-up: greedy
    tok = target.tokenizer
    encoded = []

    chat = getattr(args, "chat", "auto")
    for p in prompts:
        ids = prompt_ids(tok, p["text"], chat)
        if len(ids) > limit:
            ids = ids[-limit:]  # keep the end: the instruction usually closes the prompt
        encoded.append(ids)

    # Warm up every path once (allocations, oneDNN packing, caches), and let the backend pick its
    # LM-head kernel for every verify width up front rather than inside a timed generation.
    warm = encoded[0][:32]
    longest = max(K_MAX if k == "auto" else k for k in method_k.values())
    widest = longest + 1
    if tree_methods:  # a tree pass: its nodes and the root, plus up to k rows of a lookup branch
        widest = max(widest, tree[0] + 1 + longest)
    for t in targets.values():
        t.backend.warm_up(warm, widest)
    for m, e in engines.items():
        e.generate(warm, max_new_tokens=8, params=params, k=method_k[m])
        if drafters[m] is not None:  # drafters that learn across prompts start the run afresh
            drafters[m].forget_history()
    per_prompt = [p for p in peers if p in PER_PROMPT]
    for p in per_prompt:
        _peer_generate(p, hf_model, llama_peer, warm, 8, target.eos_token_ids)

    names = methods + per_prompt
    config = {"model": args.model, "prompts_file": str(args.prompts), "categories": cats, "limit_per_category": args.limit_per_category,
              "methods": methods, "peers": peers, "k": args.k, "method_k": method_k, "max_new_tokens": args.max_new_tokens,
              "greedy": sampled_params.greedy, "temperature": temperature,
              "seeded": None if sampled_params.greedy else not unseeded,
              "prompts": len(prompts), "skip_layers": next((list(d.skip) for d in drafters.values() if hasattr(d, "skip")), None)}
    config["tree"] = list(tree) if tree else None
    config["chat_template"] = uses_chat(tok, chat)
    config["backend"] = ", ".join(type(t.backend).__name__ for t in targets.values())
    config["backend_by_method"] = backend_of
    kind, loc = resolve_source(args.model)
    if args.backend == "auto" and kind == "gguf":
        config["auto_backend_timing"] = kept_timing(loc)
    reports = {b: t.backend.report() for b, t in targets.items()}
    config["threads"] = reports[primary].get("threads", torch.get_num_threads())
    for r in reports.values():
        for attr in ("greedy_head", "body_kernel"):  # chosen by timing on this machine (native backend)
            if attr in r:
                config[attr] = r[attr]
    if all("batch_invariant" in r for r in reports.values()):
        config["batch_invariant"] = all(r["batch_invariant"] for r in reports.values())
        if "llama.cpp" in targets:
            config["llama_cpp"] = "exact mode (see docs); peer llama.cpp: llama.cpp's default settings"
    dtype = _weights_kind(target, reports[primary], hf_model)
    if library is not None:
        config["llama_cpp_peer"] = library  # llama-cpp-python's version and llama.cpp's own system info
    results = {"machine": machine_info(dtype), "config": config}
    tg_runs, tg_first, tg_failed = [], None, 0  # llama-bench's decode rate, once between each prompt's methods
    if "llama-bench" in peers:  # llama.cpp's own tool on the same file, and our prompt pass at its pp512
        results["llama_bench"] = llama_bench(loc, threads, getattr(args, "llama_tools", None))
        results["llama_bench"]["forerun_pp512"] = prompt_rate(target.backend, target.backend.vocab_size)
        tg_first = results["llama_bench"].get("tg128")
    records, reference_outputs = [], {}
    bar = tqdm(total=len(prompts) * (len(names) + (tg_first is not None)), desc="bench", unit="gen")
    if unseeded:
        torch.manual_seed(seed)  # each unseeded sequence's rejection sampler is seeded from it
    for i_prompt, (p, ids) in enumerate(zip(prompts, encoded)):
        params = sampled_params if sampled_params.greedy or unseeded else SamplingParams(temperature=temperature,
                                                                                          seed=seed + i_prompt)
        outs, prompt_recs = {}, []
        turn = i_prompt % len(names)  # every method and peer on the same prompt back to back (machine noise hits
        rotation = names[turn:] + names[:turn]  # all alike), each prompt one further along
        if tg_first is not None:  # llama-bench's decode steps among them, one place further each prompt
            rotation.insert(i_prompt % (len(rotation) + 1), LLAMA_BENCH_TG)
        order = -1
        for name in rotation:
            bar.set_postfix_str(f"{p['category']}:{name}")
            if name == LLAMA_BENCH_TG:
                try:
                    tg_runs.append(llama_bench_tg(loc, threads, getattr(args, "llama_tools", None)))
                except ForerunError as e:  # one failed run of the peer's tool does not end the bench
                    tg_failed += 1
                    tqdm.write(f"llama-bench failed between the methods of prompt {p['id']} ({e}); going on")
                if tg_runs:
                    results["llama_bench"]["tg128"] = {**interleaved_tg(tg_first, tg_runs), "failed_runs": tg_failed}
                bar.update(1)
                continue
            order += 1
            if name in engines:
                res = engines[name].generate(ids, max_new_tokens=args.max_new_tokens, params=params, k=method_k[name])
                out, rec = res.token_ids, res.stats.to_dict()
                if drafters[name] is not None and drafters[name].offers_tree_or_chain:  # eagle-tree+auto: what each step verified
                    rec["steps_by_choice"] = dict(engines[name].policy.choices)
            else:
                out, wall, prefill = _peer_generate(name, hf_model, llama_peer, ids, args.max_new_tokens, target.eos_token_ids)
                rec = {"new_tokens": len(out), "wall_s": wall}
                if prefill is not None:
                    rec["prefill_s"] = prefill
            outs[name] = out
            rec.update(method=name, id=p["id"], category=p["category"], prompt_tokens=len(ids), order=order)
            if name in backend_of:
                rec["backend"] = backend_of[name]
            prompt_recs.append(rec)
            bar.update(1)
        for name in ref_of.values():
            reference_outputs.setdefault(name, []).append(outs[name])
        for rec in prompt_recs:
            rec["equal_none"] = outs[rec["method"]] == outs[ref_of.get(rec["method"], "none")]
        records += sorted(prompt_recs, key=lambda r: names.index(r["method"]))
        results["methods"] = summarise(records, names, ref_of)
        for name, d in drafters.items():
            if getattr(d, "adapter", None) is not None:
                results["methods"][name]["adaptation"] = d.adapter.report()
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))  # checkpoint after each prompt
    bar.close()
    if llama_peer is not None:
        llama_peer.close()

    # Each backend's verify cost, timed on the prompts with the target's own continuations (its plain
    # decoding's outputs): the rows decoding sees.
    results["verify_cost_ratio_by_backend"], results["lm_head_kernels_ms"] = {}, None
    for b, t in targets.items():
        mine = [m for m in methods if backend_of[m] == b]
        tree_nodes, lazy, ks = tree_pricing(results["methods"], [m for m in mine if m in tree_methods], t.backend)
        texts = [ids + r_out for ids, r_out in zip(encoded, reference_outputs[ref_of[mine[0]]])]
        ratios = verify_cost_ratios(t.backend, ks=ks, lazy_trees=set(lazy.values()), texts=texts)
        results["verify_cost_ratio_by_backend"][b] = ratios
        if b == primary:
            results["verify_cost_ratio"] = ratios
        results["lm_head_kernels_ms"] = results["lm_head_kernels_ms"] or t.backend.head_timings(
            (*range(1, 10), 17), 7, text=max(texts, key=len) if texts else None)
        for name in mine:
            m = results["methods"][name]
            if name != ref_of[name] and "steps_by_choice" not in m:  # a tree or a chain or nothing per
                rows = tree_nodes.get(name)  # step (+auto) has no one draft shape to price
                if name in lazy:
                    rows = lazy_tree_key(*lazy[name])
                m["predicted_speedup_vs_none"] = predicted_speedup(m, results["methods"][ref_of[name]], ratios,
                                                                    rows, tree=name in tree_methods)
    fallbacks = [r["head_fallbacks"] for t in targets.values() if "head_fallbacks" in (r := t.backend.report())]
    if fallbacks:
        results["greedy_head_fallbacks"] = sum(fallbacks)
    results["records"] = records
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    write_markdown(results, out_dir / "results.md")

    charts = bench_charts(results, out_dir)
    if charts:
        with open(out_dir / "results.md", "a") as f:
            f.write("\n## Charts\n\n" + "\n".join(f"![{c.stem}]({c.name})" for c in charts) + "\n")
    print((out_dir / "results.md").read_text())
    return results
