"""GGUF weights repacked for ``qrows.c``'s integer kernels, and the ctypes side of that file.

A GGUF model's linear layers run in ``qrows.c`` on their quantized blocks with 8-bit activations
(see the top of that file for the layout and the exact order of the sums). This module turns
each tensor's blocks (``block_weights.unpack``: codes, scales and offsets in the model's row
order) into that layout once at load, describes it to C (``QWeightC``), picks the build of
``qrows.c`` the CPU can run, and offers ``QLinear``: x [n, D] -> [n, V] for tests, the LM head
and anything else outside a layer.

Instruction sets: ``vnni`` (AVX-512 VNNI), ``avx2`` (AVX2, FMA, F16C) and ``portable`` (plain C).
All three give the same bits (tested); the fastest the CPU reports is used, or the one named by
the environment variable ``FORERUN_KERNEL`` (``portable``, ``avx2``, ``vnni``).
"""

from __future__ import annotations

import ctypes
import logging
import statistics
import time

import numpy as np
import torch

from forerun.backends.block_weights import Codes, q4_0_codes
from forerun.backends.ckernels import kernel
from forerun.gguf_file import Q4_0, Q5_0, Q6_K

log = logging.getLogger("forerun")

U4, U8, S8, U5, U6 = 0, 1, 2, 3, 4
PLANES = {U5: 1, U6: 2}  # kinds held as U4's nibbles plus one bit plane per code bit above the fourth
NIBBLE_KINDS = (U4, *PLANES)  # U4's 128 bytes of nibbles first in each block
_ZB = {Q4_0: -8, Q5_0: -16, Q6_K: -32}  # codes stored unsigned, the type's signed offset added back


