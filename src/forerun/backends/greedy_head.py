"""Exact greedy targets for several rows at once, for a Q8_0 LM head (llama.cpp backend).

llama.cpp's Q8_0 matrix product costs about one full pass over the 262,144 x 640 head *per
row* on a small CPU, so verifying K+1 positions costs K+1 head passes and speculation gains
nothing. For greedy verification only the argmax of each row is needed, and it can be had
exactly for about the price of one pass:

1. The final hidden state of every row is quantized to Q8_0 exactly as ggml does it before
   its product (per 32-block: d = amax/127 stored as fp16, q = round-half-even(x * 127/amax)).
2. A small C kernel (``q8_head.c``, compiled once on first use) forms the same block sums
   as llama.cpp, sum_b d_w * d_x * (integer dot), for all rows in one pass over the weights.
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

from forerun.backends.ckernels import kernel

QK = 32
_U32 = 2.0 ** -24  # unit roundoff of float32
log = logging.getLogger("forerun")


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's x86 ``quantize_row_q8_0`` for rows of x [n, D] -> (q [n, D/32, 32] float, d [n, D/32] fp32 of fp16)."""
    return quantize_blocks(x, 127)


def quantize_blocks(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [n, D] in 32-blocks of integers in [-levels, levels] -> (q [n, D/32, 32] float,
    d [n, D/32] float32 of an fp16 scale, so q * d is exact in float32); x ~ q * d. ``levels=127``
    is ggml's Q8_0 (``quantize_q8_0``); 63 is what the 7-bit kernel takes."""
    n, D = x.shape
    xb = x.float().reshape(n, D // QK, QK)
    amax = xb.abs().amax(-1)  # [n, nb] float32
    d = (amax / float(levels)).half().float()  # stored as fp16
    inv = torch.where(amax != 0, float(levels) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None])  # float32 product, then round half to even (_MM_ROUND_NEAREST)
    if levels != 127:  # ggml's Q8_0 does not clamp (x * 127 / amax cannot round past 127)
        q.clamp_(-levels, levels)
    return q, d


class Q8Head:
    """Greedy argmax over a Q8_0 head [V, D] with a certificate of exactness per row.

    ``seven_bit``: the caller can take activations quantized to 7 bits (|q| <= 63, see
    ``quantize_blocks``), which lets CPUs with AVX2 but without AVX-512 VNNI use the interleaved
    8-lane kernel (about twice the multiply-adds per cycle of the row-major one, see q8_head.c);
    ``act_levels`` says which quantization the kernel in use takes (63 or 127)."""

    MAX_ROWS = 64

    def __init__(self, raw: np.ndarray, dim: int, lib=None, threads: int | None = None, seven_bit: bool = False):
        V = raw.shape[0]
        nb = dim // QK
        blocks = np.ascontiguousarray(raw).reshape(V, nb, 2 + QK)
        scales = blocks[..., :2].copy().view(np.float16)[..., 0]  # [V, nb] fp16, as in the file
        self.dh = torch.from_numpy(scales.view(np.int16))  # what the kernel reads (half the bytes of float32)
        self.d = torch.from_numpy(scales.astype(np.float32))
        self.q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8))  # [V, nb, 32]
        self.V, self.D, self.nb = V, dim, nb
        self.lib = lib if lib is not None else kernel("q8_head")
        if self.lib is not None and threads:
            self.lib.forerun_q8_threads(int(threads))
        self.wu = self.dh16 = None
        self.lanes = 0  # 16 or 8: the interleaved kernel in use; 0: row-major
        if self.lib is not None and self.lib.forerun_q8_has_x16():
            self._interleave(16)
        elif self.lib is not None and seven_bit and self.lib.forerun_q8_has_x8():
            self._interleave(8)
        self.act_levels = 63 if self.lanes == 8 else 127
        # A bound on ||W_v|| for every row v (|q| <= 127 in each of its 32-blocks), so that
        # sum_j |W_vj x_j| <= ||W_v|| ||x|| bounds the rounding of both float32 sums.
        self.w_norm = float((self.d.square().sum(-1).sqrt() * 127.0 * QK ** 0.5).max())

    def _interleave(self, lanes: int) -> None:
        """The weights again, ``lanes`` vocabulary rows per vector (see q8_head.c): [G, nb, 8, lanes, 4]
        bytes q + 128, and the scales as [G, nb, lanes] fp16; rows past V are zero."""
        V, nb = self.V, self.nb
        G = (V + lanes - 1) // lanes
        q = self.q.numpy().view(np.uint8) ^ np.uint8(0x80)  # two's complement q + 128, as unsigned bytes
        if G * lanes != V:
            q = np.concatenate([q, np.full((G * lanes - V, nb, QK), 0x80, np.uint8)])
        self.wu = torch.from_numpy(np.ascontiguousarray(q.reshape(G, lanes, nb, 8, 4).transpose(0, 2, 3, 1, 4)))
        d = self.dh.numpy()
        if G * lanes != V:
            d = np.concatenate([d, np.zeros((G * lanes - V, nb), d.dtype)])
        self.dh16 = torch.from_numpy(np.ascontiguousarray(d.reshape(G, lanes, nb).transpose(0, 2, 1)))
        self.lanes = lanes

    def embedding_rows(self) -> "Q8Rows":
        """The same table as token embeddings, dequantized row by row when indexed."""
        return Q8Rows(self.q, self.d)

    @property
    def available(self) -> bool:
        return self.lib is not None

    def logits(self, q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q8_0 activations (q [n, nb, 32], d [n, nb]) -> float32 logits [n, V] from the C kernel,
        with each row's two largest logits [n, 2] and their token ids [n, 2] (ties: lower id first)."""
        n = q.shape[0]
        qx = q.to(torch.int8).contiguous()
        dx = d.contiguous()
        out = torch.empty(n, self.V, device="cpu")
        top = torch.empty(n, 2, device="cpu")
        idx = torch.empty(n, 2, dtype=torch.long, device="cpu")
        if self.lanes:
            fn = self.lib.forerun_q8_rows_x16 if self.lanes == 16 else self.lib.forerun_q8_rows_x8
            w, d = self.wu, self.dh16
        else:
            fn, w, d = self.lib.forerun_q8_rows, self.q, self.dh
        rc = fn(w.data_ptr(), d.data_ptr(), self.V, self.nb, qx.data_ptr(), dx.data_ptr(), n, out.data_ptr(),
                top.data_ptr(), idx.data_ptr())
        if rc != 0:
            raise RuntimeError(f"q8 head kernel failed ({rc})")
        return out, top, idx

    def exact_logits(self, q: torch.Tensor, d: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of tokens idx for one row (q [nb, 32], d [nb]) in float64, and llama.cpp's float32 error bound."""
        isum = torch.einsum("cbj,bj->cb", self.q[idx].double(), q.double())  # exact integers
        scale = (self.d[idx] * d[None, :]).double()  # the float32 product llama.cpp forms, then widened
        terms = scale * isum
        bound = (self.nb + 6) * _U32 * terms.abs().sum(-1) * 1.01
        return terms.sum(-1), bound

    @torch.inference_mode()
    def argmax(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [n, D] float32 final normed hidden states -> (argmax [n] int64, certified [n] bool)."""
        n = h.shape[0]
        if self.act_levels != 127:
            raise RuntimeError("certified argmaxes need the Q8_0 activations llama.cpp uses: build without seven_bit")
        q, d = quantize_q8_0(h)
        out = torch.zeros(n, dtype=torch.long, device="cpu")
        ok = torch.zeros(n, dtype=torch.bool, device="cpu")
        for s in range(0, n, self.MAX_ROWS):
            qs, ds = q[s: s + self.MAX_ROWS], d[s: s + self.MAX_ROWS]
            f, best, idx = self.logits(qs, ds)  # [r, V], [r, 2], [r, 2]
            xn = (qs * ds[..., None]).flatten(1).norm(dim=-1)
            # ours and llama.cpp's float32 sums each lie within eps of the exact value
            eps = 2 * (self.nb + 6) * _U32 * self.w_norm * xn * 1.01
            m, top = best[:, 0], idx[:, 0]
            single = best[:, 1] < m - 2 * eps  # no other token within the bounds: certified at once
            out[s: s + len(f)] = top
            ok[s: s + len(f)] = single
            for r in torch.nonzero(~single).flatten().tolist():
                i = s + r
                cand = torch.nonzero(f[r] >= m[r] - 2 * eps[r]).flatten()
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
    For a row h the kernel gives a = Wq . hq, hq = h in 32-blocks of 8-bit integers (Q8_0), or of
    7-bit integers where the CPU has AVX2 but not AVX-512 VNNI (the faster kernel there, see
    ``Q8Head``); the real logit W_v . h differs from a_v by at most B = max||W_v|| ||h - hq|| + max||W_v - Wq_v|| ||hq|| + the kernel's float32 rounding. Only
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
        self.q8 = Q8Head(raw, w.shape[1], threads=threads, seven_bit=True)
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
        h = h.float().cpu()
        q, d = quantize_blocks(h, self.q8.act_levels)
        hq = (q * d[..., None]).flatten(1)  # [n, D]
        out = torch.empty(len(h), dtype=torch.long, device="cpu")
        for s in range(0, len(h), self.q8.MAX_ROWS):
            hs, hqs = h[s: s + self.q8.MAX_ROWS], hq[s: s + self.q8.MAX_ROWS]
            a, top, idx = self.q8.logits(q[s: s + len(hs)], d[s: s + len(hs)])  # [r, V], [r, 2], [r, 2]
            hq_norm = hqs.norm(dim=-1)
            bound = (self.w_norm * (hs - hqs).norm(dim=-1) + self.err_norm * hq_norm
                     + (self.q8.nb + 6) * _U32 * self.wq_norm * hq_norm) * 1.01 + 1e-6
            m = top[:, 0]
            for r in range(len(hs)):
                if top[r, 1] < m[r] - 2 * bound[r]:  # no other token within reach: no scan of the row
                    cand = idx[r, :1]
                else:
                    cand = torch.nonzero(a[r] >= m[r] - 2 * bound[r]).flatten()
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
        order), so only tokens within twice that of the float32 maximum can hold the maximum. Past
        1/64 of the vocabulary the whole float32 head is cheaper than gathering the rows."""
        D = h.shape[0]
        err = D * _U32 / (1 - D * _U32) * self.w_norm * float(h.norm()) * 1.01
        if len(cand) > self.weight.shape[0] // 64:
            logits = self.float_logits(h[None].to(self.weight.device, self.weight.dtype))[0].float().cpu()
            return torch.nonzero(logits >= logits.max() - 2 * err).flatten()
        logits = (self.weight[cand] @ h.to(self.weight.dtype)).float()
        return cand[logits >= logits.max() - 2 * err]
