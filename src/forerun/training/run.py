"""``forerun train-draft``: data, features, training and export in one resumable command."""

from __future__ import annotations

import random
import shlex
import sys
import time
from pathlib import Path

import torch

from forerun.drafters import load_trained_head, require_hidden_states
from forerun.drafters.head_training import TrainConfig, Trainer, extract_features
from forerun.errors import ForerunError
from forerun.models import load_model
from forerun.training.data import corpus_sequences, distill_prompts, read_corpus, self_distill, two_stage_prompts
from forerun.training.prompt_sets import read_prompt_set


def distill_seeds(args) -> list[int]:
    """``--distill-seeds 0,1,2`` -> [0, 1, 2]; default: ``--seed`` alone."""
    text = getattr(args, "distill_seeds", None)
    if not text:
        return [args.seed]
    try:
        seeds = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ForerunError(f"--distill-seeds must be comma-separated integers, got {text!r}") from None
    if not seeds:
        raise ForerunError("--distill-seeds names no seed")
    return list(dict.fromkeys(seeds))


def train_draft(args, log=print) -> dict:
    t0 = time.time()
    if not 0.0 <= getattr(args, "soft_labels", 0.0) <= 1.0:
        raise ForerunError(f"--soft-labels must be between 0 and 1, got {args.soft_labels}")
    keep_vocab = bool(getattr(args, "keep_vocab", False))
    if keep_vocab and not getattr(args, "init", None):
        raise ForerunError("--keep-vocab keeps the draft vocabulary of the --init head; give --init")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    work = Path(args.work) if args.work else out.with_name(out.name + "-work")
    work.mkdir(parents=True, exist_ok=True)
    # Features come from our own float32 forward of the target (the torch backend).
    target = load_model(args.model, backend="torch", threads=args.threads)
    be = target.backend
    require_hidden_states(target, "train-draft")
    # A head to start from is checked now, not after an hour of self-distillation.
    init = load_trained_head(args.kind, target, args.init, option="init") if getattr(args, "init", None) else None
    seqs, times = [], {}
    if args.data in ("corpus", "both"):
        seqs += corpus_sequences(target.tokenizer, read_corpus(args.corpus), args.max_len)
        log(f"corpus: {len(seqs)} sequences")
    if args.data in ("distill", "both"):
        t = time.time()
        # Every prompt-set seed adds its own draw of seed prompts (the same seed always draws the same
        # prompts, so answers already in the work folder are reused).
        seeds = distill_seeds(args)
        if getattr(args, "prompts", None):
            # A prompt-set file: seed s answers the s-th slice of --distill-prompts prompts of the file in
            # a fixed shuffled order, so that seeds never repeat each other's prompts.
            pool = read_prompt_set(args.prompts)
            random.Random(0).shuffle(pool)
            prompts = [p for s in seeds for p in pool[s * args.distill_prompts : (s + 1) * args.distill_prompts]]
            if not prompts:
                raise ForerunError(f"{args.prompts} holds {len(pool)} prompts: no slice of {args.distill_prompts} "
                                   f"for seeds {','.join(map(str, seeds))}")
            log(f"prompts: {len(prompts)} from {args.prompts}")
        else:
            prompts = [p for s in seeds for p in distill_prompts(args.corpus, args.distill_prompts, s)]
        # Answers come from the fastest exact backend (--backend auto), several at once where it batches.
        gen = load_model(args.model, backend="auto", threads=args.threads)
        batch = getattr(args, "distill_batch", 8)
        for s in seeds if args.passage_prompts else ():
            prompts += two_stage_prompts(gen, args.passage_prompts, work / "distill.jsonl", seed=s,
                                         max_new_tokens=args.distill_tokens, log=log, batch=batch)
        prompts = list(dict.fromkeys(prompts))
        answers = self_distill(gen, prompts, work / "distill.jsonl", max_new_tokens=args.distill_tokens, log=log,
                               batch=batch)
        del gen
        seqs += [type(s)(s.ids[: args.max_len], s.start) for s in answers if s.start < args.max_len - 2]
        times["distill_s"] = round(time.time() - t, 1)
        log(f"self-distillation: {len(answers)} answers")
    if len(seqs) < 2:
        raise ForerunError("not enough training data (need at least 2 sequences)")
    tc = TrainConfig(kind=args.kind, draft_vocab=args.draft_vocab, steps_ahead=args.steps_ahead, epochs=args.epochs,
                     lr=args.lr, batch_tokens=args.batch_tokens, seed=args.seed,
                     soft_labels=getattr(args, "soft_labels", 0.0), shape=getattr(args, "shape", "forerun"))
    trainer = Trainer.of_target(tc, be.model)
    t = time.time()
    examples = extract_features(be, seqs, trainer.extract_layers, work / f"features-{args.kind}.pt", log=log)
    times["features_s"] = round(time.time() - t, 1)
    t = time.time()
    head, report = trainer.train(examples, work, always_vocab=sorted(target.eos_token_ids), log=log, init=init,
                                 keep_vocab=keep_vocab)
    times["train_s"] = round(time.time() - t, 1)
    times["total_s"] = round(time.time() - t0, 1)
    head.cfg.training = {"command": "forerun " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else "",
                         "model": args.model, "data": args.data, "corpus": Path(args.corpus).name if args.corpus else None,
                         "distill_prompts": args.distill_prompts if args.data != "corpus" else 0,
                         "prompts": Path(args.prompts).name if getattr(args, "prompts", None) else None,
                         "passage_prompts": args.passage_prompts if args.data != "corpus" else 0,
                         "distill_seeds": distill_seeds(args) if args.data != "corpus" else [],
                         "distill_tokens": args.distill_tokens, "max_len": args.max_len,
                         "init": init.cfg.training.get("command") if init is not None else None,
                         "keep_vocab": keep_vocab,
                         "seconds": times, **report}
    head.save(out)
    final = report["history"][-1]["val_agreement"] if report["history"] else None
    log(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB); validation top-1 agreement "
        f"per position: {final}")
    return {"out": str(out), "val_agreement": final, "seconds": times,
            "draft_vocab_coverage_val": report.get("draft_vocab_coverage_val")}
