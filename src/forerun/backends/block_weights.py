"""A GGUF model's linear layers kept in their quantized blocks for the native backend's small passes.

The native backend runs on float32 weights, the GGUF file's blocks dequantized once at
conversion. Reading 4 bytes per weight makes a one-token step of a small model memory-bound
(SmolLM2's body: 18 of its 25 ms on a 2-core CPU). The blocks hold the same weights in 5-8 bits:
this module reads them back from the file, rewrites them into the two layouts of
``block_rows.c`` (4-bit codes per 32 weights, or 8-bit codes per 16), and proves that they
rebuild the float32 weights bit for bit (rows may come in another order: transformers reorders
Llama's query and key rows). The kernel then computes exactly what ``f32_rows.c`` computes on the
float32 weights, so greedy equality and batch invariance hold unchanged; a layer whose blocks do
not prove out, or of a type not handled here, keeps its float32 weights.

Handled types: Q4_0, Q4_1, Q4_K (4-bit layout); Q5_0, Q5_1, Q5_K, Q6_K, Q8_0 (8-bit layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from forerun.backends.ckernels import kernel
from forerun.gguf_file import BLOCKS, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0


@dataclass
class Codes:
    """One tensor's weights as w = fl(fl(scale * code) + offset), per group of ``group`` weights
    along a row: codes [rows, D] (int), scale and offset [rows, D / group] float32 (offset None
    where the type has none).

    ``factors`` (K-quants): the scales and offsets as the file holds them, a float per row and 256
    columns (the super-block's d, and -dmin) times a small integer per group (its sub-scale, and
    minimum): (scale factor [rows, D / 256], scale multiplier [rows, D / group] int8, offset factor
    and multiplier, or None). Each product is exact in float32 and equals ``scale`` (``offset``),
    so the integer kernels may keep 1 byte a group instead of 4 (``qweights.QPart``)."""

    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None
    group: int
    factors: tuple | None = None

    def dequantize(self) -> np.ndarray:
        rows, D = self.codes.shape
        g = D // self.group
        w = self.scale.reshape(rows, g, 1) * self.codes.reshape(rows, g, self.group).astype(np.float32)
        if self.offset is not None:
            w = w + self.offset.reshape(rows, g, 1)
        return w.reshape(rows, D)

    def rows(self, order: np.ndarray) -> Codes:
        """The same weights with their rows in ``order``."""
        f = None if self.factors is None else tuple(None if a is None else a[order] for a in self.factors)
        return Codes(self.codes[order], self.scale[order], None if self.offset is None else self.offset[order], self.group, f)

    def regroup(self, group: int) -> Codes:
        """The same weights with scales repeated over smaller groups."""
        if group == self.group:
            return self
        rep = self.group // group
        return Codes(self.codes, np.repeat(self.scale, rep, axis=1),
                     None if self.offset is None else np.repeat(self.offset, rep, axis=1), group)


def q4_0_codes(w: np.ndarray, bits: int = 4) -> Codes:
    """Weights [rows, D] (D a multiple of 32) as Q4_0 codes: per 32 weights a float16 scale d (the
    weight of largest magnitude over -8) and codes -8..7, w ~ d * code (as llama.cpp quantizes
    Q4_0). Used to make a draft model cheaper to read (``QLinear.requantized``). ``bits`` < 4: the
    same rule with codes -2^(bits-1)..2^(bits-1)-1 (over -2^(bits-1)), still held as Q4_0 codes
    (what a lower-bit draft would accept: ``bench/experiments/draft_tree_ceiling.py``)."""
    half = 1 << (bits - 1)
    rows, D = w.shape
    g = w.astype(np.float32).reshape(rows, D // 32, 32)
    big = np.take_along_axis(g, np.abs(g).argmax(-1)[..., None], -1)[..., 0]
    d = (big / np.float32(-half)).astype(np.float16).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    codes = np.clip(np.floor(g * inv[..., None] + np.float32(half + 0.5)), 0, 2 * half - 1) - half
    return Codes(codes.reshape(rows, D).astype(np.int16), d, None, 32)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] codes: weight j in the low half of byte j, j + 16 in the high half."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """Q5_0/Q5_1's 32 fifth bits (a little-endian uint32 per block) -> [n, 32] of 0/16."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")
    return (bits.astype(np.uint8) << 4).reshape(n, 32)


def _k_scales(sc: np.ndarray):
    """Q4_K/Q5_K's 12 bytes of packed 6-bit scales and mins -> two [n, 8] arrays."""
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scale = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=1)
    mins = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=1)
    return scale.astype(np.float32), mins.astype(np.float32)


