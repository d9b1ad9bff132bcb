"""How the native model decides greedy tokens: the argmax of each row's own logits (integer path,
fixed-shape passes), the screened exact head where it is faster, or float32 logits."""

from __future__ import annotations

import logging

import torch

from forerun.backends.greedy_head import ExactFloatArgmax
from forerun.timing import median_s

log = logging.getLogger("forerun")


class GreedyTargets:
    """The greedy-token rule of one ``NativeModel``, decided once and shared by every sequence
    over it (``model.greedy``)."""

    def __init__(self, model, exact_greedy: bool | str):
        self.model = model
        self.exact_greedy = exact_greedy
        self.exact = None  # undecided; then the screened exact head, or False (float32 logits)

    def exact_head(self, h: torch.Tensor | None = None):
        """The screened exact argmax head (``greedy_head.ExactFloatArgmax``), built on first use;
        None on GPUs, without a C compiler, with ``exact_greedy`` off, or where it lost the timing
        (then greedy takes the argmax of float32 logits). With ``exact_greedy="auto"`` (the
        default) the first call times both on one row of ``h`` (final normed hidden states; a
        random row when None) and keeps the faster for the model's lifetime, so every pass size,
        method and sequence decides greedy tokens the same way."""
        m = self.model
        if self.exact is None and (m.quant is not None or self.from_chunks):
            # integer logits, or a fixed-shape chunk's: each row's own, so their argmax is batch-invariant already
            self.exact = False
        if self.exact is None:
            head = None
            if self.exact_greedy and m.device.type == "cpu" and m.hidden_size % 32 == 0:
                head = ExactFloatArgmax(m.lm_head.weight, threads=torch.get_num_threads(), float_logits=m.lm_head)
                if not head.available:
                    head = None
            if head is not None and self.exact_greedy == "auto":
                head = head if self._exact_is_faster(head, h) else None
            self.exact = head if head is not None else False
        return self.exact or None

    @property
    def kind(self) -> str:
        """What decides greedy tokens: ``integer`` on the integer path (the argmax of its logits),
        ``exact-q8-screened`` once the exact head is in use, else ``float32``."""
        if self.model.quant is not None:
            return "integer"
        return "exact-q8-screened" if self.exact else "float32"

    def _exact_is_faster(self, head, h: torch.Tensor | None) -> bool:
        m = self.model
        if h is None:
            g = torch.Generator().manual_seed(0)
            h = m.norm(torch.randn(1, m.hidden_size, generator=g, device="cpu").to(m.device, m.dtype), m.final_norm)
        row = h[-1:].float().cpu()
        exact_s = median_s(lambda: head.argmax(row), 3)
        float_s = median_s(lambda: m.lm_logits(row.to(m.device, m.dtype)).argmax(-1), 3)
        log.info("greedy head: %s (one row: screened exact %.1f ms, float32 logits %.1f ms)",
                 "screened exact" if exact_s < float_s else "float32 logits", exact_s * 1000, float_s * 1000)
        return exact_s < float_s

    def argmax_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """Greedy tokens [n] of final normed hidden states h [n, hidden], each decided from its
        own row: the screened exact head where it is in use, on the integer path the argmax of its
        logits found inside the kernel (no logits formed; tanh soft-capped heads, where capping can
        make near logits equal, take the logits), on fixed-shape passes the argmax of the logits
        of a ``ROW_BUCKET``-row chunk (the product a pass's chunk runs, so the same bits and the
        same rule as a one-token step), else the argmax of float32 logits."""
        m = self.model
        if self.from_chunks:
            return m.fixed.chunk_logits(m, h).argmax(-1)
        fn = self.without_logits(h)
        return m.lm_logits(h).argmax(-1) if fn is None else fn(h)

    def without_logits(self, h: torch.Tensor | None = None):
        """What ``argmax_hidden`` runs instead of float32 logits, or None."""
        m = self.model
        if m.quant is not None and m.lm_head.qlin is not None and not m.softcap:
            return lambda x: m.lm_head.qlin.argmax(x)[0]
        head = self.exact_head(h)
        return None if head is None else (lambda x: head.argmax(x).to(m.device))

    @property
    def lazy_tree_head(self) -> bool:
        """Greedy token trees run the LM head only on the rows the acceptance walk reaches
        (``forerun.tree.greedy_tree_walk``): on the CPU each head row costs a pass over the
        262,144-row head, while a GPU does all rows of a pass in about the time of one. Never on
        fixed-shape passes (a GPU, or half-precision weights on the CPU): there a tree row's token
        is its chunk logits' argmax, as a one-token step's is, whatever the device."""
        return self.model.device.type == "cpu" and not self.from_chunks

    @property
    def from_chunks(self) -> bool:
        """Whether greedy tokens are the argmax of fixed-shape chunk logits: on fixed-shape passes,
        for every row (a one-token step, a chain's, a tree's, a batched pass's), never the exact
        head nor a head product of another shape, so a tree row's token follows the rule and the
        bits of a one-token step's."""
        return self.model.fixed is not None
