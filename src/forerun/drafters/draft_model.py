"""An independent small model with the target's tokenizer drafts autoregressively."""

from __future__ import annotations

import torch

from forerun.drafters.base import Draft, Drafter
from forerun.sampling import SeededNoise, logits_to_probs, sample


class DraftModelDrafter(Drafter):
    name = "draft"

    def __init__(self, backend, vocab: torch.Tensor | None = None, head=None):
        """``vocab``: the token ids the draft may propose (``draft_vocab``), its LM head cut to them."""
        self.backend = backend  # its own KV cache, kept in step with the committed tokens
        self.vocab = None if vocab is None else vocab.to(backend.device)
        self.head = head
        if vocab is not None and head is None:  # the integer kernels' rows where the model runs on them
            self.head = getattr(backend, "integer_sub_head", lambda r: None)(vocab) or backend.sub_head(vocab)

    def begin(self, prompt, params, generator):
        super().begin(prompt, params, generator)
        self.backend.reset()

    def fork(self) -> "DraftModelDrafter":
        return DraftModelDrafter(self.backend.fork(), self.vocab, self.head)

    def propose(self, tokens: list[int], k: int) -> Draft:
        be = self.backend
        # Catch up on tokens the draft has not seen (the last one, plus any correction/bonus).
        start = min(be.length, len(tokens) - 1)
        feed = torch.tensor(tokens[start:], dtype=torch.long, device=be.device)
        return autoregressive_draft(be, feed, start, k, self.params, self.generator, **self.forward_kwargs(tokens))

    def forward_kwargs(self, tokens: list[int]) -> dict:
        """Extra arguments for the draft backend's forward (a draft vocabulary's head; subclasses:
        skipped layers)."""
        return {} if self.vocab is None else {"head": self.head, "vocab_map": self.vocab}

    def accepted(self, tokens: list[int], num_accepted: int) -> None:
        # Cached positions are valid up to the last accepted draft; the new token is fed next time.
        self.backend.truncate(min(self.backend.length, len(tokens) - 1))


def pick_token(logits, params, generator, vocab_map=None, vocab_size=None, position: int = 0):
    """One draft token from logits [n]: (token id, q over the full vocabulary, or None when greedy).

    ``vocab_map`` [n] (optional): the logits cover these token ids only; q is zero elsewhere.
    ``position``: the token's index in the sequence; a seeded sequence (``SeededNoise``) draws it
    with the noise the target's own token at that position is drawn with.
    """
    if params.greedy:
        tok = logits.argmax(-1)
        return (tok if vocab_map is None else vocab_map[tok]), None
    q = logits_to_probs(logits, params)
    if vocab_map is not None:
        q = torch.zeros(vocab_size, device=q.device).scatter_(0, vocab_map, q)
    if isinstance(generator, SeededNoise):
        return generator.sample(q, position), q
    return sample(q, generator), q


def autoregressive_draft(backend, feed, pos, k, params, generator, vocab_map=None, **fwd) -> Draft:
    """Run ``feed`` at ``pos``, then draft k tokens one at a time. Shared by model-based drafters.

    ``vocab_map`` [n] (optional): the forward returns logits over these token ids only.
    """
    out, qs = [], []
    for _ in range(k):
        logits = backend.forward(feed, pos, last_only=True, **fwd).logits[-1]
        pos += feed.numel()  # the drafted token's index
        tok, q = pick_token(logits, params, generator, vocab_map, backend.vocab_size, position=pos)
        if q is not None:
            qs.append(q)
        out.append(tok)
        feed = tok.view(1)
    tokens = torch.stack(out) if out else torch.zeros(0, dtype=torch.long, device="cpu")
    return Draft(tokens=tokens.cpu(), q=torch.stack(qs) if qs else None)