def unpack(raw: np.ndarray, typ: int) -> Codes:
    """raw [rows, bytes per row] of GGUF blocks -> Codes, with the scale and offset arithmetic of
    the gguf package's dequantizer (the one transformers used at conversion)."""
    per, nbytes = BLOCKS[typ]
    rows = raw.shape[0]
    b = raw.reshape(-1, nbytes)
    n = b.shape[0]
    if typ in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
        d = _f16(b[:, 0:2])
        m = _f16(b[:, 2:4]) if typ in (Q4_1, Q5_1) else None
        if typ == Q8_0:
            codes = b[:, 2:34].view(np.int8).astype(np.int16)
        elif typ == Q4_0:
            codes = _nibbles32(b[:, 2:18]).astype(np.int16) - 8
        elif typ == Q4_1:
            codes = _nibbles32(b[:, 4:20]).astype(np.int16)
        elif typ == Q5_0:
            codes = (_nibbles32(b[:, 6:22]) | _high_bits(b[:, 2:6], n)).astype(np.int16) - 16
        else:
            codes = (_nibbles32(b[:, 8:24]) | _high_bits(b[:, 4:8], n)).astype(np.int16)
        return Codes(codes.reshape(rows, -1), d.reshape(rows, -1), None if m is None else m.reshape(rows, -1), 32)
    if typ in (Q4_K, Q5_K):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _k_scales(b[:, 4:16])
        scale = d[:, None] * sc  # [n, 8], one per 32 weights
        offset = -(dmin[:, None] * mn)  # fl(D q - DM) == fl(D q + (-DM))
        factors = (d.reshape(rows, -1), sc.astype(np.int8).reshape(rows, -1), -dmin.reshape(rows, -1),
                   mn.astype(np.int8).reshape(rows, -1))  # (-dmin) * mn: the same bits as -(dmin * mn)
        if typ == Q4_K:
            qs = b[:, 16:144].reshape(n, 4, 32)
            codes = np.stack([qs & 15, qs >> 4], axis=2).reshape(n, 256)
        else:
            qh = b[:, 16:48]  # [n, 32]: bit j of byte i is the fifth bit of weight 32 j + i
            qs = b[:, 48:176].reshape(n, 4, 32)
            low = np.stack([qs & 15, qs >> 4], axis=2).reshape(n, 8, 32)
            high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
            codes = (low | (high << 4)).reshape(n, 256)
        return Codes(codes.astype(np.int16).reshape(rows, -1), scale.reshape(rows, -1), offset.reshape(rows, -1), 32,
                     factors)
    if typ == Q6_K:
        ql, qh = b[:, 0:128], b[:, 128:192]
        sc = b[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(b[:, 208:210])
        low = np.stack([ql.reshape(n, 2, 64) & 15, ql.reshape(n, 2, 64) >> 4], axis=2).reshape(n, 2, 4, 32)
        high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        codes = (low | (high << 4)).astype(np.int16).reshape(n, 256) - 32
        return Codes(codes.reshape(rows, -1), (d[:, None] * sc).reshape(rows, -1), None, 16,
                     (d.reshape(rows, -1), sc.astype(np.int8).reshape(rows, -1), None, None))
    raise ValueError(f"GGUF type {typ} is not handled")


def match_rows(rebuilt: np.ndarray, weight: np.ndarray) -> np.ndarray | None:
    """The row order ``order`` with rebuilt[order] == weight bit for bit, or None."""
    if rebuilt.shape != weight.shape:
        return None
    if np.array_equal(rebuilt.view(np.uint32), weight.view(np.uint32)):
        return np.arange(len(weight))
    where: dict[bytes, int] = {}
    for i, row in enumerate(rebuilt):
        where.setdefault(row.tobytes(), i)
    order = [where.get(row.tobytes()) for row in weight]
    return None if any(o is None for o in order) else np.asarray(order)


class BlockWeight:
    """A [V, D] weight in one of ``block_rows.c``'s layouts; calling it takes x [n, D] to [n, V]."""

    def __init__(self, parts: list[Codes]):
        lo = min(int(p.codes.min()) for p in parts if p.codes.size)
        hi = max(int(p.codes.max()) for p in parts if p.codes.size)
        bias = 0 if lo >= 0 else -8  # Q4_0's codes run from -8 to 7
        four = all(p.group == 32 for p in parts) and lo - bias >= 0 and hi - bias <= 15
        group = 32 if four else 16
        parts = [p.regroup(group) for p in parts]
        codes = np.concatenate([p.codes for p in parts])
        offsets = [p.offset for p in parts]
        self.layout = "q4" if four else "q8"
        self.bias = bias
        self.shape = codes.shape
        self.scale = torch.from_numpy(np.ascontiguousarray(np.concatenate([p.scale for p in parts]), dtype=np.float32))
        if all(o is None for o in offsets):
            self.offset = None
        else:  # fl(s c + 0) == fl(s c) except for a zero's sign, which no sum below can tell apart
            self.offset = torch.from_numpy(np.ascontiguousarray(np.concatenate(
                [o if o is not None else np.zeros_like(p.scale) for o, p in zip(offsets, parts)]), dtype=np.float32))
        if four:
            c = (codes - bias).astype(np.uint8).reshape(codes.shape[0], -1, 2, 16)
            self.codes = torch.from_numpy(np.ascontiguousarray(c[:, :, 0] | (c[:, :, 1] << 4)).reshape(codes.shape[0], -1))
        else:
            self.codes = torch.from_numpy(np.ascontiguousarray(codes.astype(np.int8)))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset) if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lib = block_rows_kernel()
        x = x.to(torch.float32).contiguous()
        n, D = x.shape
        V = self.shape[0]
        if D != self.shape[1]:
            raise ValueError(f"block_rows: rows of {D} against a weight of {self.shape}")
        out = torch.empty(n, V, dtype=torch.float32, device="cpu")
        lib.forerun_block_threads(torch.get_num_threads())
        off = self.offset.data_ptr() if self.offset is not None else None
        if self.layout == "q4":
            rc = lib.forerun_q4_rows(self.codes.data_ptr(), self.scale.data_ptr(), off, self.bias, V, D,
                                     x.data_ptr(), n, out.data_ptr())
        else:
            rc = lib.forerun_q8w_rows(self.codes.data_ptr(), self.scale.data_ptr(), off, V, D,
                                      x.data_ptr(), n, out.data_ptr())
        if rc == -2:
            raise MemoryError("block_rows: out of memory")
        if rc != 0:
            raise ValueError(f"block_rows: bad sizes {n} x {D} against {self.shape}")
        return out