FACTORED = 2  # QPart.f16: scales (offsets) as int8 multipliers of a float32 factor per 256 columns


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _factored(c: Codes, rows: int, groups: int) -> tuple | None:
    """``c.factors`` where they hold every scale and offset exactly as int8 times a float32 per
    256 columns (checked here, for the kernels take them so), else None."""
    f = c.factors
    if f is None or (f[2] is None) != (c.offset is None) or not f[0].shape[1]:
        return None
    per = 8 * groups * 32 // c.codes.shape[1]  # scale groups in 256 columns (the kernels' factor span)
    if f[0].shape != (rows, groups // per) or groups % per or f[1].shape != (rows, groups):
        return None
    for fac, mul, full in ((f[0], f[1], c.scale), (f[2], f[3], c.offset)):
        if fac is None:
            continue
        prod = np.repeat(fac.astype(np.float32), per, axis=1) * mul.astype(np.float32)
        if not np.array_equal(prod.view(np.uint32), full.astype(np.float32).view(np.uint32)):
            return None
    return (f[0].astype(np.float32), f[1].astype(np.int8),
            None if f[2] is None else f[2].astype(np.float32), None if f[3] is None else f[3].astype(np.int8))


class QWeightC(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("offset", ctypes.c_void_p),
                ("V", ctypes.c_int64), ("D", ctypes.c_int32), ("kind", ctypes.c_int32), ("sub", ctypes.c_int32),
                ("f16", ctypes.c_int32), ("zb", ctypes.c_int32), ("col", ctypes.c_int32),
                ("cmax", ctypes.c_int32), ("wide", ctypes.c_int32), ("sfac", ctypes.c_void_p), ("ofac", ctypes.c_void_p),
                ("many", ctypes.c_void_p), ("many_rows", ctypes.c_int32), ("pf_l1", ctypes.c_int32)]


class QPart:
    """One GGUF tensor (``Codes`` of type ``typ``) in ``qrows.c``'s interleaved layout."""

    def __init__(self, c: Codes, typ: int, col: int = 0):
        rows, D = c.codes.shape
        if D % 32 or c.group not in (16, 32):
            raise ValueError(f"qrows: a weight of {D} columns in groups of {c.group} is not handled")
        zb = _ZB.get(typ, 0)
        stored = c.codes.astype(np.int16) - zb
        lo, hi = int(stored.min()), int(stored.max())
        if c.group == 32 and lo >= 0 and hi <= 15:
            kind = U4
        elif lo >= 0 and hi <= 31:
            kind = U5
        elif lo >= 0 and hi <= 63:
            kind = U6
        elif lo >= 0 and hi <= 127:
            kind = U8
        else:
            kind, zb, stored = S8, 0, c.codes.astype(np.int16)
            if int(stored.min()) < -128 or int(stored.max()) > 127:
                raise ValueError("qrows: codes out of the 8-bit range")
        G = -(-rows // 8)
        pad = G * 8 - rows
        nb = D // 32
        b = np.zeros((G * 8, D), dtype=np.uint8)
        b[:rows] = stored.astype(np.int16).astype(np.uint8) if kind != S8 else stored.astype(np.int8).view(np.uint8)
        b = b.reshape(G, 8, nb, 8, 4).transpose(0, 2, 3, 1, 4)  # [group, block, 4-column step j, lane, 4]
        if kind in NIBBLE_KINDS:  # steps 0-3 in the low nibbles, 4-7 in the high ones
            nib = b & 15
            nib = (nib[:, :, :4] | (nib[:, :, 4:] << 4)).reshape(G, nb, 128)
            # bit plane p: byte (lane, column in step) holds bit 4 + p of that code at step j as bit j
            planes = [(((b >> (4 + p)) & 1) << np.arange(8, dtype=np.uint8)[:, None, None]).sum(2, dtype=np.uint8)
                      .reshape(G, nb, 32) for p in range(PLANES.get(kind, 0))]
            b = np.concatenate([nib, *planes], axis=2)
        self.codes = torch.from_numpy(np.ascontiguousarray(b).reshape(-1))
        sub = 32 // c.group

        def lay(a: np.ndarray) -> np.ndarray:  # [rows, nb * sub] -> [group][block][sub][lane] (factors: [rows, nb / 8])
            a = np.concatenate([a, np.zeros((pad, a.shape[1]), a.dtype)]) if pad else a
            return np.ascontiguousarray(a.reshape(G, 8, a.shape[1]).transpose(0, 2, 1))

        sc = lay(c.scale.astype(np.float32))
        of = None if c.offset is None else lay(c.offset.astype(np.float32))
        f16 = all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in (sc, of) if a is not None)
        fac = None if f16 else _factored(c, rows, nb * sub)
        self.sfac = self.ofac = None
        if fac is not None:  # K-quants: a float per 256 columns times an int8 per group, 1 byte a group
            store = FACTORED
            self.scale, self.sfac = torch.from_numpy(lay(fac[1]).reshape(-1)), torch.from_numpy(lay(fac[0]).reshape(-1))
            if of is not None:
                self.offset, self.ofac = torch.from_numpy(lay(fac[3]).reshape(-1)), torch.from_numpy(lay(fac[2]).reshape(-1))
            else:
                self.offset = None
        else:
            store, dt = int(f16), np.float16 if f16 else np.float32
            self.scale = torch.from_numpy(sc.astype(dt).reshape(-1))
            self.offset = None if of is None else torch.from_numpy(of.astype(dt).reshape(-1))
        self.V, self.D, self.kind, self.sub, self.f16, self.zb, self.col = rows, D, kind, sub, store, zb, col
        self.cmax = int(stored.max()) if kind != S8 else 127  # how many u8 x s8 pair sums int16 holds

    wide = 0  # the fewest rows at which the 512-bit tile takes it (0: the build's default; see tune_wide)
    many = None  # the same weight a byte a code (``as_bytes``), taken by passes of ``many_rows`` rows or more
    many_rows = 0
    pf_l1 = 0  # its stream prefetched into L1 (1) or L2 (0): measured per model and machine (``tune_prefetch``)

    def struct(self) -> QWeightC:
        if self.many is not None:  # the copy's struct at one address for good: layers' structs point at it
            c = self.many.struct()
            if getattr(self, "_many_c", None) is None:
                self._many_c = c
            else:
                ctypes.memmove(ctypes.addressof(self._many_c), ctypes.addressof(c), ctypes.sizeof(c))
        return QWeightC(self.codes.data_ptr(), self.scale.data_ptr(),
                        self.offset.data_ptr() if self.offset is not None else None,
                        self.V, self.D, self.kind, self.sub, self.f16, self.zb, self.col, self.cmax, self.wide,
                        _ptr(self.sfac), _ptr(self.ofac),
                        None if self.many is None else ctypes.addressof(self._many_c), self.many_rows, self.pf_l1)

    def as_bytes(self) -> QPart:
        """This weight with its 5- or 6-bit codes laid a byte each (kind U8), scales and offsets
        shared: the kernels then load a code vector where they joined nibbles and bit planes. The
        integer sums are the same, so every output has the same bits; a pass reads more bytes
        (Q6_K: 8 bits a code instead of 6), which pays only where a pass is bound by its products."""
        if self.kind not in PLANES:
            raise ValueError("qrows: only 5- and 6-bit codes are re-laid as bytes")
        out = object.__new__(QPart)
        out.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("many", "many_rows", "_many_c")})  # pf_l1 too
        out.codes, out.kind = torch.from_numpy(np.ascontiguousarray(self._code_bytes()).reshape(-1)), U8
        return out

    def _code_bytes(self) -> np.ndarray:
        """The stored codes a byte each, [group, block, 4-column step j, lane, 4] (U8's layout):
        nibbles and bit planes joined for U4, U5 and U6."""
        G, nb = -(-self.V // 8), self.D // 32
        raw = self.codes.numpy()
        if self.kind not in NIBBLE_KINDS:
            return raw.reshape(G, nb, 8, 8, 4)
        planes = PLANES.get(self.kind, 0)
        blk = raw.reshape(G, nb, 128 + 32 * planes)
        b = blk[:, :, :128].reshape(G, nb, 4, 8, 4)
        b = np.concatenate([b & 15, b >> 4], axis=2)
        for p in range(planes):
            plane = blk[:, :, 128 + 32 * p: 160 + 32 * p].reshape(G, nb, 1, 8, 4)
            b = b | (((plane >> np.arange(8, dtype=np.uint8)[:, None, None]) & 1) << (4 + p))
        return b

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset, self.sfac, self.ofac)
                   if t is not None)

    def dequantize(self) -> np.ndarray:
        """The weights [V, D] in float64, from the packed layout (tests: the reference)."""
        G, nb = -(-self.V // 8), self.D // 32
        b = self._code_bytes()
        codes = b.view(np.int8) if self.kind == S8 else b
        codes = codes.astype(np.float64).transpose(0, 3, 1, 2, 4).reshape(G * 8, self.D)[: self.V] + self.zb
        per = 32 // self.sub

        def unlay(t, fac=None):
            a = t.numpy().astype(np.float64).reshape(G, nb * self.sub, 8).transpose(0, 2, 1).reshape(G * 8, -1)
            if fac is not None:  # FACTORED: the multiplier times its 256 columns' factor
                f = fac.numpy().astype(np.float64).reshape(G, -1, 8).transpose(0, 2, 1).reshape(G * 8, -1)
                a = a * np.repeat(f, 8 * self.sub, axis=1)[:, : a.shape[1]]
            return np.repeat(a[: self.V], per, axis=1)

        w = codes * unlay(self.scale, self.sfac)
        return w + unlay(self.offset, self.ofac) if self.offset is not None else w


class QLinear:
    """A stacked weight (q, k, v; gate, up; or one tensor) as ``qrows.c`` parts: x [n, D] -> [n, V]."""

    threads: int | None = None  # threads of its products (None: torch's setting at each call)

    def __init__(self, parts: list[tuple[Codes, int] | QPart]):
        col = 0
        self.parts = []
        for item in parts:  # (Codes, GGUF type), or a part already packed (``requantized``)
            p = item if isinstance(item, QPart) else QPart(*item, col)
            p.col = col
            self.parts.append(p)
            col += p.V
        self.shape = (col, self.parts[0].D)
        self.structs = (QWeightC * len(self.parts))(*[p.struct() for p in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def requantized(self) -> QLinear:
        """The same weight with every part of more than 4 bits a code (5-, 6- and 8-bit codes:
        Q5_0, Q5_K, Q6_K, Q8_0, ...) quantized again to Q4_0 (``q4_0_codes``), 4-bit parts as they
        are: close to the weight, not equal to it. For a draft model, whose every step reads all its
        weights: fewer bytes a step, while the target's verification keeps the output exact."""
        parts = [p if p.kind == U4 else QPart(q4_0_codes(p.dequantize()), Q4_0) for p in self.parts]
        out = QLinear(parts)
        out.set_wide(self.parts[0].wide)
        out.set_prefetch(self.parts[0].pf_l1)
        return out

    @property
    def signature(self) -> str:
        """What the kernels' speed depends on: each part's code kind, scale groups, shape, bias,
        offset and scale storage (weights of one signature share a tile-width choice)."""
        return ";".join(f"{p.kind},{p.sub},{p.V},{p.D},{p.zb},{p.f16},{p.cmax},{int(p.offset is not None)}"
                        for p in self.parts)

    def set_wide(self, rows: int) -> None:
        """The fewest activation rows from which the AVX-512 build's 512-bit tile takes this weight
        (0: the build's default; ``NEVER_WIDE``: the 256-bit tile always). The bits are the same."""
        self._set_on_parts("wide", rows)

    def set_prefetch(self, l1: int) -> None:
        """Whether the products prefetch this weight's stream into L1 (1: 8 KiB ahead) or L2 (0:
        16 KiB ahead; ``tune_prefetch``). The bits are the same."""
        self._set_on_parts("pf_l1", int(l1))

    def _set_on_parts(self, name: str, value: int) -> None:
        """A kernel setting on every part and its byte copy, and the parts' C structs made again."""
        for i, p in enumerate(self.parts):
            setattr(p, name, value)
            if p.many is not None:
                setattr(p.many, name, value)
            self.structs[i] = p.struct()

    @property
    def has_planes(self) -> bool:
        """Whether a part holds 5- or 6-bit codes (``set_many`` has something to re-lay)."""
        return any(p.kind in PLANES for p in self.parts)

    def set_many(self, rows: int) -> None:
        """The fewest activation rows from which the products read this weight's 5- and 6-bit
        parts as bytes (``QPart.as_bytes``, laid out at the first call and kept; ``NEVER_WIDE``:
        never; ``drop_many`` frees the copy). The bits are the same."""
        for i, p in enumerate(self.parts):
            if p.kind not in PLANES or (rows >= NEVER_WIDE and p.many is None):
                continue
            if p.many is None:
                p.many = p.as_bytes()
                p.many.wide = p.wide
            p.many_rows = rows
            self.structs[i] = p.struct()

    def drop_many(self) -> None:
        """No byte-laid copy any more (``set_many``): its memory freed; structs that held it must be
        refreshed (``QLayer.refresh``)."""
        for i, p in enumerate(self.parts):
            if p.many is not None:
                p.many, p.many_rows = None, 0
                self.structs[i] = p.struct()

    def __call__(self, x: torch.Tensor, lib=None, f16_scales: bool = False) -> torch.Tensor:
        """x [n, D] -> outputs [n, V]. ``f16_scales``: activation scales rounded to float16, as
        ggml's Q8_0 activations store them (``qrows.c``, half_scales)."""
        x = self._rows(x)
        out = torch.empty(len(x), self.shape[0], dtype=torch.float32, device="cpu")
        if len(x):
            self._run(lib, "forerun_q_linear", x, out.data_ptr(), self.shape[0], int(f16_scales))
        return out

    def top(self, x: torch.Tensor, k: int = 1, f16_scales: bool = False, lib=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The k (1 or 2) largest of ``self(x, f16_scales=...)`` per row, without forming the
        outputs: indices [n, k] (int64; -1 where the weight has fewer rows) and values [n, k], the
        same sums, equal values in index order, NaN above all (torch.argmax's rule)."""
        x = self._rows(x)
        idx = torch.empty(len(x), k, dtype=torch.int64, device="cpu")
        val = torch.empty(len(x), k, dtype=torch.float32, device="cpu")
        if len(x):
            self._run(lib, "forerun_q_top", x, k, int(f16_scales), idx.data_ptr(), val.data_ptr())
        return idx, val

    def argmax(self, x: torch.Tensor, lib=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The argmax [n] (int64) of ``self(x)`` per row and its value [n] (``top`` with k = 1)."""
        idx, val = self.top(x, 1, lib=lib)
        return idx[:, 0], val[:, 0]

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """x as the kernels take it: float32 rows [n, D], D the weight's columns."""
        x = x.to(torch.float32).contiguous()
        n, D = x.shape
        if D != self.shape[1]:
            raise ValueError(f"qrows: rows of {D} against a weight of {self.shape}")
        return x

    def _run(self, lib, kernel: str, x: torch.Tensor, *outputs) -> None:
        """``kernel``(weight parts, x, n, *outputs) of ``lib`` (default: the chosen build), its error codes raised."""
        lib = lib or qrows_lib()
        lib.forerun_q_threads(self.threads or torch.get_num_threads())
        rc = getattr(lib, kernel)(self.structs, len(self.parts), x.data_ptr(), len(x), *outputs)
        if rc == -2:
            raise MemoryError("qrows: out of memory")
        if rc != 0:
            raise ValueError(f"qrows: bad sizes {len(x)} x {x.shape[1]} against {self.shape}")


PAIR_ROWS = 2  # qrows.c's default threshold for the 512-bit tile (a weight's ``wide`` of 0)
NEVER_WIDE = 1 << 30  # a tile-width threshold no pass reaches: the 256-bit tile at every row count
WIDE_ROWS = (2, 3, 4, 5, 6, 8, 16, 64)  # the row counts the tile width is measured at (5: a verify pass of 4 drafts)


def tune_wide(set_wide, run, rows=WIDE_ROWS, reps: int = 3, margin: float = 1.0) -> int:
    """The row count from which the 512-bit tile should take some weights on this machine, by
    measurement: ``run(n)`` (a product or a pass of n rows) timed at each of ``rows`` with
    ``set_wide(PAIR_ROWS)`` (the 512-bit tile) and ``set_wide(NEVER_WIDE)`` (the 256-bit one); the
    smallest count from which the 512-bit tile was at least as fast at every measured count, or
    ``NEVER_WIDE`` where it lost at the largest. Leaves the weights set to it.

    Measured because no rule of thumb held: on a Zen 5 core the 512-bit tile took a 1.5B model's
    6-bit LM head (151,936 x 1536) at 5 rows in 2.2x the 256-bit tile's time, while its layers ran a
    5-row pass faster with it and a 2-row pass slower (docs/kernels.md).

    ``margin`` < 1: the first setting counts as winning only where its time is at most that share
    of the other's (each side's median of ``reps``, not its best: a setting that costs memory
    should win plainly, not by one lucky sample)."""
    wins = {}
    for n in rows:
        times = {PAIR_ROWS: [], NEVER_WIDE: []}
        for w in (PAIR_ROWS, NEVER_WIDE):  # untimed first calls
            set_wide(w)
            run(n)
        for _ in range(reps):
            for w in (PAIR_ROWS, NEVER_WIDE):
                set_wide(w)
                t = time.perf_counter()
                run(n)
                times[w].append(time.perf_counter() - t)
        pick = min if margin >= 1.0 else statistics.median
        wins[n] = pick(times[PAIR_ROWS]) <= margin * pick(times[NEVER_WIDE])
    chosen = NEVER_WIDE
    for n in reversed(rows):
        if not wins[n]:
            break
        chosen = n
    set_wide(chosen)
    return chosen


PREFETCH_MARGIN = 0.97  # L1 is taken only where its passes take at most 97% of L2's time


def tune_prefetch_level(set_l1, run, rows=(1, 5), reps: int = 7, margin: float = PREFETCH_MARGIN) -> int:
    """Whether the products should prefetch some weights' streams into L1 (1) or L2 (0) on this
    machine, by measurement: ``run(n)`` (a pass of n rows) timed at each of ``rows`` under both
    settings, alternating; L1 where its medians sum (a one-token step plus a verify pass, by
    default) to at most ``margin`` of L2's, else L2. Leaves the weights set to it. The margin: one
    tune under load chose L1 for the 1.5B that every paired run here found 10% slower with it.

    Measured because it is the CPU's: on a 2-core Zen 4 the L2 prefetch took a 1.5B model's
    one-token step from 36.5 to 34.4 ms and its 5-row pass from 65.2 to 54.0 ms, same bits
    (docs/kernels.md)."""
    times = {0: {n: [] for n in rows}, 1: {n: [] for n in rows}}
    for n in rows:
        for l1 in (0, 1):  # untimed first calls
            set_l1(l1)
            run(n)
        for i in range(reps):
            for l1 in ((0, 1) if i % 2 == 0 else (1, 0)):
                set_l1(l1)
                t = time.perf_counter()
                run(n)
                times[l1][n].append(time.perf_counter() - t)
    total = {l1: sum(statistics.median(times[l1][n]) for n in rows) for l1 in (0, 1)}
    chosen = 1 if total[1] <= margin * total[0] else 0
    set_l1(chosen)
    return chosen


def qrows_lib():
    """The loaded build of ``qrows.c`` of the chosen instruction set (``ckernels.chosen_isa``);
    None without a C compiler (the slow path is then said once)."""
    return kernel("qrows")


# -- whole layers ------------------------------------------------------------------------------

ACT_CODES = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1, "gelu": 2}
KIND = {"full_attention": 0, "sliding_attention": 1}


class QLayerC(ctypes.Structure):
    _fields_ = [("w", QWeightC * 8), ("parts", ctypes.c_int32 * 4),
                ("qkv_bias", ctypes.c_void_p), ("o_bias", ctypes.c_void_p), ("gate_up_bias", ctypes.c_void_p),
                ("down_bias", ctypes.c_void_p), ("norm", ctypes.c_void_p * 4), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("n_q", ctypes.c_int32), ("n_kv", ctypes.c_int32),
                ("inter", ctypes.c_int32), ("sandwich", ctypes.c_int32), ("act", ctypes.c_int32),
                ("sliding", ctypes.c_int32), ("norm_x2", ctypes.c_void_p), ("paired", ctypes.c_int32),
                ("pad_", ctypes.c_int32)]


class QPassC(ctypes.Structure):
    _fields_ = [("N", ctypes.c_int32), ("hidden", ctypes.c_int32), ("H", ctypes.c_int32), ("KVH", ctypes.c_int32),
                ("D", ctypes.c_int32), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("softcap", ctypes.c_float),
                ("cos", ctypes.c_void_p * 2), ("sin", ctypes.c_void_p * 2), ("kbase", ctypes.c_void_p),
                ("vbase", ctypes.c_void_p), ("cap", ctypes.c_void_p), ("slot", ctypes.c_void_p),
                ("lo", ctypes.c_void_p * 2), ("hi", ctypes.c_void_p * 2), ("xp", ctypes.c_void_p * 2),
                ("extra", ctypes.c_void_p * 2), ("x2", ctypes.c_void_p), ("kv_f16", ctypes.c_int32),
                ("pad_", ctypes.c_int32)]


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


class QLayer:
    """One transformer layer for ``forerun_q_layer``: its four stacked weights as ``QLinear`` and
    its norms and biases as contiguous float32 (kept here, so that the pointers stay valid)."""

    def __init__(self, layer, linears: dict[str, QLinear], act: str, sandwich: bool):
        keep = lambda t: None if t is None else t.detach().to(torch.float32).contiguous()  # noqa: E731
        self.linears = linears
        self.tensors = {"qkv_bias": keep(layer.qkv_bias), "o_bias": keep(layer.o_bias),
                        "gate_up_bias": keep(layer.gate_up_bias), "down_bias": keep(layer.down_bias),
                        "q_norm": keep(layer.q_norm), "k_norm": keep(layer.k_norm)}
        self.norms = [keep(n) for n in layer.norms]
        parts = [p for name in ("qkv", "o", "gate_up", "down") for p in linears[name].parts]
        if len(parts) > 8:
            raise ValueError("qrows: more than 8 weight parts in a layer")
        self.parts = parts
        c = QLayerC()
        for i, p in enumerate(parts):
            c.w[i] = p.struct()
        for i, name in enumerate(("qkv", "o", "gate_up", "down")):
            c.parts[i] = len(linears[name].parts)
        for name, t in self.tensors.items():
            setattr(c, name, _ptr(t))
        for i, n in enumerate(self.norms):
            c.norm[i] = _ptr(n)
        c.n_q, c.n_kv, c.inter = layer.n_q, layer.n_kv, layer.inter
        c.sandwich, c.act, c.sliding = int(sandwich), ACT_CODES[act], int(layer.sliding)
        self.c = c

    def set_linears(self, linears: dict[str, QLinear]) -> None:
        """Other weights of the same shapes and part counts (``QLinear.requantized``) in place."""
        parts = [p for name in ("qkv", "o", "gate_up", "down") for p in linears[name].parts]
        if [len(linears[n].parts) for n in linears] != [len(self.linears[n].parts) for n in linears]:
            raise ValueError("qrows: a layer's weights replaced by ones of other part counts")
        self.linears, self.parts = linears, parts
        self.refresh()

    def refresh(self) -> None:
        """Copy the weights' settings (``QLinear.set_wide``) into the layer's C struct again."""
        for i, p in enumerate(self.parts):
            self.c.w[i] = p.struct()

    @property
    def nbytes(self) -> int:
        return sum(l.nbytes for l in self.linears.values())
