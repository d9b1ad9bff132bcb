"""llama-cpp-python, loaded once per process, and the hidden-state tap (``tap.c``): the graph
callback that hands over llama.cpp's final normed hidden state and chosen layers' outputs."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from forerun.backends.ckernels import kernel
from forerun.errors import ForerunError

_init_lock = threading.Lock()
_initialised = False


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401 - optional (the llamacpp extra): asked, never required
    except Exception:  # noqa: BLE001 - not installed, or its shared library fails to load
        return False
    return True


def load_llama_cpp():
    """The llama_cpp module, its backend initialised and its log quieted (once per process)."""
    global _initialised
    try:
        import llama_cpp  # optional (the llamacpp extra): imported when this backend is used
    except ImportError as e:
        raise ForerunError(
            "the llama.cpp backend needs llama-cpp-python: pip install 'forerun[llamacpp]' (it compiles llama.cpp)"
        ) from e
    with _init_lock:
        if not _initialised:
            # ggml's tiled K-quant product (passes of >= 8 rows) rounds differently from its
            # one-row product; it is read once per process, so it is switched off before first use
            # (this affects only the speed of long prompt passes).
            os.environ.setdefault("GGML_CPU_TILED_MM", "0")
            llama_cpp.llama_backend_init()
            quiet(llama_cpp)
            _initialised = True
    return llama_cpp


def llama_cpp_info(L) -> dict:
    """llama-cpp-python's version and llama.cpp's own system info line (its CPU features and
    backends), as a report records them. ``L``: the llama_cpp module, initialised by the caller
    (the bench's peer initialises it without ``load_llama_cpp``'s process-wide settings)."""
    info = L.llama_print_system_info()
    return {"llama_cpp_python": getattr(L, "__version__", "?"),
            "system_info": (info.decode(errors="replace") if isinstance(info, bytes) else str(info)).strip()}


_LOG_CB = None


def quiet(L) -> None:
    """Silence llama.cpp's loading chatter unless FORERUN_LLAMA_VERBOSE is set."""
    global _LOG_CB
    if os.environ.get("FORERUN_LLAMA_VERBOSE"):
        return

    @L.llama_log_callback
    def _drop(level, text, user_data):  # pragma: no cover - called from C
        pass

    _LOG_CB = _drop  # keep a reference: C holds only the pointer
    L.llama_log_set(_LOG_CB, ctypes.c_void_p(0))


_GGML = None


def ggml():
    """A few ggml functions (from the library llama-cpp-python ships) to read a tensor in the eval callback."""
    global _GGML
    if _GGML is None:
        L = load_llama_cpp()
        libdir = Path(L.__file__).parent / "lib"
        names = sorted(libdir.glob("libggml-base.*")) or sorted(libdir.glob("*ggml-base*"))
        if not names:
            raise ForerunError(f"cannot find libggml-base in {libdir}")
        g = ctypes.CDLL(str(names[0]))
        g.ggml_get_name.restype = ctypes.c_char_p
        g.ggml_get_name.argtypes = [ctypes.c_void_p]
        g.ggml_get_data_f32.restype = ctypes.POINTER(ctypes.c_float)
        g.ggml_get_data_f32.argtypes = [ctypes.c_void_p]
        g.ggml_nelements.restype = ctypes.c_int64
        g.ggml_nelements.argtypes = [ctypes.c_void_p]
        _GGML = g
    return _GGML


TAP_MAX = 8  # FORERUNTAP_MAX in tap.c


class TapState(ctypes.Structure):
    _fields_ = [("get_name", ctypes.c_void_p), ("get_data", ctypes.c_void_p), ("nelements", ctypes.c_void_p),
                ("active", ctypes.c_int32), ("stop", ctypes.c_int32), ("n_nodes", ctypes.c_int32),
                ("pad", ctypes.c_int32), ("cap", ctypes.c_int64), ("buf", ctypes.c_void_p * TAP_MAX),
                ("n", ctypes.c_int64 * TAP_MAX), ("node", (ctypes.c_char * 64) * TAP_MAX)]


_TAP_LIB = None


def tap_lib():
    global _TAP_LIB
    if _TAP_LIB is None:
        _TAP_LIB = kernel("tap") or False
    return _TAP_LIB or None


class HiddenTap:
    """Graph evaluation callback (``tap.c``) that hands over named nodes of llama.cpp's graph.

    ``start(stop=True)`` asks ggml's scheduler for the node named ``result_norm`` (the final
    normed hidden state), copies it and stops the graph there, so the LM head
    (``result_output``) is never computed. ``layers`` also copies those layers' outputs (nodes
    ``l_out-N``, the residual stream after layer N) for trained draft heads, without stopping.
    The callback is C: ggml calls it for every node of every decode (~700 per token here).
    """

    NORM = "result_norm"

    def __init__(self, L, lib, n_embd: int, n_batch: int):
        g = ggml()
        self.n_embd = n_embd
        self.bufs = [np.zeros(n_embd * n_batch, dtype=np.float32)]  # more are made as layers are asked for
        st = TapState()
        st.get_name = ctypes.cast(g.ggml_get_name, ctypes.c_void_p)
        st.get_data = ctypes.cast(g.ggml_get_data_f32, ctypes.c_void_p)
        st.nelements = ctypes.cast(g.ggml_nelements, ctypes.c_void_p)
        st.cap = self.bufs[0].size
        self.state = st  # C holds pointers into these: keep them alive with the tap
        self.fn = ctypes.cast(lib.forerun_tap_eval, L.ggml_backend_sched_eval_callback)
        self.user_data = ctypes.cast(ctypes.pointer(st), ctypes.c_void_p)
        self.names: list[str] = []

    def start(self, stop: bool = True, layers: Sequence[int] = ()) -> None:
        names = ([self.NORM] if stop else []) + [f"l_out-{i}" for i in layers]
        if len(names) > TAP_MAX:
            raise ValueError(f"at most {TAP_MAX - 1} feature layers can be read from llama.cpp")
        while len(self.bufs) < len(names):
            self.bufs.append(np.zeros_like(self.bufs[0]))
        st = self.state
        for k, name in enumerate(names):
            st.node[k].value = name.encode()
            st.buf[k] = self.bufs[k].ctypes.data
            st.n[k] = 0
        st.n_nodes, st.stop, st.active = len(names), int(stop), 1
        self.names = names

    def stop(self) -> None:
        self.state.active = 0

    def _get(self, k: int, rows: int) -> np.ndarray:
        n = self.state.n[k]
        if n < rows * self.n_embd or n % self.n_embd:
            raise RuntimeError(f"llama.cpp did not hand over {self.names[k]} for {rows} rows")
        return self.bufs[k][: rows * self.n_embd].reshape(rows, self.n_embd).copy()

    def hidden(self, rows: int) -> np.ndarray:
        """The final normed hidden state [rows, n_embd] (after start(stop=True))."""
        return self._get(0, rows)

    def layer_outputs(self, rows: int) -> np.ndarray:
        """The asked-for layers' outputs side by side: [rows, len(layers) * n_embd]."""
        first = 1 if self.names and self.names[0] == self.NORM else 0
        return np.concatenate([self._get(k, rows) for k in range(first, len(self.names))], axis=1)