def gguf_codes(gguf, names: list[str], weight: torch.Tensor,
               row_orders: dict | None = None) -> list[tuple[Codes, int]] | None:
    """The blocks of GGUF tensors ``names`` (stacked along the rows, as ``weight`` stacks them) as
    (Codes in ``weight``'s row order, GGUF type), where they rebuild ``weight`` exactly; else None
    (a type not handled, or not the same weights). A weight on the meta device (a model built
    from the file, see ``gguf_model``) has nothing to compare with: its rows are read in the order
    ``row_orders`` gives per name (None or absent: as stored), as are the rows of any weight
    when ``row_orders`` is given (a model read from the file: its real tensors, the token
    embeddings and LM head, are the file's, dequantized by the ``gguf`` package, whose
    arithmetic ``unpack`` repeats)."""
    parts = []
    for name in names:
        t = gguf.tensors.get(name)
        if t is None or t.type not in BLOCKS or len(t.shape) != 2 or t.shape[0] % BLOCKS[t.type][0]:
            return None
        parts.append((unpack(gguf.raw_rows(name), t.type), t.type))
    if weight.is_meta or row_orders is not None:
        out = []
        for name, (p, typ) in zip(names, parts):
            order = (row_orders or {}).get(name)
            if order is not None:
                p = p.rows(order)
            out.append((p, typ))
        same = sum(p.codes.shape[0] for p, _ in out) == weight.shape[0] and all(
            p.codes.shape[1] == weight.shape[1] for p, _ in out)
        return out if same else None
    w = weight.detach().to(torch.float32).contiguous().numpy()
    start = 0
    for i, (p, typ) in enumerate(parts):
        rows = p.codes.shape[0]
        order = match_rows(p.dequantize(), w[start: start + rows])
        if order is None:
            return None
        if not np.array_equal(order, np.arange(rows)):
            p = p.rows(order)
        parts[i] = (p, typ)
        start += rows
    return parts if start == w.shape[0] else None


def from_gguf(gguf, names: list[str], weight: torch.Tensor) -> BlockWeight | None:
    """``gguf_codes`` as a ``BlockWeight``, or None."""
    parts = gguf_codes(gguf, names, weight)
    return None if parts is None else BlockWeight([p for p, _ in parts])


def block_rows_kernel():
    """The compiled ``block_rows.c``, or None where it cannot be built (logged once)."""
    return kernel("block_rows")
