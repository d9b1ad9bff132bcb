"""Training text for a drafter: a corpus read as is, or the target's own answers to seed prompts.

Both give token sequences with a loss mask: which positions the drafter learns to predict.
Corpus text is learned everywhere; a self-distilled sequence only where the target wrote it
(its answer), since the drafter's job is to guess what the target will say.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from tqdm import tqdm

from forerun.batching import BatchRequest
from forerun.build import Options, build
from forerun.chat import prompt_ids
from forerun.drafters.head_training import Sequence
from forerun.errors import ForerunError
from forerun.training.seeds import builtin_prompts, passage_writer_prompts, stage_two


def read_corpus(path: str | Path) -> list[str]:
    """Texts from a JSONL file (fields question/answer, prompt/response, text, or turns) or plain text
    (one text per blank-line-separated paragraph)."""
    path = Path(path)
    if not path.exists():
        raise ForerunError(f"corpus {path} does not exist")
    texts: list[str] = []
    if path.suffix == ".jsonl":
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ForerunError(f"{path}:{i}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ForerunError(f"{path}:{i}: expected a JSON object")
            parts = [obj[k] for k in ("question", "prompt", "text") if isinstance(obj.get(k), str)]
            parts += [obj[k] for k in ("answer", "response") if isinstance(obj.get(k), str)]
            if not parts and isinstance(obj.get("turns"), list):
                parts = [t for t in obj["turns"] if isinstance(t, str)]
            if not parts:
                raise ForerunError(f"{path}:{i}: no text field (question/answer, prompt/response, text or turns)")
            texts.append("\n".join(parts))
    else:
        texts = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    if not texts:
        raise ForerunError(f"corpus {path} holds no text")
    return texts


def read_seed_questions(path: str | Path) -> list[str]:
    """The prompt half of each corpus record (the question, prompt or first turn)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            obj = json.loads(line)
            q = obj.get("question") or obj.get("prompt") or (obj.get("turns") or [None])[0] or obj.get("text")
            if isinstance(q, str) and q.strip():
                out.append(q.strip())
    return out


def corpus_sequences(tokenizer, texts: list[str], max_len: int) -> list[Sequence]:
    seqs = []
    for t in texts:
        ids = tokenizer(t).input_ids[:max_len]
        if len(ids) >= 3:
            seqs.append(Sequence(ids, 1))
    return seqs


def distill_prompts(corpus_path: str | Path | None, n: int, seed: int) -> list[str]:
    """Seed prompts: a sixth are the corpus's own questions, the rest varied tasks (``seeds.py``), some over
    the corpus's text."""
    questions = read_seed_questions(corpus_path) if corpus_path and str(corpus_path).endswith(".jsonl") else []
    rng = random.Random(seed)
    rng.shuffle(questions)
    n_corpus = min(len(questions), n // 6)
    prompts = questions[:n_corpus] + builtin_prompts(questions[n_corpus:], n - n_corpus, seed)
    seen, out = set(), []
    for p in prompts:
        if p not in seen:
            seen.add(p)
            out.append(p)
    rng.shuffle(out)
    return out


def two_stage_prompts(target, n: int, out_path: Path, *, seed: int, max_new_tokens: int, log=print,
                      batch: int = 8) -> list[str]:
    """Stage-1 prompts, then stage-2 prompts over material the target wrote itself (German text to translate, articles to
    summarise, passages to answer from, reviews to rate): stage 1 (answers of up to twice
    ``max_new_tokens``, so that articles are long) is answered and kept as training data first."""
    plan = passage_writer_prompts(n, seed)
    self_distill(target, [p for p, _, _ in plan], out_path, max_new_tokens=2 * max_new_tokens, log=log,
                 desc="self-distill (passages)", batch=batch)
    written = {}
    for line in out_path.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        written[rec["prompt"]] = target.tokenizer.decode(rec["output_ids"], skip_special_tokens=True).strip()
    out = [p for p, _, _ in plan]  # stage-1 answers are training data too
    for p, family, topic in plan:
        if written.get(p):
            out += stage_two(family, written[p], topic)
    return list(dict.fromkeys(out))


def greedy_answers(target, prompts: list[str], *, max_new_tokens: int, desc: str, batch: int = 8):
    """Yield (prompt, prompt ids, the target's greedy answer ids) for each prompt as it finishes, with a
    progress bar. An instruct model (a tokenizer with a chat template) answers each prompt as a user
    turn. On a backend that decodes several sequences in one pass, ``batch`` answers are decoded
    together (the server's batch engine, plain greedy decoding): on batch-invariant backends the
    answers are the ones a lone sequence gets, only sooner. Elsewhere one at a time, with n-gram
    speculation (lossless, so it only makes the answers come faster)."""
    tok = target.tokenizer
    limit = target.backend.max_context - max_new_tokens
    todo = [(p, prompt_ids(tok, p)[-limit:]) for p in prompts]  # as a user turn where the model has a chat template
    bar = tqdm(total=len(todo), desc=desc, unit="prompt")
    if batch > 1 and target.backend.capabilities.batched:
        engine = build(Options(target.name), target=target).batch_engine(max_batch=batch, max_waiting=len(todo) + 1)
        done: list[tuple[str, list[int], list[int]]] = []
        made, t0 = 0, time.perf_counter()

        def listener(p, ids, req):
            out: list[int] = []

            def on_event(tokens, finish):  # on this thread, inside engine.step()
                nonlocal made
                made += len(tokens)
                out.extend(tokens)
                if finish == "error":
                    raise_later.append(f"answering {p[:60]!r} failed: {req.error}")
                elif finish is not None:
                    done.append((p, ids, out))
            return on_event

        raise_later: list[str] = []
        for p, ids in todo:
            req = BatchRequest(prompt=ids, max_new_tokens=max_new_tokens)
            req.on_event = listener(p, ids, req)
            engine.submit(req)
        while engine.n_waiting or engine.n_running or done:
            if raise_later:
                raise ForerunError(raise_later[0])
            while done:
                yield done.pop(0)
                bar.update(1)
                bar.set_postfix_str(f"{made / max(time.perf_counter() - t0, 1e-9):.0f} tok/s")
            if engine.n_waiting or engine.n_running:
                engine.step()
        bar.close()
        return

    engine = build(Options(target.name, method="ngram"), target=target).engine()
    for p, ids in todo:
        yield p, ids, engine.generate(ids, max_new_tokens=max_new_tokens, k="auto").token_ids
        bar.update(1)
    bar.close()


def self_distill(target, prompts: list[str], out_path: Path, *, max_new_tokens: int, log=print,
                 desc: str = "self-distill", batch: int = 8) -> list[Sequence]:
    """The target answers each prompt (greedy); answers are appended to ``out_path`` as JSONL as
    they come, so an interrupted run resumes where it stopped."""
    done: dict[str, dict] = {}
    if out_path.exists():
        for line in out_path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
                done[rec["prompt"]] = rec
            except (json.JSONDecodeError, KeyError):
                break  # a line cut by an interruption: everything before it is kept
    todo = [p for p in prompts if p not in done]
    if done:
        log(f"self-distillation: {len(done)} answers found in {out_path}, {len(todo)} to go")
    with out_path.open("a", encoding="utf-8") as f:
        for p, ids, out in greedy_answers(target, todo, max_new_tokens=max_new_tokens, desc=desc, batch=batch):
            rec = {"prompt": p, "prompt_ids": ids, "output_ids": out}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            done[p] = rec
    return [Sequence(done[p]["prompt_ids"] + done[p]["output_ids"], len(done[p]["prompt_ids"]))
            for p in prompts if p in done and done[p]["output_ids"]]
