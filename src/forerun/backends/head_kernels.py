"""The kernels a trained head drafts with on the CPU, behind one small interface: its linear
layers packed for the backend's float kernels or as 8-bit blocks for the integer ones
(``pack_linear``), and an EAGLE decoder layer run as one ``qrows`` call (``FusedLayer``).
Heads (``drafters.heads``) ask for these; the structures the C code reads stay here."""

from __future__ import annotations

import ctypes
import math

import torch

from forerun.backends.block_weights import Codes
from forerun.backends.greedy_head import quantize_q8_0
from forerun.backends.linear import PackedLinear
from forerun.backends.qweights import ACT_CODES, QLayerC, QLinear, QPassC, qrows_lib
from forerun.gguf_file import Q8_0


def int8_available() -> bool:
    """Whether the integer kernels (``qrows.c``) run here."""
    return qrows_lib() is not None


def pack_linear(weight: torch.Tensor, *, int8: bool, half: bool, autotune: bool):
    """A layer's weight [V, D] as a callable x [n, D] -> [n, V] (``kernel`` picks the float
    kernel: ``onednn`` or ``rows``): 8-bit blocks (``Q8Linear``) or the float kernels' packing."""
    if int8:
        return Q8Linear(weight)
    return PackedLinear(weight.detach(), pack=True, autotune=autotune, half=half)


class Q8Linear:
    """A layer as Q8_0 blocks (ggml's quantizer, ``quantize_q8_0``) in ``qrows.c``'s integer
    kernels: x [n, D] -> [n, V]."""

    def __init__(self, weight: torch.Tensor):
        V, D = weight.shape
        q, d = quantize_q8_0(weight.detach().cpu())
        codes = q.to(torch.int8).reshape(V, D).numpy()
        self.q = QLinear([(Codes(codes, d.numpy(), None, 32), Q8_0)])

    def __call__(self, x: torch.Tensor, kernel=None) -> torch.Tensor:
        return self.q(x)


class FusedLayer:
    """An EAGLE head's decoder layer as one ``forerun_q_layer`` call (``qrows``): both input norms,
    the products on 8-bit weights and activations, rotary embeddings, the cache writes, attention,
    the MLP and both residuals in C, instead of some twenty torch operations per drafting step.
    The layer reads [norm_emb(embedding) ; norm_hid(hid)] (``paired``) and adds to ``hid``.
    ``lins``: the packed qkv, o, gate_up and down layers (``Q8Linear``); ``norms``: the weights of
    the hidden-state, MLP and embedding norms."""

    def __init__(self, lins: list[Q8Linear], norms: list[torch.Tensor], *, n_heads: int, head_dim: int,
                 intermediate: int, eps: float):
        self.lins = [lin.q for lin in lins]
        self.norms = [t.detach().to(torch.float32).contiguous() for t in norms]
        self.n_heads, self.head_dim, self.eps = n_heads, head_dim, eps
        c = QLayerC()
        parts = [p for lin in self.lins for p in lin.parts]
        for i, p in enumerate(parts):
            c.w[i] = p.struct()
        for i, lin in enumerate(self.lins):
            c.parts[i] = len(lin.parts)
        c.norm[0], c.norm[1], c.norm_x2 = (t.data_ptr() for t in self.norms)
        c.n_q = c.n_kv = n_heads * head_dim
        c.inter, c.act, c.paired = intermediate, ACT_CODES["silu"], 1
        self.c = c

    def step(self, emb, hid, pos: int, cache, cos, sin, mask) -> torch.Tensor:
        """The layer over rows at ``pos``.. (``cos``/``sin`` [T, d] of each row's position; ``mask``
        [T, pos + T] for a tree, None causal); ``cache`` (``heads.HeadCache``) takes the new
        entries. Returns g [T, H]."""
        T, H, heads, d = emb.shape[0], hid.shape[-1], self.n_heads, self.head_dim
        end = pos + T
        x2 = emb.to(torch.float32).contiguous()
        cache.reserve(pos, end, heads, d, x2)  # float32 entries, as the kernel writes them
        cos, sin = cos.contiguous(), sin.contiguous()
        if mask is None:  # causal: row t sees entries 0..pos+t
            lo, hi, xp, extra = [0] * T, list(range(pos + 1, end + 1)), [0] * (T + 1), [0]
        else:  # a tree: each row's all-visible prefix, then its other visible entries
            hidden = ~mask.cpu()
            first = torch.where(hidden.any(1), hidden.int().argmax(1), mask.shape[1]).tolist()
            lo, hi, xp, extra = [0] * T, first, [0], []
            base = min(first)
            for r, row in enumerate(mask[:, base:].tolist()):  # only the tail past the shared prefix
                more = [base + j for j, seen in enumerate(row) if seen and base + j >= first[r]]
                extra += more
                xp.append(xp[-1] + len(more))
            extra = extra or [0]
        i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cpu")  # noqa: E731
        lo, hi, xp, extra = i32(lo), i32(hi), i32(xp), i32(extra)
        kb = torch.full((T,), cache.k.data_ptr(), dtype=torch.int64, device="cpu")
        vb = torch.full((T,), cache.v.data_ptr(), dtype=torch.int64, device="cpu")
        caps = torch.full((T,), cache.k.shape[2], dtype=torch.int64, device="cpu")
        slots = torch.arange(pos, end, dtype=torch.int32, device="cpu")
        h = hid.to(torch.float32).contiguous().clone()
        ps = QPassC()
        ps.N, ps.hidden, ps.H, ps.KVH, ps.D = T, H, heads, heads, d
        ps.eps, ps.scale, ps.softcap = self.eps, 1.0 / math.sqrt(d), 0.0
        for k in (0, 1):
            ps.cos[k], ps.sin[k] = cos.data_ptr(), sin.data_ptr()
            ps.lo[k], ps.hi[k], ps.xp[k], ps.extra[k] = lo.data_ptr(), hi.data_ptr(), xp.data_ptr(), extra.data_ptr()
        ps.kbase, ps.vbase, ps.cap, ps.slot = kb.data_ptr(), vb.data_ptr(), caps.data_ptr(), slots.data_ptr()
        ps.x2 = x2.data_ptr()
        lib = qrows_lib()
        lib.forerun_q_threads(torch.get_num_threads())
        if lib.forerun_q_layer(ctypes.byref(self.c), ctypes.byref(ps), 0, h.data_ptr()) != 0:
            raise MemoryError("qrows: out of memory in the head's layer")
        return h
