"""The sampling-distribution harness: is what speculative decoding samples the target's own
distribution, position by position?

The target (``spread_target``) is a tiny Gemma 3 whose next-token distributions are spread out
(a test checks their entropy), so a sampler that drifts towards greedy, or ignores temperature,
top-k or top-p on one side of the acceptance rule, moves the counts far past the bound. Drafts
are several tokens long (``K``) and generations ``NEW = K + 2`` tokens, so positions after a
rejection, after a full acceptance (the bonus token) and after a second pass are all counted.
The exact per-position marginals come from the target alone by enumerating every prefix of
positive probability (top-k keeps them few).
"""

from __future__ import annotations

import math

import torch

from forerun.sampling import SamplingParams, logits_to_probs

PROMPT = [2, 7, 8, 7, 8, 7, 8]  # repeated pairs: the n-gram and suffix drafters propose from the start
K = 3
NEW = K + 2
# the settings every sampling test runs at: neither is temperature 1 without top-k/top-p
SETTINGS = {"t0.7-k4": dict(temperature=0.7, top_k=4), "t1.4-k6-p0.85": dict(temperature=1.4, top_k=6, top_p=0.85),
            # where the temperature alone moves the distribution past the bound (the two above keep
            # within it at temperature 1 with their own top-k/top-p: a test that checks it)
            "t0.5-k6": dict(temperature=0.5, top_k=6)}
N = 1200  # generations per check


def spread_target(seed: int = 5):
    from conftest import tiny_gemma, wrap

    return wrap(tiny_gemma(seed, init=0.06), name="tiny-spread")


def near_copy(lm, noise: float = 0.02, seed: int = 9):
    """The target with its weights perturbed a little: a draft model it accepts most drafts of
    (full acceptances, so bonus tokens), with q != p (real rejections and residuals)."""
    import copy

    from conftest import wrap

    model = copy.deepcopy(lm.hf_model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * noise)
    return wrap(model, name="tiny-spread-copy")


_EXACT: dict = {}


def exact(lm, setting: str, prompt=PROMPT, new: int = NEW, mask=None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(per-position marginals [V] for positions 0 .. new-1, the joint of positions 0 and 1 [V, V])
    of the target sampling alone at ``SETTINGS[setting]``. ``mask(prefix) -> bool [V]``: the tokens
    a grammar allows after the new tokens ``prefix`` (the rest get -inf logits before sampling)."""
    key = (id(lm), setting, tuple(prompt), new)
    if mask is None and key in _EXACT:
        return _EXACT[key]
    params = SamplingParams(**SETTINGS[setting])
    be = lm.backend.fork()
    be.reset()

    def probs(logits, prefix):
        logits = logits.float()
        if mask is not None:
            logits = logits.masked_fill(~mask(prefix), float("-inf"))
        return logits_to_probs(logits, params).cpu()  # marginals on the CPU

    first = probs(be.forward(torch.tensor(prompt), 0).logits[-1], [])
    V = first.numel()
    marg = [torch.zeros(V, dtype=torch.float64) for _ in range(new)]
    joint = torch.zeros(V, V, dtype=torch.float64)

    def walk(prefix: list[int], prob: float, dist: torch.Tensor):
        j = len(prefix)
        marg[j] += prob * dist.double()
        if j == 1:
            joint[prefix[0]] += prob * dist.double()
        if j + 1 == new:
            return
        for t in torch.nonzero(dist > 0).flatten().tolist():
            be.truncate(len(prompt) + j)
            nxt = probs(be.forward(torch.tensor([t]), len(prompt) + j).logits[-1], prefix + [t])
            walk(prefix + [t], prob * float(dist[t]), nxt)

    walk([], 1.0, first)
    if mask is None:
        _EXACT[key] = (marg, joint)
    return marg, joint


def entropy(p: torch.Tensor) -> float:
    p = p[p > 0].double()
    return float(-(p * p.log()).sum())


def tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts.double() / counts.sum() - probs.double()).abs().sum())


def bound(probs: torch.Tensor, n: int = N) -> float:
    """About three times the expected total variation of n correct samples from ``probs``: a
    correct sampler stays under it (the tests' seeds are fixed), a biased one does not."""
    p = probs.double().flatten()
    return 3.0 * 0.5 * float(torch.sqrt(2 * p * (1 - p) / (math.pi * n)).sum()) + 0.01


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's chi-square of counts against probs over the cells probs allows, and its degrees
    of freedom; a count where probs is 0 makes it infinite."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    if bool((counts[probs == 0] > 0).any()):
        return float("inf"), 1
    keep = probs > 0
    e = probs[keep] * counts.sum()
    return float(((counts[keep] - e) ** 2 / e).sum()), int(keep.sum()) - 1


def chi2_crit(df: int, z: float) -> float:
    """Chi-square's upper point at ``z`` normal deviations (Wilson-Hilferty: within a percent here)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def sample(generate, setting: str, n: int = N, new: int = NEW, seed: int = 0, seeded: bool = False):
    """Counts of ``generate(params) -> (token ids, drafted)`` over n fresh seeds: per position
    [new, V], the joint of positions 0 and 1 [V, V], and the tokens drafted. ``seeded``: each
    generation's params carry its seed (``SeededNoise``: each position's token from the seed's
    noise); else the seed goes to torch's global generator, from which an unseeded sequence's
    rejection sampler is seeded."""
    from conftest import VOCAB

    counts = torch.zeros(new, VOCAB, dtype=torch.float64)
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    drafted = 0
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        s = int(torch.randint(0, 2**31, (1,), generator=g))
        if not seeded:
            torch.manual_seed(s)
        ids, d = generate(SamplingParams(**SETTINGS[setting], seed=s if seeded else None))
        assert len(ids) == new, ids
        for j, t in enumerate(ids):
            counts[j, t] += 1
        joint[ids[0], ids[1]] += 1
        drafted += d
    return counts, joint, drafted


def check(lm, setting: str, counts: torch.Tensor, joint: torch.Tensor, prompt=PROMPT, exact_result=None) -> list[float]:
    """Every position's marginal and the first two tokens' joint within their bounds, and no token
    of probability 0 ever drawn; the TVs. ``exact_result``: the exact (marginals, joint) to hold
    them to, where not the target's own (``exact``)."""
    marg, jexact = exact_result or exact(lm, setting, prompt, counts.shape[0])
    out = []
    for j, m in enumerate(marg):
        zero = torch.nonzero((m == 0) & (counts[j] > 0)).flatten().tolist()
        assert not zero, f"position {j}: tokens of probability 0 drawn: {zero} ({setting})"
        d = tv(counts[j], m)
        assert d < bound(m), f"position {j}: TV {d:.3f} >= {bound(m):.3f} ({setting})"
        out.append(d)
    d = tv(joint, jexact)
    assert d < bound(jexact), f"joint of positions 0, 1: TV {d:.3f} >= {bound(jexact):.3f} ({setting})"
    return out + [d]
