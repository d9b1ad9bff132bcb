"""Exact greedy targets for several rows at once, for a Q8_0 LM head (llama.cpp backend).

llama.cpp's Q8_0 matrix product costs about one full pass over the 262,144 x 640 head *per
row* on a small CPU, so verifying K+1 positions costs K+1 head passes and speculation gains
nothing. For greedy verification only the argmax of each row is needed, and it can be had
exactly for about the price of one pass:

1. The final hidden state of every row is quantized to Q8_0 exactly as ggml does it before
   its product (per 32-block: d = amax/127 stored as fp16, q = round-half-even(x * 127/amax)).
2. The integer kernel of the GGUF path (``qrows.c``, its LM-head entry ``forerun_q_top``) forms
   the same block sums as llama.cpp, sum_b d_w * d_x * (integer dot), for all rows in one pass
   over the weights, and keeps each row's two largest without storing the logits.
3. Only the float summation order differs from llama.cpp's, by at most
   ``(blocks + 6) * 2^-24 * sum|terms|`` each way. Every token within twice that of the
   row's maximum is rescored in float64; the winner is *certified* when it leads every other
   candidate by more than the bounds.

A row that cannot be certified (a near tie) is reported as such, and the backend falls back
to llama.cpp's own head, decoding from that position one token at a time as plain decoding
does. Where no C compiler is available the backend uses llama.cpp's head for every row.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from forerun.backends.block_weights import unpack
from forerun.backends.qweights import QLinear, qrows_lib
from forerun.gguf_file import Q8_0

QK = 32
_U32 = 2.0 ** -24  # unit roundoff of float32
log = logging.getLogger("forerun")


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's x86 ``quantize_row_q8_0`` for rows of x [n, D] -> (q [n, D/32, 32] float, d [n, D/32]
    float32 of an fp16 scale, so q * d is exact in float32); x ~ q * d. ``qrows.c`` quantizes the
    same way (codes from x * 127 / amax rounded half to even, then the scale rounded to fp16 with
    ``f16_scales``), so q and d are what its products use."""
    n, D = x.shape
    xb = x.float().reshape(n, D // QK, QK)
    amax = xb.abs().amax(-1)  # [n, nb] float32
    d = (amax / 127.0).half().float()  # stored as fp16
    inv = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None])  # float32 product, then round half to even (_MM_ROUND_NEAREST)
    return q, d  # no clamp: x * 127 / amax cannot round past 127


