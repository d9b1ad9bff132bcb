"""A model without a network, for sampling tests that need many generations: each prefix's logits
are drawn once from a generator seeded by the prefix (``TableBackend``), so a forward pass costs
a dictionary lookup and the engine runs at the speed of its own Python. A draft model is the
target's table with noise added (``near``): q != p everywhere, with top-k cutting different
tokens on the two sides."""

from __future__ import annotations

import torch

from forerun.backends.base import BackendBase, ForwardOutput


class TableBackend(BackendBase):
    def __init__(self, vocab: int = 6, seed: int = 0, scale: float = 1.2, base: TableBackend | None = None,
                 noise: float = 0.0, table: dict | None = None):
        self.vocab_size, self.seed, self.scale, self.base, self.noise = vocab, seed, scale, base, noise
        self.max_context, self.num_layers, self.device = 64, 1, torch.device("cpu")
        self._table = {} if table is None else table  # shared by forks: prefix -> logits [vocab]
        self._toks: list[int] = []

    @property
    def length(self) -> int:
        return len(self._toks)

    def logits_of(self, prefix: tuple) -> torch.Tensor:
        t = self._table.get(prefix)
        if t is None:
            g = torch.Generator().manual_seed(hash((self.seed, *prefix)) & 0x7FFF_FFFF_FFFF_FFFF)
            t = torch.randn(self.vocab_size, generator=g) * self.scale
            if self.base is not None:  # a draft near the base model
                t = self.base.logits_of(prefix) + self.noise * t
            self._table[prefix] = t
        return t

    def forward(self, tokens: torch.Tensor, pos: int, *, last_only: bool = False, **_) -> ForwardOutput:
        self._check_forward(tokens, pos)
        self._toks = self._toks[:pos] + tokens.tolist()
        rows = range(pos, pos + tokens.numel())
        if last_only:
            rows = rows[-1:]
        return ForwardOutput(logits=torch.stack([self.logits_of(tuple(self._toks[: r + 1])) for r in rows]))

    def truncate(self, length: int) -> None:
        del self._toks[length:]

    def reset(self) -> None:
        self._toks = []

    def fork(self) -> TableBackend:
        return TableBackend(self.vocab_size, self.seed, self.scale, self.base, self.noise, self._table)


def near(target: TableBackend, noise: float, seed: int = 1) -> TableBackend:
    """A draft model: the target's logits plus ``noise`` times its own table's."""
    return TableBackend(target.vocab_size, seed, target.scale, base=target, noise=noise)
