"""Turning logits into tokens, and the lossless rejection sampler.

Notation (Leviathan et al. 2023; Chen et al. 2023): p is the target distribution, q the
draft distribution. Output tokens are *accepted* (a draft token kept), *recovered*
(sampled from the normalised residual max(0, p - q) after a rejection) or *bonus*
(sampled from p after the last draft token when all were accepted).

Everything here is a pure tensor function with a leading batch dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forerun.errors import ForerunError

GREEDY_BELOW = 1e-5  # temperatures under this decode greedily (as vLLM does)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ForerunError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ForerunError(f"top-k must be an integer >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ForerunError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small (below ``GREEDY_BELOW``) that dividing logits by it would
        overflow float32 or leave only the top token: decoded greedily."""
        return self.temperature < GREEDY_BELOW

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | SeededNoise:
        """What a sequence draws its randomness from: with a seed, ``SeededNoise`` (every token a
        function of the seed, its position and the target's distribution); else a generator for
        the rejection sampler, seeded from torch's global generator (``torch.manual_seed`` makes
        unseeded runs repeatable in a script)."""
        if self.seed is not None:
            return SeededNoise(self.seed)
        return torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**62, (1,), device="cpu")))


_MASK64 = (1 << 64) - 1


def _mix(seed: int, position: int) -> int:
    """A 63-bit generator seed from (seed, position): splitmix64's finaliser over both, so that
    nearby seeds and positions give unrelated streams."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + (int(position) + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class SeededNoise:
    """A seeded sequence's randomness: for the token at each position, exponential noise E over
    the vocabulary drawn from (seed, position) alone, and the token argmax(p / E), an exact sample
    of p (the exponential race; Gumbel-max in another form). Positions are independent, so a
    sequence drawn this way is an exact sample of the target; and since the noise of a position
    does not depend on what was drafted, the batch or the load, verification needs only to keep a
    drafted token when it equals that sample: the text is the one plain decoding with the same
    seed gives, whatever drafts were offered. A drafter that samples (a draft model, a head)
    draws its proposals with the same noise, so it agrees with the target as often as two such
    coupled samples do. The noise is drawn on the CPU (the same numbers on every machine) and kept
    for the positions still ahead of the sequence."""

    def __init__(self, seed: int):
        self.seed = int(seed)
        self._noise: dict[tuple[int, int], torch.Tensor] = {}

    def noise(self, position: int, vocab: int) -> torch.Tensor:
        """E [vocab] float32 for the token at ``position`` (the same for every caller)."""
        key = (position, vocab)
        e = self._noise.get(key)
        if e is None:
            g = torch.Generator(device="cpu").manual_seed(_mix(self.seed, position))
            u = torch.rand(vocab, generator=g, device="cpu")  # [0, 1) in steps of 2^-24
            # E = -log(1 - u), kept above 0 so that a token of probability 0 never wins (0 / 0)
            e = self._noise[key] = torch.log1p(-u).neg_().clamp_(min=2.0 ** -30)
        return e

    def sample(self, probs: torch.Tensor, position: int) -> torch.Tensor:
        """The token at ``position`` drawn from ``probs`` [vocab] (0-dim int64, on probs' device)."""
        return (probs.float() / self.noise(position, probs.shape[-1]).to(probs.device)).argmax(-1)

    def samples(self, probs: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """One token per row of ``probs`` [R, vocab], row r's at ``positions[r]`` ([R] int64, CPU)."""
        self.forget_before(min(positions, default=0))
        e = torch.stack([self.noise(q, probs.shape[-1]) for q in positions]).to(probs.device)
        return (probs.float() / e).argmax(-1).cpu()

    def forget_before(self, position: int) -> None:
        """Drop the noise of positions before ``position`` (committed: never drawn again)."""
        for key in [k for k in self._noise if k[0] < position]:
            del self._noise[key]


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p, the same way for target and draft.

    logits: [..., vocab] -> probs [..., vocab] (float32). Greedy (temperature 0) gives a
    one-hot distribution on the argmax, so the sampler needs no special case.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens strictly before it already reach top_p; the first always stays.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample one token per row: argmax(probs / E) with E ~ Exponential(1) (no host sync).

    probs: [..., vocab] -> [...] int64.
    """
    e = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / e).argmax(-1)


def greedy_verify(
    draft_tokens: torch.Tensor,  # [batch, k]
    target_logits: torch.Tensor,  # [batch, k + 1, vocab]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance: keep drafts while they equal the target's argmax.

    Returns (tokens [batch, k + 1], num_accepted [batch]); row b's output is
    tokens[b, : num_accepted[b] + 1] (accepted drafts then the target's own token).
    """
    return greedy_accept(draft_tokens, target_logits.argmax(-1))


def greedy_accept(
    draft_tokens: torch.Tensor,  # [batch, k]
    target: torch.Tensor,  # [batch, k + 1] the target's argmax at every position
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance from the target's argmax tokens (see ``greedy_verify``)."""
    k = draft_tokens.shape[1]
    match = (draft_tokens == target[:, :k]).int()
    n = match.cumprod(-1).sum(-1)  # accepted prefix length
    return target, n


def rejection_sample(
    draft_tokens: torch.Tensor,  # [batch, k]
    q: torch.Tensor,  # [batch, k, vocab] draft probs of each draft position
    p: torch.Tensor,  # [batch, k + 1, vocab] target probs
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling.

    Draft token i is accepted with probability min(1, p_i(d) / q_i(d)); the first rejection
    is replaced by a *recovered* token from norm(max(0, p_i - q_i)); when all k pass, a
    *bonus* token comes from p_k. The output is distributed exactly as p.

    A deterministic drafter (n-gram) passes a one-hot q. A draft token with q(d) = 0 cannot
    have been drawn from q; it is accepted only with probability p(d) (as if q were one-hot
    on it), which keeps the division NaN-free.

    Returns (tokens [batch, k + 1], num_accepted [batch]); row b's output is
    tokens[b, : num_accepted[b] + 1].
    """
    batch, k = draft_tokens.shape
    device = p.device
    if k == 0:
        return sample(p[:, 0], generator)[:, None], torch.zeros(batch, dtype=torch.long, device=device)
    idx = draft_tokens[..., None]
    p_d = p[:, :k].gather(-1, idx).squeeze(-1)  # [batch, k]
    q_d = q.gather(-1, idx).squeeze(-1)
    q_safe = torch.where(q_d > 0, q_d, torch.ones_like(q_d))
    u = torch.rand(batch, k, generator=generator, device=device)
    accept = u * q_safe <= p_d
    accept &= p_d > 0  # u can be exactly 0: a token the target forbids is never kept
    n = accept.int().cumprod(-1).sum(-1)  # [batch]
    # Distribution of the token after the accepted prefix: residual after a rejection, p after all k.
    rows = torch.arange(batch, device=device)
    p_next = p[rows, n]  # [batch, vocab]
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # q of the bonus slot is 0
    q_next = q_pad[rows, n]
    # A point-mass draft (q(d) = 0 case above) behaves as a one-hot q on d.
    d_next = torch.cat([draft_tokens, torch.zeros_like(draft_tokens[:, :1])], dim=1)[rows, n]
    zero_q = (n < k) & (q_next.gather(-1, d_next[:, None]).squeeze(-1) <= 0)
    if bool(zero_q.any()):
        onehot = torch.zeros_like(q_next).scatter_(-1, d_next[:, None], 1.0)
        q_next = torch.where(zero_q[:, None], onehot, q_next)
    residual = (p_next - q_next).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # p == q exactly leaves no residual; a rejection is then impossible, fall back to p.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
    next_token = sample(residual, generator)
    out = torch.cat([draft_tokens, torch.zeros_like(draft_tokens[:, :1])], dim=1)
    out[rows, n] = next_token
    return out, n
