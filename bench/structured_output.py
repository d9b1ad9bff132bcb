"""Structured output with speculation: a JSON-extraction set made from GSM8K word problems
(``bench/data/extraction.jsonl``, 30 of its train split's problems, never a benchmark's prompts:
each problem's people, quantities and question pulled out under one schema), decoded greedily
with and without the schema, plain and with each drafter, in one process.

    python bench/structured_output.py [--model smollm2] [--docs 30] [--methods none,ngram,suffix]
                                      [--draft MODEL] [--modes free,schema] [--threads N] [--out FILE.md]
    python bench/structured_output.py --write-prompts   rebuilds bench/data/extraction*.json* from GSM8K

Reports, per method and mode: decode tokens/s, the speed against plain decoding in the same mode,
the share of outputs that parse as JSON and that the schema accepts, and the constrained runs'
tokens the grammar forced. Every constrained output is checked equal to constrained plain
decoding's. The documents are GSM8K's train split (never a benchmark's prompts).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
        "quantities": {"type": "array", "maxItems": 6, "items": {
            "type": "object", "properties": {"what": {"type": "string", "maxLength": 40},
                                               "value": {"type": "number", "minimum": -1e9, "maximum": 1e9}},
            "required": ["what", "value"], "additionalProperties": False}},
        "question": {"type": "string", "maxLength": 160},
    },
    "required": ["people", "quantities", "question"],
    "additionalProperties": False,
}
INSTRUCTION = ("Extract from this problem, as JSON with the keys people (names), quantities (each with what "
               "and value) and question (what is asked):\n\n")


DATA = Path(__file__).resolve().parent / "data"


def write_prompts(n: int = 30) -> None:
    """The prompt set (Spec-Bench's format, for ``forerun loadtest --prompts``) and the request
    field that carries the schema (``--extra-body``), from the first n GSM8K train problems."""
    path = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"
    with open(path) as f:
        docs = [json.loads(line)["question"] for _, line in zip(range(n), f)]
    with open(DATA / "extraction.jsonl", "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"question_id": i, "category": "extraction-gsm8k", "turns": [INSTRUCTION + d]}) + "\n")
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "extraction", "strict": True,
                                                                       "schema": SCHEMA}}}
    (DATA / "extraction_response_format.json").write_text(json.dumps(body, indent=1))


def prompts(n: int) -> list[str]:
    with open(DATA / "extraction.jsonl") as f:
        return [json.loads(line)["turns"][0] for _, line in zip(range(n), f)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--docs", type=int, default=30)
    ap.add_argument("--write-prompts", action="store_true")
    ap.add_argument("--methods", default="none,ngram,suffix")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--draft", default=None, help="the draft model of method draft (e.g. qwen2.5-coder-0.5b)")
    ap.add_argument("--modes", default="free,schema", help="free (no grammar), schema, or both")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: every core)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.write_prompts:
        return write_prompts()

    import jsonschema_rs

    from forerun.chat import prompt_ids
    from forerun.constrain import Grammar
    from forerun.drafters import make_drafter
    from forerun.engine import Engine
    from forerun.models import load_model

    lm = load_model(args.model, backend="torch", threads=args.threads)
    draft = load_model(args.draft, backend="torch", threads=args.threads) if args.draft else None
    grammar = Grammar.json_schema(SCHEMA).bind(lm.tokenizer, lm.backend.vocab_size, lm.eos_token_ids)
    check = jsonschema_rs.validator_for(SCHEMA)
    ids = [prompt_ids(lm.tokenizer, p) for p in prompts(args.docs)]
    rows, plain = [], {}
    for mode in args.modes.split(","):
        for method in args.methods.split(","):
            drafter = make_drafter(method, lm, draft_model=draft if method == "draft" else None) if method != "none" else None
            eng = Engine(lm.backend, drafter, lm.eos_token_ids)
            eng.generate(ids[0], max_new_tokens=8, k="auto")  # warm
            toks = secs = ok_json = ok_schema = forced = 0
            outs = []
            for p in ids:
                t = time.perf_counter()
                r = eng.generate(p, max_new_tokens=args.max_new_tokens, k="auto",
                                 grammar=grammar if mode == "schema" else None)
                secs += time.perf_counter() - t - r.stats.prefill_s
                toks += len(r.token_ids)
                forced += r.stats.forced_accepted
                outs.append(r.token_ids)
                try:
                    obj = json.loads(lm.tokenizer.decode(r.token_ids, skip_special_tokens=True))
                    ok_json += 1
                    ok_schema += check.is_valid(obj)
                except json.JSONDecodeError:
                    pass
            if method == "none":
                plain[mode] = (toks / secs, outs)
            equal = sum(a == b for a, b in zip(outs, plain[mode][1]))
            rows.append((mode, method, toks / secs, toks / secs / plain[mode][0], ok_json, ok_schema, forced, equal))
            print(rows[-1], flush=True)
    n = len(ids)
    opts = "".join(f" --{k} {v}" for k, v in (("draft", args.draft), ("modes", args.modes), ("threads", args.threads))
                   if v is not None and v != "free,schema")
    lines = [f"`python bench/structured_output.py --model {args.model} --docs {args.docs} --methods {args.methods}{opts}`, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             "| output | method | decode tok/s | vs plain, same output | valid JSON | schema-valid | forced tokens | equal to plain |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, method, tps, ratio, oj, os_, fo, eq in rows:
        lines.append(f"| {mode} | {method} | {tps:.1f} | {ratio:.2f}x | {oj}/{n} | {os_}/{n} | {fo} | {eq}/{n} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        chart(rows, Path(args.out).with_suffix(".png"), args.model)


def chart(rows, path: Path, model: str) -> None:
    """Decode tokens/s per method, free text beside the schema-constrained output."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r[1] for r in rows))
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for j, mode in enumerate(("free", "schema")):
        tps = {r[1]: r[2] for r in rows if r[0] == mode}
        xs = [i + (j - 0.5) * 0.38 for i in range(len(methods))]
        bars = ax.bar(xs, [tps.get(m, 0) for m in methods], 0.38, label="free text" if mode == "free" else "JSON schema")
        for b, m in zip(bars, methods):
            ratio = next(r[3] for r in rows if r[0] == mode and r[1] == m)
            ax.annotate(f"{ratio:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(methods)), methods)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{model}: extraction, greedy, one sequence (x: vs plain, same output)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
