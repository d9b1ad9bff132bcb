import pytest
import torch
from spread import chi2

from forerun.errors import ForerunError
from forerun.sampling import SamplingParams, greedy_verify, logits_to_probs, rejection_sample, sample


def test_temperature_top_k_top_p_hand_built():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.10]]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(p, torch.tensor([[0.5, 0.25, 0.15, 0.10]]), atol=1e-6)
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]), atol=1e-6)
    # top-p 0.7: 0.5 alone is below 0.7, 0.5 + 0.25 reaches it -> keep two tokens.
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]), atol=1e-6)
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert torch.allclose(p, torch.tensor([[1.0, 0, 0, 0]]), atol=1e-6)
    # Temperature 0.5 squares the probabilities before normalising.
    p = logits_to_probs(logits, SamplingParams(temperature=0.5))
    sq = torch.tensor([0.5, 0.25, 0.15, 0.10]) ** 2
    assert torch.allclose(p[0], sq / sq.sum(), atol=1e-6)
    # Greedy is one-hot on the argmax.
    assert logits_to_probs(logits, SamplingParams()).tolist() == [[1.0, 0, 0, 0]]


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)])
def test_bad_params(kw):
    with pytest.raises(ForerunError):
        SamplingParams(**kw)


def test_greedy_verify_cases():
    V = 6
    target = torch.tensor([[3, 1, 4, 1, 5]])  # argmax tokens at the k + 1 positions
    logits = torch.nn.functional.one_hot(target, V).float()
    out, n = greedy_verify(torch.tensor([[3, 1, 4, 1]]), logits)
    assert n.tolist() == [4] and out[0].tolist() == [3, 1, 4, 1, 5]  # all accepted + bonus
    out, n = greedy_verify(torch.tensor([[3, 2, 4, 1]]), logits)
    assert n.tolist() == [1] and out[0, 1].item() == 1  # mismatch at 2: target's own token
    out, n = greedy_verify(torch.tensor([[0, 1, 4, 1]]), logits)
    assert n.tolist() == [0] and out[0, 0].item() == 3


def test_rejection_sampler_exact_cases():
    V = 4
    p = torch.tensor([[[0, 1.0, 0, 0], [0, 0, 1.0, 0]]])
    q = torch.tensor([[[0, 1.0, 0, 0]]])
    out, n = rejection_sample(torch.tensor([[1]]), q, p)
    assert n.item() == 1 and out[0].tolist() == [1, 2]  # accepted, then bonus from p
    out, n = rejection_sample(torch.tensor([[3]]), torch.tensor([[[0, 0, 0, 1.0]]]), p)
    assert n.item() == 0 and out[0, 0].item() == 1  # rejected, recovered from max(0, p - q)
    # q gave the draft token probability 0: no NaN, and the target forbids it -> rejected.
    out, n = rejection_sample(torch.tensor([[0]]), torch.tensor([[[0, 0.5, 0.5, 0]]]), p)
    assert n.item() == 0 and out[0, 0].item() == 1
    assert V == p.shape[-1]


def test_seeded_determinism():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(3, 5, 50), -1)
    q = torch.softmax(torch.randn(3, 4, 50), -1)
    d = sample(q, torch.Generator().manual_seed(1))
    a = rejection_sample(d, q, p, torch.Generator().manual_seed(7))
    b = rejection_sample(d, q, p, torch.Generator().manual_seed(7))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


@pytest.mark.parametrize("onehot_q", [False, True])
def test_rejection_sampler_distribution_equals_p(onehot_q):
    """Sample a batch of 200k independent speculative steps; each output position must follow p."""
    g = torch.Generator().manual_seed(123)
    V, k, B = 8, 3, 200_000
    p1 = torch.softmax(torch.randn(k + 1, V, generator=g) * 1.5, -1)
    q1 = torch.softmax(torch.randn(k, V, generator=g) * 1.5, -1)
    p = p1.expand(B, k + 1, V)
    q = q1.expand(B, k, V)
    d = sample(q, g)  # [B, k] drafts drawn from q
    if onehot_q:  # a deterministic drafter: always proposes token 0, q is one-hot
        d = torch.zeros(B, k, dtype=torch.long)
        q = torch.nn.functional.one_hot(d, V).float()
    out, n = rejection_sample(d, q, p, g)
    first = torch.bincount(out[:, 0], minlength=V).float()
    # The first output token is distributed as p_0 regardless of what was accepted after it.
    tv = _tv(first, p1[0])
    assert tv < 0.01, tv
    # Chi-square, 7 degrees of freedom: 99.9% quantile is 24.3.
    stat, df = chi2(first, p1[0])
    assert df == 7 and stat < 24.3, stat
    # Given the first token was an accepted draft (n >= 1), the second output follows p_1.
    rows = n >= 1
    second = torch.bincount(out[rows, 1], minlength=V).float()
    assert _tv(second, p1[1]) < 0.02


def test_sampler_detects_a_broken_residual():
    """The statistical check is not vacuous: sampling the recovered token from p (not the residual) fails it."""
    g = torch.Generator().manual_seed(5)
    V, B = 8, 200_000
    p1 = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    q1 = torch.softmax(torch.randn(1, V, generator=g) * 1.5, -1)
    d = sample(q1.expand(B, 1, V), g)
    pd, qd = p1[0, d[:, 0]], q1[0, d[:, 0]]
    accept = torch.rand(B, generator=g) * qd <= pd
    wrong = torch.where(accept, d[:, 0], sample(p1[0].expand(B, V), g))
    assert _tv(torch.bincount(wrong, minlength=V).float(), p1[0]) > 0.02


def test_a_draft_with_mass_where_the_target_has_none_still_samples_p_exactly():
    """Top-k has cut half of the target's vocabulary at every position (p = 0 there) while the
    draft's q spreads over all of it. Over 400,000 independent steps of 3 drafts: the first token's
    counts, and the second's among steps that accepted the first draft, pass a chi-square test
    against p (99.9% point), and no token of probability 0 is ever emitted. The same test at the
    same size fails draws from p shifted by a total variation of 0.01 (mass moved between two
    tokens): a shift that small is seen."""
    g = torch.Generator().manual_seed(11)
    V, k, B = 8, 3, 400_000
    p1 = torch.softmax(torch.randn(k + 1, V, generator=g) * 1.5, -1)
    for j in range(k + 1):  # top-4 at every position
        p1[j][torch.argsort(p1[j])[:4]] = 0
        p1[j] /= p1[j].sum()
    q1 = torch.softmax(torch.randn(k, V, generator=g), -1)
    q = q1.expand(B, k, V)
    out, n = rejection_sample(sample(q, g), q, p1.expand(B, k + 1, V), g)
    crit = 16.27  # chi-square's 99.9% point at 3 degrees of freedom (4 allowed tokens)
    first = torch.bincount(out[:, 0], minlength=V).double()
    assert chi2(first, p1[0])[0] < crit
    second = torch.bincount(out[n >= 1, 1], minlength=V).double()
    assert chi2(second, p1[1])[0] < crit
    shifted = p1[0].clone()
    a, b = torch.nonzero(shifted).flatten()[:2].tolist()
    shifted[a] += 0.01
    shifted[b] -= 0.01
    drawn = torch.bincount(torch.multinomial(shifted, B, replacement=True, generator=g), minlength=V).double()
    assert chi2(drawn, p1[0])[0] > crit
