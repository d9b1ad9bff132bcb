"""A draft vocabulary: the tokens a draft model may propose when its LM head is cut to them.

A draft model's head over a 151,936-token vocabulary is a large share of a draft token's cost; the
tokens text is mostly made of are far fewer. The draft vocabulary is the tokenizer's special tokens,
then the tokens most frequent in a sample of Python's own standard library (its code and
docstrings: code and English prose, present wherever Python is) up to five eighths of ``n``, then
the lowest ids not yet taken (a BPE vocabulary's earliest merges: the commonest pieces of the text
the tokenizer was made from, prose of every kind) up to ``n``; counted once per tokenizer and kept
in the cache. (Five eighths, measured on the Qwen2.5-Coder pair's own greedy output for 18 chat
prompts and 5 code stubs, none from a benchmark: the share of its tokens the vocabulary holds went
from 0.929 to 0.937 on the chat answers and from 0.972 to 0.978 on the code, against the sample's
23,178 tokens taken whole; docs/drafters.md.) Lossless whatever it holds: the target verifies
every draft, and a sampling draft is judged against the restricted distribution it really drew
from.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections import Counter
from pathlib import Path

import torch

from forerun.paths import cache_dir

SAMPLE_BYTES = 6_000_000  # of the standard library's sources, taken in sorted path order
DRAFT_TOKENS = 32768  # a draft vocabulary's size where the draft model's own is larger than AUTO_ABOVE
AUTO_ABOVE = 65536
RULE = 3  # how the tokens are chosen (in the kept file's name: a new rule counts again)
SAMPLE_SHARE = 5 / 8  # of a vocabulary, the most its sample's tokens take (the rest: the lowest ids)


def _sample() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for f in sorted(root.rglob("*.py")):
        if "test" in f.parts or "site-packages" in f.parts:
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out.append(text)
        total += len(text)
        if total >= SAMPLE_BYTES:
            break
    return out


def draft_vocabulary(tokenizer, n: int) -> torch.Tensor:
    """``n`` token ids, sorted: the special tokens, the sample's most frequent up to ``SAMPLE_SHARE``
    of ``n``, then the lowest ids left."""
    vocab = len(tokenizer)
    if n >= vocab:
        return torch.arange(vocab)
    ident = hashlib.sha1(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()[:16]
    path = cache_dir() / "draft-vocab" / f"{ident}-{n}-r{RULE}.json"
    if path.is_file():
        return torch.tensor(json.loads(path.read_text()), dtype=torch.long)
    counts: Counter = Counter()
    for text in _sample():
        counts.update(tokenizer(text).input_ids)
    keep = {int(i) for i in tokenizer.all_special_ids if 0 <= int(i) < vocab}
    for t, _ in counts.most_common():
        if len(keep) >= int(n * SAMPLE_SHARE):
            break
        keep.add(t)
    fill = iter(range(vocab))
    while len(keep) < n:
        keep.add(next(fill))
    ids = sorted(keep)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ids))
    return torch.tensor(ids, dtype=torch.long)


def auto_draft_tokens(vocab_size: int, asked: int | None) -> int:
    """How many tokens a draft model drafts from: ``asked`` (0: all), else ``DRAFT_TOKENS`` where its
    vocabulary is over ``AUTO_ABOVE`` tokens, else all (0)."""
    if asked is not None:
        return 0 if asked >= vocab_size else asked
    return DRAFT_TOKENS if vocab_size > AUTO_ABOVE else 0
