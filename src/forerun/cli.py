"""Command line: ``forerun generate | bench | calibrate-layerskip``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from forerun.errors import ForerunError


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover
        pass


def _k_arg(value: str):
    from forerun.engine import check_k

    try:
        return check_k(value)
    except ForerunError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="bundled", help="bundled (default), HF hub id, local HF folder or .gguf file")
    p.add_argument("--draft", default=None, help="draft model for --method draft (same forms as --model)")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "llama.cpp", "native", "hf"],
                   help="llama.cpp (GGUF models, quantized CPU kernels) or torch (native Gemma 3 forward where "
                        "supported, else transformers; 'native' and 'hf' force one); auto: llama.cpp for a .gguf "
                        "model on the CPU when llama-cpp-python is installed, torch otherwise")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch and llama.cpp (default: torch's count)")
    p.add_argument("--skip-layers", default=None, help="layerskip: comma-separated layers to skip (default: calibrated set)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="forerun", description="Lossless speculative decoding.")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("prompt")
    _model_args(g)
    g.add_argument("--method", default="ngram", help="none | ngram | draft | layerskip (default ngram)")
    g.add_argument("--k", default=4, type=_k_arg, help="draft length 1..32 or auto (default 4)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")

    b = sub.add_parser("bench", help="benchmark methods and peers on Spec-Bench-format prompts")
    b.add_argument("--prompts", required=True, help="JSONL with question_id, category, turns")
    b.add_argument("--categories", default=None, help="comma-separated categories (default: all)")
    b.add_argument("--limit-per-category", type=int, default=None)
    b.add_argument("--methods", default="none,ngram,layerskip")
    b.add_argument("--peers", default="hf,hf-lookup", help="comma-separated: hf, hf-lookup, llama.cpp (empty for none)")
    b.add_argument("--k", default=4, type=_k_arg)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--out", default="runs/bench")
    _model_args(b)

    c = sub.add_parser("calibrate-layerskip", help="choose the layers layerskip drops, by measurement")
    _model_args(c)
    c.add_argument("--out", default=None, help="write the result JSON here (default: the model's cache entry)")
    c.add_argument("--new-tokens", type=int, default=96)
    c.add_argument("--corpus", default=None, help="text/JSONL corpus whose most frequent tokens the draft may always predict")
    c.add_argument("--draft-vocab", type=int, default=8192, help="how many frequent corpus tokens (with --corpus)")
    return ap


def _load(args):
    from forerun.models import load_model

    return load_model(args.model, dtype=args.dtype, device=args.device, backend=args.backend, threads=args.threads)


def cmd_generate(args) -> int:
    from forerun.drafters import METHODS, make_drafter, parse_skip_layers
    from forerun.engine import Engine
    from forerun.models import load_model
    from forerun.sampling import SamplingParams

    # Validate everything cheap before loading any model.
    if not args.prompt.strip():
        raise ForerunError("empty prompt")
    if args.max_new_tokens < 1:
        raise ForerunError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.method not in METHODS:
        raise ForerunError(f"unknown method {args.method!r} (choose {', '.join(METHODS)})")
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.method == "draft" and not args.draft:
        raise ForerunError("method draft needs a draft model (--draft MODEL)")
    if args.threads is not None and args.threads < 1:
        raise ForerunError(f"--threads must be >= 1, got {args.threads}")
    skip = parse_skip_layers(args.skip_layers)

    target = _load(args)
    draft = None
    if args.method == "draft":
        draft = load_model(args.draft, dtype=args.dtype, device=args.device, backend=args.backend, threads=args.threads)
    drafter = make_drafter(args.method, target, draft_model=draft, skip_layers=skip)
    tok = target.tokenizer
    if args.chat:
        if not getattr(tok, "chat_template", None):
            raise ForerunError("this tokenizer has no chat template; drop --chat")
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    else:
        ids = tok(args.prompt).input_ids
    engine = Engine(target.backend, drafter, target.eos_token_ids)
    res = engine.generate(ids, max_new_tokens=args.max_new_tokens, params=params, k=args.k)
    text = tok.decode(res.token_ids, skip_special_tokens=True)
    if args.json:
        s = res.stats
        out = {
            "text": text,
            "token_ids": res.token_ids,
            "finish_reason": res.finish_reason,
            "method": args.method,
            "model": args.model,
            **{k: v for k, v in s.to_dict().items()},
        }
        print(json.dumps(out))
    else:
        print(text)
    return 0


def cmd_bench(args) -> int:
    from forerun.bench import run_bench

    run_bench(args)
    return 0


def cmd_calibrate(args) -> int:
    from forerun.drafters.layer_skip import _calibration_file, calibrate

    from forerun.drafters.layer_skip import corpus_token_frequencies

    target = _load(args)
    extra = corpus_token_frequencies(target.tokenizer, args.corpus, args.draft_vocab) if args.corpus else []
    result = calibrate(target.backend, target.tokenizer, new_tokens=args.new_tokens, extra_vocab=extra,
                       log=lambda s: print(s, file=sys.stderr))
    path = args.out or _calibration_file(target)
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["best"]))
    return 0


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    _quiet_libraries()
    logging.basicConfig(level=logging.WARNING, format="forerun: %(message)s")
    try:
        return {"generate": cmd_generate, "bench": cmd_bench, "calibrate-layerskip": cmd_calibrate}[args.cmd](args)
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
