"""How far online adaptation can lift tau, whatever it costs: eagle:auto with the fixed head
against heads that adapt with far more updates than the default, over Spec-Bench as one stream.

Only tau is compared (the updates' time is ignored); each configuration starts from the shipped
head and runs the prompts in file order, greedy, 128 new tokens, torch backend.

    python bench/experiments/adapt_ceiling.py MODEL LIMIT_PER_CATEGORY OUT.json \\
        '{"fixed": null, "heavy": {"every": 2, "batch": 4, "lr": 0.0003, "tolerance": 1.0}}'

A configuration is ``null`` (no adaptation), ``true`` (the defaults) or ``OnlineAdapter`` options.
"""

import json
import sys
import time
from pathlib import Path

PROMPTS = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench" / "question.jsonl"


def main() -> None:
    from forerun.bench import load_prompts
    from forerun.chat import prompt_ids
    from forerun.drafters import make_drafter
    from forerun.engine import Engine
    from forerun.models import load_model
    from forerun.sampling import SamplingParams

    model, limit, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    configs = json.loads(sys.argv[4])
    prompts = load_prompts(str(PROMPTS), None, limit)
    target = load_model(model, backend="torch", threads=2)
    room = target.backend.max_context - 128
    encoded = [prompt_ids(target.tokenizer, p["text"], "auto")[-room:] for p in prompts]
    results = {}
    for name, cfg in configs.items():
        drafter = make_drafter("eagle", target, adapt=cfg)
        engine = Engine(target.backend, drafter, target.eos_token_ids)
        per, t0 = [], time.time()
        for ids in encoded:
            s = engine.generate(ids, max_new_tokens=128, params=SamplingParams(), k="auto").stats
            per.append((s.new_tokens, s.target_passes))
        third = len(per) // 3

        def tau(xs):
            return sum(a for a, _ in xs) / sum(b for _, b in xs)

        adapter = getattr(drafter, "adapter", None)
        results[name] = {"config": cfg, "tau": tau(per), "first_third": tau(per[:third]), "last_third": tau(per[-third:]),
                         "wall_s": time.time() - t0, "adapter": adapter.report() if adapter else None}
        print(name, json.dumps(results[name]), flush=True)
    Path(out).write_text(json.dumps({"model": model, "prompts": len(prompts), "limit_per_category": limit,
                                     "results": results}, indent=1))


if __name__ == "__main__":
    main()
