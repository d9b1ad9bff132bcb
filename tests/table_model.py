"""A model without a network, for sampling tests that need many generations: each prefix's logits
are drawn once from a generator seeded by the prefix (``TableBackend``), so a forward pass costs
a dictionary lookup and the engine runs at the speed of its own Python. A draft model is the
target's table with noise added (``near``): q != p everywhere, with top-k cutting different
tokens on the two sides. ``TwoWayTree`` drafts a token tree from such a model's two likeliest
tokens, so the tree sampler meets rejected first children and live second ones."""

from __future__ import annotations

import torch

from forerun.backends.base import BackendBase, Capabilities, ForwardOutput, check_forward
from forerun.drafters.base import Draft, Drafter


class TableBackend(BackendBase):
    capabilities = Capabilities(token_trees=True)

    def __init__(self, vocab: int = 6, seed: int = 0, scale: float = 1.2, base: TableBackend | None = None,
                 noise: float = 0.0, table: dict | None = None):
        self.vocab_size, self.seed, self.scale, self.base, self.noise = vocab, seed, scale, base, noise
        self.max_context, self.num_layers, self.device = 64, 1, torch.device("cpu")
        self._table = {} if table is None else table  # shared by forks: prefix -> logits [vocab]
        self._toks: list[int] = []
        self._paths: list[list[int]] = []  # the last tree pass: each row's tokens from the root down

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

    def forward(self, tokens: torch.Tensor, pos: int, *, last_only: bool = False, tree: torch.Tensor | None = None,
                **_) -> ForwardOutput:
        check_forward(self, tokens, pos)
        feed = tokens.tolist()
        self._toks = self._toks[:pos] + feed
        if tree is not None:  # row i + 1 is node i: its prefix is the path down to it
            self._paths = [feed[:1]]
            for i, parent in enumerate(tree.tolist()):
                self._paths.append(self._paths[parent + 1] + [feed[i + 1]])
            return ForwardOutput(logits=torch.stack([self.logits_of(tuple(self._toks[:pos] + p)) for p in self._paths]))
        rows = range(pos, pos + tokens.numel())
        if last_only:
            rows = rows[-1:]
        return ForwardOutput(logits=torch.stack([self.logits_of(tuple(self._toks[: r + 1])) for r in rows]))

    def keep_rows(self, pos: int, rows) -> None:
        """After a tree pass at ``pos``: the accepted path's rows (in order) become the sequence."""
        if rows:
            assert self._paths[rows[-1]][1:] == [self._toks[pos + r] for r in rows], "rows are not one path"
            self._toks = self._toks[: pos + 1] + self._paths[rows[-1]][1:]
        else:
            del self._toks[pos + 1:]

    def truncate(self, length: int) -> None:
        del self._toks[length:]

    def reset(self) -> None:
        self._toks = []

    def fork(self) -> TableBackend:
        return TableBackend(self.vocab_size, self.seed, self.scale, self.base, self.noise, self._table)


def near(target: TableBackend, noise: float, seed: int = 1) -> TableBackend:
    """A draft model: the target's logits plus ``noise`` times its own table's."""
    return TableBackend(target.vocab_size, seed, target.scale, base=target, noise=noise)


class TwoWayTree(Drafter):
    """A token tree from a draft table: the root's two likeliest tokens, the first of them with its
    own two likeliest below it and the second with one (5 nodes, depth 2; asked for one token,
    the root's two). Its candidates are fixed
    tokens (point masses), chosen without regard to the sampling settings, so some carry p = 0."""

    name = "two-way-tree"
    tree_nodes = 5

    def __init__(self, draft: TableBackend):
        self.draft = draft
        self.second_taken = 0  # rounds whose accepted path went through a second child
        self._last: list[int] = []

    def propose(self, tokens: list[int], k: int) -> Draft:
        def top(prefix, n):
            return torch.argsort(self.draft.logits_of(tuple(prefix)), descending=True)[:n].tolist()

        a, b = top(tokens, 2)
        toks = [a, b, *top(tokens + [a], 2), *top(tokens + [b], 1)]
        self._last = [len(tokens), a, b, toks[2], toks[3]]
        if k < 2:  # near the end: the root's two children only
            return Draft(tokens=torch.tensor(toks[:2]), parents=torch.tensor([-1, -1]))
        return Draft(tokens=torch.tensor(toks), parents=torch.tensor([-1, -1, 0, 0, 1]))

    def accepted(self, tokens: list[int], num_accepted: int) -> None:
        n, a, b, aa, ab = self._last
        took = tokens[n: n + num_accepted]
        self.second_taken += took[:1] == [b] or took[:2] == [a, ab]

    def fork(self) -> TwoWayTree:
        return TwoWayTree(self.draft)
