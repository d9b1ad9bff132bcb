"""The native backend's linear layers on the CPU: weights prepacked for oneDNN, small passes on
``f32_rows.c`` (each weight row read once for every row of the pass, each row's sums its own), and
the choice between them; ``INVARIANT_ROWS`` says which passes must be computed row by row alike."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from forerun.backends.ckernels import kernel
from forerun.backends.kv_cache import KVCache
from forerun.timing import median_s

log = logging.getLogger("forerun")

# Passes of up to this many rows (one-token steps, chains, token trees with a lookup branch) are
# computed row by row alike where the backend is batch-invariant (see NativeModel.batch_invariant);
# longer ones (prompts, shared by every method) take the library kernels.
INVARIANT_ROWS = 64
# The body kernel of a batched pass on a batch-invariant backend: ``rows`` whatever the pass's size
# (several sequences' chains add up past INVARIANT_ROWS, and each row must still be computed alone).
ROWS_ANY = "rows-any"



class PackedLinear:
    """y = x @ W.T, with the fastest measured kernel for each row count on CPU.

    Measured on a 2-core AVX-512 CPU, float32, the 640 x 262,144 LM head: plain
    ``F.linear`` takes ~45 ms for 1 row and ~80-140 ms for 2-9 rows; a oneDNN-prepacked
    weight ~16 ms for 1 row and ~25-30 ms for 4-9; ``(W @ x.T).T`` ~17-24 ms for 2-4 rows
    but ~45 ms for 1. Which wins depends on the machine, so with ``autotune`` the first
    call for each row count times the candidates, also with the rows padded up to a multiple
    of 4 (MKL's sgemm took ~20 ms for 4 rows but ~45 ms for 3 here), and keeps the fastest. A
    fourth candidate, ``rows`` (``f32_rows.c``, compiled on first use where a C compiler exists),
    reads each weight row once for all rows of the pass. Small-row
    products are what verify passes are made of. (The body's small layers are not tuned one by
    one: timed in isolation their weights sit in cache, which misleads the choice; the backend
    picks one kernel for all of them from whole body passes, see ``NativeModel.body_kernel``,
    and passes it as ``how``.)
    """

    def __init__(self, weight: torch.Tensor, pack: bool, autotune: bool = False, half: bool = False,
                 source=None):
        """``source``: builds the weight on first use where ``weight`` is on the meta device (an
        LM head left in its GGUF file, see ``gguf_model``)."""
        self._weight = weight
        self._source = source
        self.packed = None
        # float32 only: oneDNN's half-precision products need instructions many CPUs lack
        if pack and weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available():
            self.packed = weight.detach().to_mkldnn()
        self.autotune = autotune and self.packed is not None
        self.choice: dict[int, str] = {}
        self.blocks = None  # the GGUF file's blocks of these weights (``block_weights``), set by the backend
        self.qlin = None  # the same blocks for the integer kernels (``qweights``), set by the backend
        # half: passes of up to INVARIANT_ROWS rows read a float16 copy (``f16w_rows``), where
        # float16 holds the weights exactly (a head saved in float16) and the kernel builds
        self.half = None
        if (half and self.packed is not None and weight.dtype == torch.float32 and weight.shape[1] % 8 == 0
                and f32_rows_kernel() is not None):
            w16 = weight.detach().half()
            if torch.equal(w16.float(), weight):
                self.half = w16.contiguous()

    @property
    def stored(self) -> torch.Tensor:
        """The weight as held now, not built from its source (a meta tensor where it was left in its file)."""
        return self._weight

    @property
    def weight(self) -> torch.Tensor:
        if self._source is not None and self._weight.is_meta:
            self._weight, self._source = self._source(), None
        return self._weight

    @weight.setter
    def weight(self, w: torch.Tensor) -> None:
        self._weight, self._source = w, None

    def _run(self, x: torch.Tensor, how: str) -> torch.Tensor:
        if how == "onednn":
            return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), self.packed, None).to_dense()
        if how == "wxt":
            return (self.weight @ x.t()).t()
        if how == "rows":
            return f32_rows(self.weight, x)
        return F.linear(x, self.weight)

    def __call__(self, x: torch.Tensor, how: str | None = None) -> torch.Tensor:  # x: [T, in]
        if self.qlin is not None:
            return self.qlin(x)
        if self.packed is None:
            return F.linear(x, self.weight)
        rows = x.shape[0]
        small = rows <= INVARIANT_ROWS or how == ROWS_ANY
        if how == ROWS_ANY:
            how = "rows"
        if self.blocks is not None and small and how in (None, "rows"):
            return self.blocks(x)  # the same sums as ``rows``, from the GGUF blocks
        if self.half is not None and small:
            return f16w_rows(self.half, x)
        if how == "rows" and small and _f32_rows_fits(self.weight):  # the body's choice (NativeModel.body_kernel)
            return self._run(x, how)
        if not self.autotune or rows > self.AUTOTUNE_ROWS:
            return self._run(x, "onednn")
        choice = self.choice.get(rows)
        if choice is None:
            choice = self.choice[rows] = self._measure(x)
        how, padded = choice
        if padded > rows:  # a larger pass can be faster (e.g. 4 rows on MKL's sgemm): pad with zero rows
            return self._run(_pad_rows(x, padded), how)[:rows]
        return self._run(x, how)

    KERNELS = ("onednn", "wxt", "plain", "rows")
    AUTOTUNE_ROWS = 32  # verify passes of one sequence (trees too); batched passes of more rows stay on oneDNN

    @property
    def kernels(self) -> tuple[str, ...]:
        """The candidates on this machine: ``rows`` (``f32_rows.c``) needs a C compiler."""
        return self.KERNELS if _f32_rows_fits(self.weight) and f32_rows_kernel() is not None else self.KERNELS[:-1]

    def time_kernels(self, x: torch.Tensor, reps: int = 3, kernels=None) -> dict[str, float]:
        """Median seconds of each candidate kernel (or of ``kernels``) on ``x`` (one untimed run each first)."""
        return {how: median_s(lambda: self._run(x, how), reps) for how in (kernels or self.kernels)}

    def _measure(self, x: torch.Tensor) -> tuple[str, int]:
        """(kernel, rows to run) fastest for x's row count; padding up to the next multiple of 4 is a
        candidate for the library kernels. Plain ``F.linear`` is never timed here: it lost at every
        row count measured (bench tables), and it is the slowest to time."""
        rows = x.shape[0]
        times = {(how, rows): t for how, t in self.time_kernels(x, 5, [k for k in self.kernels if k != "plain"]).items()}
        padded = -(-rows // 4) * 4
        if padded != rows:
            times.update({(how, padded): t for how, t in self.time_kernels(_pad_rows(x, padded), 5, ("onednn", "wxt")).items()})
        return min(times, key=times.get)


def f32_rows_kernel():
    """The compiled ``f32_rows.c`` (see there), or None where it cannot be built (logged once)."""
    return kernel("f32_rows")


def _f32_rows_fits(weight: torch.Tensor) -> bool:
    """Whether ``f32_rows`` takes this weight as it is: contiguous float32 on the CPU."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()


def f32_rows(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [n, D] @ weight[V, D].T in float32 on the CPU with ``f32_rows.c``: one pass over the
    weights for all n rows (the LM head of a verify pass)."""
    if not _f32_rows_fits(weight):
        raise ValueError("f32_rows needs a contiguous float32 weight on the CPU")
    return _rows_product("forerun_f32_rows", weight, x)


def f16w_rows(weight16: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [n, D] @ weight16[V, D].T with float16 weights (half the bytes of float32), each product
    and sum in float32 as ``f32_rows`` does them; for weights that float16 holds exactly (a trained
    head saved in float16), the same values as the float32 weights give."""
    if weight16.dtype != torch.float16 or weight16.device.type != "cpu" or not weight16.is_contiguous():
        raise ValueError("f16w_rows needs a contiguous float16 weight on the CPU")
    return _rows_product("forerun_f16w_rows", weight16, x)


def _rows_product(fn: str, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    lib = f32_rows_kernel()
    if lib is None:
        raise RuntimeError("the f32_rows kernel is not available (no C compiler)")
    name = fn.removeprefix("forerun_")
    x = x.to(torch.float32).contiguous()
    n, D = x.shape
    V = weight.shape[0]
    if weight.shape[1] != D:
        raise ValueError(f"{name}: rows of {D} against a weight of {tuple(weight.shape)}")
    out = torch.empty(n, V, dtype=torch.float32, device="cpu")
    lib.forerun_f32_threads(torch.get_num_threads())
    if getattr(lib, fn)(weight.data_ptr(), V, D, x.data_ptr(), n, out.data_ptr()) != 0:
        raise ValueError(f"{name}: bad sizes {n} x {D} against {V}")
    return out


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [T, in] with zero rows appended up to ``rows``."""
    return torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])


def time_body_kernels(model) -> str:
    """``onednn`` or ``rows``, whichever runs whole body passes of 1 and 5 rows faster on
    ``model`` (``NativeModel.body_kernel``: timed alone, a small layer's weights sit in cache and
    mislead the choice)."""
    cache = KVCache(model)
    ids = torch.randint(0, min(model.vocab_size, 20000), (70,), generator=torch.Generator().manual_seed(0), device="cpu")
    model.run_rows([cache], [ids[:64]], [0])
    times = {}
    for how in ("onednn", "rows"):
        model.body_kernel = how

        def passes():
            for n in (1, 5):
                cache.truncate(64)
                model.run_rows([cache], [ids[64: 64 + n]], [64])

        times[how] = median_s(passes, 3)
    best = min(times, key=times.get)
    log.info("body kernel: %s (passes of 1 and 5 rows: oneDNN %.1f ms, rows %.1f ms)",
             best, times["onednn"] * 1000, times["rows"] * 1000)
    return best
