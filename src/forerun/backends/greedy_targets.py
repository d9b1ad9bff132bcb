"""How the native backend decides greedy tokens: the argmax of each row's own logits (integer
path, fixed-shape passes), the screened exact head where it is faster, or float32 logits."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from forerun.backends.base import ArgmaxOutput
from forerun.backends.fixed_rows import fixed_takes
from forerun.backends.greedy_head import ExactFloatArgmax
from forerun.backends.linear import ROWS_ANY, PackedLinear
from forerun.timing import median_s

log = logging.getLogger("forerun")


class GreedyTargets:
    """Greedy-target methods of ``NativeBackend``."""

    def exact_head(self, h: torch.Tensor | None = None):
        """The screened exact argmax head (``greedy_head.ExactFloatArgmax``), built on first use;
        None on GPUs, without a C compiler, with ``exact_greedy`` off, or where it lost the timing
        (then greedy takes the argmax of float32 logits). With ``exact_greedy="auto"`` (the
        default) the first call times both on one row of ``h`` (final normed hidden states; a
        random row when None) and keeps the faster for the model's lifetime, so every pass size,
        method and forked twin decides greedy tokens the same way."""
        if self._exact is None and (self.quant is not None or self._greedy_from_chunks):
            # integer logits, or a fixed-shape chunk's: each row's own, so their argmax is batch-invariant already
            self._exact = False
        if self._exact is None:
            head = None
            if self.exact_greedy and self.device.type == "cpu" and self.hidden_size % 32 == 0:
                head = ExactFloatArgmax(self.lm_head.weight, threads=torch.get_num_threads(), float_logits=self.lm_head)
                if not head.available:
                    head = None
            if head is not None and self.exact_greedy == "auto":
                head = head if self._exact_is_faster(head, h) else None
            self._exact = head if head is not None else False
        return self._exact or None

    def warm_up(self, tokens: list[int], rows: int) -> None:
        """Let the LM head pick its kernel for every pass width up to ``rows`` now, not inside a
        timed generation."""
        if getattr(self.lm_head, "autotune", False):
            for n in range(1, min(rows, self.lm_head.AUTOTUNE_ROWS) + 1):
                self.reset()
                self.forward(torch.tensor(([2] + list(tokens)) * n)[:n], 0)

    def head_timings(self, rows, reps: int, text=None) -> dict | None:
        """Milliseconds of the LM head for each row count and candidate kernel (CPU). The screened
        exact argmax (greedy path) is timed on the model's own final hidden states, at the last
        positions of ``text`` (token ids of real text) when given, else of random tokens."""
        head = self.lm_head
        if head is None or not getattr(head, "autotune", False):
            return None
        g = torch.Generator().manual_seed(0)
        out = {}
        for n in rows:
            x = torch.randn(n, head.weight.shape[1], generator=g).to(head.weight)
            out[str(n)] = {k: v * 1000 for k, v in head.time_kernels(x, reps).items()} | {
                "chosen": _kernel_name(head.choice.get(n), n)}
        exact = self.exact_head()
        if exact is not None:  # the greedy path: screened exact argmax, timed on the model's own final hidden states
            if text is not None and len(text) >= max(rows):
                ids = torch.tensor(text[: self.max_context])
            else:
                ids = torch.randint(10, min(self.vocab_size, 20000), (max(rows),), generator=g)
            self.reset()
            h = self.forward(ids, 0, logits=False, return_hidden=True).hidden[-max(rows):]
            self.reset()
            for n in rows:
                out[str(n)]["exact_argmax"] = median_s(lambda: exact.argmax(h[:n]), reps) * 1000
        return out

    @property
    def greedy_head(self) -> str:
        """What decides greedy tokens: ``integer`` on the integer path (the argmax of its logits),
        ``exact-q8-screened`` once the exact head is in use, else ``float32``."""
        if self.quant is not None:
            return "integer"
        return "exact-q8-screened" if self._exact else "float32"

    def _exact_is_faster(self, head, h: torch.Tensor | None) -> bool:
        if h is None:
            g = torch.Generator().manual_seed(0)
            h = self._norm(torch.randn(1, self.hidden_size, generator=g, device="cpu").to(self.device, self.dtype), self.final_norm)
        row = h[-1:].float().cpu()
        exact_s = median_s(lambda: head.argmax(row), 3)
        float_s = median_s(lambda: self.lm_logits(row.to(self.device, self.dtype)).argmax(-1), 3)
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
        if self._greedy_from_chunks:
            return self._fixed.chunk_logits(self, h).argmax(-1)
        fn = self._argmax_without_logits(h)
        return self.lm_logits(h).argmax(-1) if fn is None else fn(h)

    def _argmax_without_logits(self, h: torch.Tensor | None = None):
        """What ``argmax_hidden`` runs instead of float32 logits, or None."""
        if self.quant is not None and self.lm_head.qlin is not None and not self.softcap:
            return lambda x: self.lm_head.qlin.argmax(x)[0]
        head = self.exact_head(h)
        return None if head is None else (lambda x: head.argmax(x).to(self.device))

    @property
    def lazy_tree_head(self) -> bool:
        """Greedy token trees run the LM head only on the rows the acceptance walk reaches
        (``forerun.tree.greedy_tree_walk``): on the CPU each head row costs a pass over the
        262,144-row head, while a GPU does all rows of a pass in about the time of one. Never on
        fixed-shape passes (a GPU, or half-precision weights on the CPU): there a tree row's token
        is its chunk logits' argmax, as a one-token step's is, whatever the device."""
        return self.device.type == "cpu" and not self._greedy_from_chunks

    @property
    def _greedy_from_chunks(self) -> bool:
        """Whether greedy tokens are the argmax of fixed-shape chunk logits: on fixed-shape passes,
        for every row (a one-token step, a chain's, a tree's, a batched pass's), never the exact
        head nor a head product of another shape, so a tree row's token follows the rule and the
        bits of a one-token step's."""
        return self._fixed is not None

    @torch.inference_mode()
    def argmax_forward(self, tokens: torch.Tensor, pos: int, layers: Sequence[int] = (),
                       tree: torch.Tensor | None = None) -> ArgmaxOutput:
        """Greedy targets of a verify pass: the argmax [T] at every row (of a chain or a ``tree``),
        decided from each row's own hidden state alone, and the outputs of ``layers``."""
        tree_kw = {} if tree is None else {"tree": tree}
        if self._fixed is not None and fixed_takes(tokens.numel(), tree):  # each row's logits from its fixed-shape chunk
            passed = self.forward(tokens, pos, layers=layers, **tree_kw)
            return ArgmaxOutput(passed.logits.argmax(-1), passed.layers if layers else None)
        passed = self.forward(tokens, pos, layers=layers, logits=False, return_hidden=True, **tree_kw)
        return ArgmaxOutput(self.argmax_hidden(passed.hidden), passed.layers if layers else None)

    def lm_logits(self, h: torch.Tensor, head: PackedLinear | None = None, batched: bool = False) -> torch.Tensor:
        """Float32 logits of normed hidden states h [rows, hidden] (soft-capped where the model caps).
        On a batch-invariant backend a row gets the same bits in a pass of any size, as in the body:
        passes of up to ``INVARIANT_ROWS`` rows, and every ``batched`` pass (several sequences'
        rows), take the row-by-row kernel rather than the one timed fastest for their row count."""
        how = (ROWS_ANY if batched else "rows") if self.batch_invariant else None
        out = (head or self.lm_head)(h, how).float()
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out


def _kernel_name(choice, rows: int) -> str | None:
    if choice is None:
        return None
    how, padded = choice
    return how if padded == rows else f"{how} (padded to {padded} rows)"