class Q8Head:
    """Greedy argmax over a Q8_0 head [V, D] (GGUF blocks, raw [V, D / 32 * 34]) with a certificate
    per row that it is llama.cpp's. Its products are the GGUF path's (``QLinear`` on the blocks),
    with activation scales rounded to fp16 as ggml's Q8_0 activations are."""

    MAX_ROWS = 64

    def __init__(self, raw: np.ndarray, dim: int, threads: int | None = None):
        V = raw.shape[0]
        nb = dim // QK
        codes = unpack(np.ascontiguousarray(raw), Q8_0)  # codes [V, D], scales [V, nb] float32 of fp16
        self.q = torch.from_numpy(codes.codes.astype(np.int8).reshape(V, nb, QK))  # exact rescoring, embeddings
        self.d = torch.from_numpy(codes.scale)
        self.V, self.D, self.nb = V, dim, nb
        self.lin = QLinear([(codes, Q8_0)]) if qrows_lib() is not None else None
        if self.lin is not None:
            self.lin.threads = threads
        # A bound on ||W_v|| for every row v (|q| <= 127 in each of its 32-blocks), so that
        # sum_j |W_vj x_j| <= ||W_v|| ||x|| bounds the rounding of both float32 sums.
        self.w_norm = float((self.d.square().sum(-1).sqrt() * 127.0 * QK ** 0.5).max())

    def embedding_rows(self) -> Q8Rows:
        """The same table as token embeddings, dequantized row by row when indexed."""
        return Q8Rows(self.q, self.d)

    @property
    def available(self) -> bool:
        return self.lin is not None

    def top2(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [n, D] -> each row's two largest logits [n, 2] and their token ids [n, 2] (ties: the
        lower id first), from the integer kernel with ggml's Q8_0 activations."""
        idx, val = self.lin.top(h, 2, f16_scales=True)
        return val, idx

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [n, D] -> all float32 logits [n, V] of the same kernel (rows whose top two are close)."""
        return self.lin(h, f16_scales=True)

    def exact_logits(self, q: torch.Tensor, d: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of tokens idx for one row (q [nb, 32], d [nb]) in float64, and a bound on the error
        of any float32 summation of its terms, llama.cpp's included. llama.cpp's Q8_0 dot keeps 8
        float lanes per block (each a few products' integer sum times the scales), so its rounding
        follows the lanes' magnitudes, not the block's total, which cancellation inside a block can
        make far smaller: the bound takes every product's absolute value, which bounds any lane
        split's (``(blocks + 6) u sum |scale_b| sum_j |w_j x_j|``: a lane's nb multiply-adds, the
        scale's product and the lanes' final sum)."""
        w = self.q[idx].double()
        x = q.double()
        isum = torch.einsum("cbj,bj->cb", w, x)  # exact integers
        asum = torch.einsum("cbj,bj->cb", w.abs(), x.abs())  # every product's magnitude, summed per block
        scale = (self.d[idx] * d[None, :]).double()  # the float32 product llama.cpp forms, then widened
        bound = (self.nb + 6) * _U32 * (scale.abs() * asum).sum(-1) * 1.01
        return (scale * isum).sum(-1), bound

    @torch.inference_mode()
    def argmax(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [n, D] float32 final normed hidden states -> (argmax [n] int64, certified [n] bool)."""
        h = h.float().contiguous()
        n = h.shape[0]
        q, d = quantize_q8_0(h)
        out = torch.zeros(n, dtype=torch.long, device="cpu")
        ok = torch.zeros(n, dtype=torch.bool, device="cpu")
        for s in range(0, n, self.MAX_ROWS):
            hs, qs, ds = h[s: s + self.MAX_ROWS], q[s: s + self.MAX_ROWS], d[s: s + self.MAX_ROWS]
            best, idx = self.top2(hs)  # [r, 2], [r, 2]
            xn = (qs * ds[..., None]).flatten(1).norm(dim=-1)
            # ours and llama.cpp's float32 sums each lie within eps of the exact value
            eps = 2 * (self.nb + 6) * _U32 * self.w_norm * xn * 1.01
            m, top = best[:, 0], idx[:, 0]
            single = (idx[:, 1] < 0) | (best[:, 1] < m - 2 * eps)  # no other token within the bounds: certified
            out[s: s + len(hs)] = top
            ok[s: s + len(hs)] = single
            for r in torch.nonzero(~single).flatten().tolist():
                i = s + r
                f = self.logits(h[i: i + 1])[0]  # the same sums as top2's: a row's own, whatever the pass
                cand = torch.nonzero(f >= m[r] - 2 * eps[r]).flatten()
                logit, bound = self.exact_logits(q[i], d[i], cand)
                j = int(torch.argmax(logit))
                out[i] = cand[j]
                others = torch.cat([logit[:j] + bound[:j], logit[j + 1:] + bound[j + 1:]])
                ok[i] = bool(logit[j] - bound[j] > others.max())
        return out, ok


class Q8Rows:
    """A Q8_0 table [V, D] that dequantizes only the rows it is indexed with (d * q in float32,
    as ggml and gguf dequantize), so a 262,144-row embedding needs no float copy."""

    device = torch.device("cpu")

    def __init__(self, q: torch.Tensor, d: torch.Tensor):
        self.q, self.d = q, d  # [V, nb, 32] int8, [V, nb] float32
        self.shape = torch.Size((q.shape[0], q.shape[1] * q.shape[2]))

    def __getitem__(self, idx) -> torch.Tensor:
        q, d = self.q[idx], self.d[idx]
        return (q.float() * d[..., None]).flatten(-2)


def q8_0_blocks(w: torch.Tensor, chunk: int = 2048) -> tuple[np.ndarray, float, float]:
    """A float matrix [V, D] quantized to GGUF Q8_0 blocks, as raw bytes [V, D / 32 * 34] (ggml's
    reference quantizer; a matrix that was dequantized from Q8_0 comes back bit for bit), with
    max_v ||W_v|| and max_v ||W_v - Wq_v|| (Wq: the dequantized blocks). Chunks of rows keep the
    work in cache: for a 262,144 x 640 head it takes about half the time of whole-matrix passes."""
    V, D = w.shape
    blocks = np.empty((V, D // QK, 2 + QK), np.uint8)
    w_norm = err_norm = 0.0
    for s in range(0, V, chunk):
        wc = w[s: s + chunk].detach().float().cpu()
        q, d = quantize_q8_0(wc)
        n = len(wc)
        blocks[s: s + n, :, :2] = d.half().numpy().view(np.uint8).reshape(n, D // QK, 2)
        blocks[s: s + n, :, 2:] = q.to(torch.int8).numpy().view(np.uint8)
        wq = (q * d[..., None]).reshape(n, D)  # exact: fp16 scale x int8
        w_norm = max(w_norm, float(wc.norm(dim=1).max()))
        err_norm = max(err_norm, float((wc - wq).norm(dim=1).max()))
    return blocks.reshape(V, -1), w_norm, err_norm


class ExactFloatArgmax:
    """Exact greedy targets for a float LM head W [V, D] (the torch backend), screened by the Q8_0
    kernel: every row's argmax from one pass over the int8 head (a quarter of the float32 head's
    bytes) instead of a float32 product of all rows with 262,144 x 640 weights.

    W is quantized to Q8_0 once (Wq; a head dequantized from a Q8_0 GGUF file comes back exactly).
    For a row h the kernel gives a = Wq . hq, hq = h in 32-blocks of 8-bit integers (Q8_0,
    ``quantize_q8_0``); the real logit W_v . h differs from a_v by at most
    B = max||W_v|| ||h - hq|| + max||W_v - Wq_v|| ||hq|| + the kernel's float32 rounding. Only
    tokens with a_v >= max(a) - 2B can hold the maximum; their logits are recomputed from W in
    float64 (each product exact, the sum to ~1e-16), and the greedy token is the largest of those
    (ties: the lowest id). The answer depends on h alone, so it is the same for every pass size.
    """

    RESCORE_F32 = 64  # more candidates than this in a row: narrowed by float32 logits first (below)

    def __init__(self, weight: torch.Tensor, threads: int | None = None, float_logits=None):
        self.weight = w = weight.detach()
        self.float_logits = float_logits or (lambda x: x @ w.T)  # [n, D] -> float32 [n, V]
        if w.shape[1] % QK:
            raise ValueError(f"hidden size {w.shape[1]} is not a multiple of {QK}")
        raw, self.w_norm, self.err_norm = q8_0_blocks(w)
        self.q8 = Q8Head(raw, w.shape[1], threads=threads)
        if not self.q8.available:
            return
        self.wq_norm = self.q8.w_norm  # bounds ||Wq_v|| from the scales alone
        self.candidates = 0  # tokens rescored in float64, summed over rows (a measure of the bound's slack)

    @property
    def available(self) -> bool:
        return self.q8.available

    @torch.inference_mode()
    def argmax(self, h: torch.Tensor) -> torch.Tensor:
        """h [n, D] normed final hidden states -> greedy token ids [n] (int64)."""
        h = h.float().cpu().contiguous()
        q, d = quantize_q8_0(h)
        hq = (q * d[..., None]).flatten(1)  # [n, D]: the activations the kernel multiplies
        out = torch.empty(len(h), dtype=torch.long, device="cpu")
        for s in range(0, len(h), self.q8.MAX_ROWS):
            hs, hqs = h[s: s + self.q8.MAX_ROWS], hq[s: s + self.q8.MAX_ROWS]
            top, idx = self.q8.top2(hs)  # [r, 2], [r, 2]
            hq_norm = hqs.norm(dim=-1)
            bound = (self.w_norm * (hs - hqs).norm(dim=-1) + self.err_norm * hq_norm
                     + (self.q8.nb + 6) * _U32 * self.wq_norm * hq_norm) * 1.01 + 1e-6
            m = top[:, 0]
            for r in range(len(hs)):
                if idx[r, 1] < 0 or top[r, 1] < m[r] - 2 * bound[r]:  # no other token within reach
                    cand = idx[r, :1]
                else:  # the row's logits from the same kernel (a row's sums do not depend on its pass)
                    a = self.q8.logits(hs[r: r + 1])[0]
                    cand = torch.nonzero(a >= m[r] - 2 * bound[r]).flatten()
                if len(cand) > self.RESCORE_F32:
                    cand = self._narrow(cand, hs[r])
                self.candidates += len(cand)
                exact = self.weight[cand].double() @ hs[r].double()
                out[s + r] = cand[int(torch.argmax(exact))]  # first maximum: the lowest id
        return out

    def _narrow(self, cand: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Candidates of a row whose Q8_0 screen left many (a flat distribution: thousands of tokens
        within 2B), cut down with float32 logits: any float32 dot product of length D lies within
        gamma_D * ||W_v|| * ||h|| of the exact one (gamma_D = D u / (1 - D u), whatever the summation
        order), so only tokens within twice that of the float32 maximum can hold the maximum. That
        bound is float32's: the products and sums are float32 whatever the weights' type (bfloat16
        and float16 weights are widened exactly, and h is not rounded to their type). Past 1/64 of
        the vocabulary the whole head is cheaper than gathering the rows."""
        D = h.shape[0]
        err = D * _U32 / (1 - D * _U32) * self.w_norm * float(h.norm()) * 1.01
        h = h.float().to(self.weight.device)
        if len(cand) > self.weight.shape[0] // 64:
            if self.weight.dtype == torch.float32:
                logits = self.float_logits(h[None])[0].float().cpu()
            else:  # in slices widened to float32, never the whole head at once
                logits = torch.cat([(self.weight[s: s + 8192].float() @ h).cpu()
                                    for s in range(0, self.weight.shape[0], 8192)])
            return torch.nonzero(logits >= logits.max() - 2 * err).flatten()
        logits = (self.weight[cand].float() @ h).cpu()
        return cand[logits >= logits.max() - 2 * err]
