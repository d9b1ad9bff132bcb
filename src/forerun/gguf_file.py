"""Just enough of the GGUF format to find one tensor and a few metadata values, fast.

The ``gguf`` package parses every metadata value (262,144 token strings for Gemma 3), which
takes seconds; this reader skips over values it is not asked for.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
# quantized types: id -> (weights per block, bytes per block)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
          Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}


_OPEN: dict = {}  # (real path, size, mtime) -> GGUFFile


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous dimension
    type: int
    offset: int  # absolute file offset


class GGUFFile:
    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.pos = 0
        if self.buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        self.pos = 4
        version = self._u("I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        n_tensors, n_kv = self._u("Q"), self._u("Q")
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._str()
            self.metadata[key] = self._value(self._u("I"))
        self.tensors: dict[str, TensorInfo] = {}
        infos = []
        for _ in range(n_tensors):
            name = self._str()
            nd = self._u("I")
            shape = tuple(self._u("Q") for _ in range(nd))
            infos.append((name, shape, self._u("I"), self._u("Q")))
        align = int(self.metadata.get("general.alignment", 32))
        base = (self.pos + align - 1) // align * align
        for name, shape, typ, off in infos:
            self.tensors[name] = TensorInfo(name, shape, typ, base + off)

    @classmethod
    def open(cls, path) -> GGUFFile:
        """The parsed file at ``path``, shared by every caller while the file is unchanged (one
        parse of a large vocabulary's metadata takes about a second)."""
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
        f = _OPEN.get(key)
        if f is None:
            f = _OPEN[key] = cls(str(path))
        return f

    def _u(self, fmt: str):
        v = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def _str(self) -> str:
        n = self._u("Q")
        s = self.buf[self.pos: self.pos + n].decode("utf-8", "replace")
        self.pos += n
        return s

    def _value(self, typ: int, keep: bool = True):
        if typ in _SCALARS:
            return self._u(_SCALARS[typ])
        if typ == STRING:
            return self._str()
        if typ == ARRAY:
            sub, n = self._u("I"), self._u("Q")
            if sub in _SCALARS:  # skip in one step
                self.pos += n * struct.calcsize(_SCALARS[sub])
                return None
            for _ in range(n):
                self._value(sub, keep=False)
            return None
        raise ValueError(f"unknown GGUF value type {typ}")

    def raw_rows(self, name: str) -> np.ndarray:
        """A quantized 2-D tensor as raw bytes [rows, bytes per row] (a view of the mapped file)."""
        t = self.tensors[name]
        if t.type not in BLOCKS or len(t.shape) != 2:
            raise ValueError(f"tensor {name} has unsupported type {t.type}")
        per, nbytes = BLOCKS[t.type]
        row = t.shape[0] // per * nbytes
        return np.frombuffer(self.buf, dtype=np.uint8, count=row * t.shape[1], offset=t.offset).reshape(t.shape[1], row)
