"""Our own forward pass for Llama, Mistral, Qwen2/3 and Gemma 1/2/3 text models, with a static
per-position KV cache.

Why not the transformers module: we need positions we choose, a cache rolled back by
bookkeeping, layer skipping for self-speculation, hidden states, and the least possible
per-step overhead. The weights are the transformers model's own tensors (no copy),
except that linear layers are prepacked for oneDNN on CPU (see ``_linear``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from forerun.backends.base import ArgmaxOutput, BackendBase, Capabilities, ForwardOutput
from forerun.backends.ckernels import kernel
from forerun.backends.fixed_rows import FIXED_DEFAULT_CONTEXT, MAX_ROWS, FixedRows

log = logging.getLogger("forerun")

# Passes of up to this many rows (one-token steps, chains, token trees with a lookup branch) are
# computed row by row alike where the backend is batch-invariant (see NativeBackend.batch_invariant);
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
    picks one kernel for all of them from whole body passes, see ``NativeBackend.body_kernel``,
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
        if how == "rows" and small:  # the body's choice (NativeBackend.body_kernel)
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
        from forerun.timing import median_s

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


def attn_rows_kernel():
    """The compiled ``attn_rows.c`` (see there), or None where it cannot be built (logged once)."""
    return kernel("attn_rows")


class RowKeys:
    """The cache slots each row of a pass attends to, in order: ``lo[t]``..``hi[t]``-1, then
    ``extra[xp[t]:xp[t+1]]`` (a tree row: its ancestors and itself). Exactly the slots a one-token
    step at that row's position sees once the row's path is the cache's content."""

    def __init__(self, lo, hi, extras=None):
        extras = extras or [[] for _ in range(len(lo))]
        self.rows = [(a, b, e) for a, b, e in zip(lo, hi, extras)]

    # int32 tensors for the C kernels, made on first use
    @functools.cached_property
    def lo(self) -> torch.Tensor:
        return torch.tensor([r[0] for r in self.rows], dtype=torch.int32, device="cpu")

    @functools.cached_property
    def hi(self) -> torch.Tensor:
        return torch.tensor([r[1] for r in self.rows], dtype=torch.int32, device="cpu")

    @functools.cached_property
    def xp(self) -> torch.Tensor:
        return torch.tensor([0] + [len(r[2]) for r in self.rows], dtype=torch.int32, device="cpu").cumsum(0, dtype=torch.int32)

    @functools.cached_property
    def extra(self) -> torch.Tensor:
        return torch.tensor([j for r in self.rows for j in r[2]] or [0], dtype=torch.int32, device="cpu")

    @classmethod
    def chain(cls, pos: int, T: int, window: int | None) -> "RowKeys":
        ends = range(pos + 1, pos + T + 1)
        return cls([max(0, e - window) if window else 0 for e in ends], list(ends))

    def slots(self, t: int) -> torch.Tensor | tuple[int, int]:
        a, b, e = self.rows[t]
        return (a, b) if not e else torch.cat([torch.arange(a, b, device="cpu"), torch.tensor(e, dtype=torch.long, device="cpu")])

    def keys_values(self, t: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row t's keys and values [kv_heads, S_t, D] from one layer's cache k, v [kv_heads, cap, D]."""
        sel = self.slots(t)
        return (k[:, sel[0]: sel[1]], v[:, sel[0]: sel[1]]) if isinstance(sel, tuple) else (k[:, sel], v[:, sel])


class SequenceRows:
    """The rows of a batched pass over several sequences, for one ``attn_rows.c`` call per layer:
    every row's keys (``RowKeys`` joined), and where each row's sequence keeps its cache."""

    def __init__(self, seqs: Sequence["NativeBackend"], keys: Sequence[RowKeys], positions: Sequence[int]):
        """``positions``: where each sequence's rows start in its cache. Built from plain lists, one
        tensor per field: a one-token step spends little here."""
        pos, lo, hi, xp, extra, kb, vb, caps = [], [], [], [0], [], [], [], []
        for s, k, p in zip(seqs, keys, positions):
            n = len(k.rows)
            pos += range(p, p + n)
            for a, b, e in k.rows:
                lo.append(a)
                hi.append(b)
                extra += e
                xp.append(xp[-1] + len(e))
            kb += [s.k_cache.data_ptr()] * n
            vb += [s.v_cache.data_ptr()] * n
            caps += [s.k_cache.shape[2]] * n
        i32 = lambda v: torch.from_numpy(np.array(v, dtype=np.int32))  # noqa: E731  (numpy: cheaper than torch.tensor)
        i64 = lambda v: torch.from_numpy(np.array(v, dtype=np.int64))  # noqa: E731
        self.pos, self.lo, self.hi, self.xp, self.extra = i32(pos), i32(lo), i32(hi), i32(xp), i32(extra + [0])
        self.k_base, self.v_base, self.caps = i64(kb), i64(vb), i64(caps)
        _, self.kv_heads, _, D = seqs[0].k_cache.shape  # [layers, kv_heads, cap, D]
        self.layer_bytes = i64([c * self.kv_heads * D * 4 for c in caps])  # one layer of one cache, float32

    def store(self, k: torch.Tensor, v: torch.Tensor, idx: int) -> None:
        """Keys and values k, v [rows, kv_heads, D] of every row into layer ``idx`` of its own cache."""
        k, v = k.contiguous(), v.contiguous()
        kp = self.k_base + idx * self.layer_bytes  # held here: the kernel reads these addresses
        vp = self.v_base + idx * self.layer_bytes
        attn_rows_kernel().forerun_store_rows(k.data_ptr(), v.data_ptr(), kp.data_ptr(), vp.data_ptr(), self.caps.data_ptr(),
                                              self.pos.data_ptr(), k.shape[0], self.kv_heads, k.shape[2])

    def attend(self, q: torch.Tensor, idx: int, scale: float) -> torch.Tensor:
        """q [rows, heads, D] of every sequence against layer ``idx`` of each row's own cache."""
        T, H, D = q.shape
        lib = attn_rows_kernel()
        q = q.contiguous()
        out = torch.empty(T, H, D, dtype=torch.float32, device="cpu")
        kp = self.k_base + idx * self.layer_bytes
        vp = self.v_base + idx * self.layer_bytes
        lib.forerun_attn_threads(torch.get_num_threads())
        rc = lib.forerun_attn_rows_multi(q.data_ptr(), kp.data_ptr(), vp.data_ptr(), self.caps.data_ptr(), T, H,
                                         self.kv_heads, D, self.lo.data_ptr(), self.hi.data_ptr(), self.xp.data_ptr(),
                                         self.extra.data_ptr(), scale, out.data_ptr())
        if rc != 0:
            raise MemoryError("attn_rows: out of memory")
        return out.view(T, H * D)


def attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: RowKeys, scale: float) -> torch.Tensor:
    """Batch-invariant attention: q [T, heads, D] over one layer's cache k, v [kv_heads, cap, D],
    row t over ``keys``' slots for row t only; [T, heads * D]. ``attn_rows.c`` where it builds,
    else one PyTorch call per row (each row then as a one-token step computes it)."""
    T, H, D = q.shape
    lib = attn_rows_kernel()
    if lib is None or q.dtype != torch.float32 or q.device.type != "cpu":
        qt = q.transpose(0, 1)[None]
        outs = []
        for t in range(T):
            kk, vv = keys.keys_values(t, k, v)
            outs.append(F.scaled_dot_product_attention(qt[:, :, t: t + 1], kk[None], vv[None], scale=scale,
                                                       enable_gqa=H != k.shape[0]))
        return torch.cat(outs, 2)[0].transpose(0, 1).reshape(T, H * D)
    q = q.contiguous()
    out = torch.empty(T, H, D, dtype=torch.float32, device="cpu")
    lib.forerun_attn_threads(torch.get_num_threads())
    rc = lib.forerun_attn_rows(q.data_ptr(), k.data_ptr(), v.data_ptr(), k.shape[1], T, H, k.shape[0], D,
                               keys.lo.data_ptr(), keys.hi.data_ptr(), keys.xp.data_ptr(), keys.extra.data_ptr(),
                               scale, out.data_ptr())
    if rc != 0:
        raise MemoryError("attn_rows: out of memory")
    return out.view(T, H * D)


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_float: bool = True) -> torch.Tensor:
    """RMS norm with the norm's effective weight (Gemma's ``1 + w`` folded in). ``weight_in_float``:
    Gemma multiplies by the weight before casting back to x's dtype, Llama-style norms after."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_float:
        return (xf * weight).type_as(x)
    return weight * xf.type_as(x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# Architectures the native forward runs, checked against transformers' own modules in the tests
# (tiny random configurations). What differs between them is data, see ``Arch``.
SUPPORTED_MODEL_TYPES = ("gemma3_text", "gemma2", "gemma", "llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ARCHITECTURES = "Llama, Mistral, Qwen2/3 or Gemma 1/2/3"  # the same, as users name them
_ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}


@dataclass(frozen=True)
class Arch:
    """What sets one decoder-only architecture of the Llama lineage apart from another."""

    gemma_norms: bool  # norms scale by (1 + w) in float32; token embeddings scale by sqrt(hidden)
    sandwich: bool  # Gemma 2/3: norms after attention and after the MLP too (four per layer)
    act: str  # the MLP's gate activation
    scale: float  # attention scale
    attn_softcap: float | None  # Gemma 2: tanh soft cap on attention scores
    final_softcap: float | None  # Gemma 2/3: tanh soft cap on the logits
    layer_types: tuple  # "full_attention" / "sliding_attention" per layer
    window: int | None  # sliding window of the sliding layers

    @classmethod
    def of(cls, cfg) -> "Arch":
        mt = cfg.model_type
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"native backend does not support model type {mt!r}")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        qpas = getattr(cfg, "query_pre_attn_scalar", None)
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"native backend: unsupported activation {act!r}")
        window = getattr(cfg, "sliding_window", None)
        types = getattr(cfg, "layer_types", None)
        if not types:  # Mistral: every layer slides when a window is set
            types = ["sliding_attention" if window else "full_attention"] * cfg.num_hidden_layers
        if not window:
            types = ["full_attention"] * cfg.num_hidden_layers
        gemma = mt.startswith("gemma")
        return cls(gemma_norms=gemma, sandwich=mt in ("gemma2", "gemma3_text"), act=act,
                   scale=(qpas if qpas else head_dim) ** -0.5,
                   attn_softcap=getattr(cfg, "attn_logit_softcapping", None) or None,
                   final_softcap=getattr(cfg, "final_logit_softcapping", None) or None,
                   layer_types=tuple(types), window=window or None)


class _Layer:
    def __init__(self, hf_layer, attention_type: str, pack: bool, arch: Arch):
        a, m = hf_layer.self_attn, hf_layer.mlp
        self.n_q = a.q_proj.out_features
        self.n_kv = a.k_proj.out_features
        self.qkv = PackedLinear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(), pack)
        self.qkv_bias = _bias(a.q_proj, a.k_proj, a.v_proj)  # Qwen2
        self.o = PackedLinear(a.o_proj.weight.detach(), pack)
        self.o_bias = _bias(a.o_proj)
        self.inter = m.gate_proj.out_features
        self.gate_up = PackedLinear(torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(), pack)
        self.gate_up_bias = _bias(m.gate_proj, m.up_proj)
        self.down = PackedLinear(m.down_proj.weight.detach(), pack)
        self.down_bias = _bias(m.down_proj)
        self.act = _ACTIVATIONS[arch.act]
        names = (("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm") if arch.sandwich else ("input_layernorm", "post_attention_layernorm"))
        fold = _norm_weight if arch.gemma_norms else (lambda n: n.weight.detach())
        # sandwich: [before attention, after attention, before the MLP, after the MLP]; else
        # [before attention, before the MLP]
        self.norms = [fold(getattr(hf_layer, n)) for n in names]
        # Gemma 3 and Qwen3 norm queries and keys per head
        self.q_norm = fold(a.q_norm) if hasattr(a, "q_norm") else None
        self.k_norm = fold(a.k_norm) if hasattr(a, "k_norm") else None
        self.sliding = attention_type == "sliding_attention"


def _norm_weight(norm) -> torch.Tensor:
    """Gemma's norms scale by (1 + w): fold the 1 in once."""
    return 1.0 + norm.weight.detach().float()


def _bias(*linears) -> torch.Tensor | None:
    """The linear layers' biases side by side, or None where they have none."""
    if all(getattr(l, "bias", None) is None for l in linears):
        return None
    return torch.cat([l.bias.detach() if l.bias is not None else l.weight.new_zeros(l.out_features)
                      for l in linears])


def _add(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias


class NativeBackend(BackendBase):
    """Our own forward pass for the architectures in ``SUPPORTED_MODEL_TYPES``."""

    @property
    def capabilities(self) -> Capabilities:
        """Exact argmax passes (chains, trees, with layer outputs), token trees, batched passes,
        layer skipping; greedy trees run the LM head lazily on the CPU only (see ``lazy_tree_head``)."""
        return Capabilities(exact_argmax=True, argmax_features=True, argmax_tree=True,
                            lazy_tree_head=self.lazy_tree_head, token_trees=True, batched=True, layer_skip=True,
                            kv_segments=True, hidden_states=True)

    def __init__(self, hf_model, *, max_context: int | None = None, pack_linear: bool = True,
                 exact_greedy: bool | str = "auto", batch_invariant: bool = True, gguf: str | None = None,
                 integer: bool = True, file_tensors=None, fixed_rows: bool | None = None):
        """``gguf``: the GGUF file the weights were dequantized from. With ``integer`` (the default)
        every layer then runs in ``qrows.c`` on the file's blocks with 8-bit activations, one native
        call per pass (see ``qweights``), where every linear weight is of a handled type and the
        kernels build; otherwise the blocks serve the layers' small passes in float32, bit for bit
        as the dequantized weights (see ``block_weights``). A model built by ``gguf_model.skeleton``
        (weights on the meta device, ``file_tensors`` from it) runs on the integer path or not at
        all (ValueError); its token embeddings and LM head are read from the file when used.
        ``fixed_rows``: passes of up to ``fixed_rows.MAX_ROWS`` rows run in fixed shapes (see
        ``fixed_rows``; lossless in any dtype): None (the default) everywhere but the CPU's float32
        path, which is batch-invariant by its own kernels."""
        cfg = hf_model.config
        arch = Arch.of(cfg)
        self.arch = arch
        inner = hf_model.model
        self.config = cfg
        self.device = torch.device("cpu") if file_tensors is not None else inner.embed_tokens.weight.device
        self.dtype = inner.embed_tokens.weight.dtype
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.hidden_size
        self.num_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scale = arch.scale
        self.window = arch.window
        self.max_context = min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if fixed_rows is None:  # the CPU's float32 kernels are batch-invariant on their own; nothing else is
            fixed_rows = self.device.type != "cpu" or self.dtype != torch.float32
        if fixed_rows and max_context is None and self.max_context > FIXED_DEFAULT_CONTEXT:
            # fixed-shape passes allocate the whole cache at once: a long-context model gets a
            # default the GPU can hold for several sequences; ``max_context`` raises it
            log.info("cache for %d positions (the model allows %d; max_context raises it)", FIXED_DEFAULT_CONTEXT,
                     self.max_context)
            self.max_context = FIXED_DEFAULT_CONTEXT
        self._files = file_tensors
        # the token embeddings, shared with forks: {"t": tensor}, on the meta device until
        # ``embed`` is first asked for where the file holds them (steps read their rows alone)
        self._embed = {"t": inner.embed_tokens.weight.detach()}
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5 if arch.gemma_norms else 1.0, dtype=self.dtype, device=self.device)
        self.final_norm = _norm_weight(inner.norm) if arch.gemma_norms else inner.norm.weight.detach()
        head_source = None
        if file_tensors is not None:
            head_source = ((lambda: self.embed) if file_tensors.head_name is None
                           else (lambda: file_tensors.full(file_tensors.head_name)))
        self.lm_head = PackedLinear(hf_model.lm_head.weight.detach(), pack_linear, autotune=True, source=head_source)
        self.softcap = arch.final_softcap
        self.layers = [_Layer(layer, arch.layer_types[i], pack_linear, arch) for i, layer in enumerate(inner.layers)]
        self.quant = None  # QLayer per layer: the integer path (``_qbody``)
        lean = file_tensors is not None
        if gguf and pack_linear and self.device.type == "cpu" and self.dtype == torch.float32:
            if not (integer and self._attach_integer(gguf)):
                if lean:
                    raise ValueError("the integer kernels cannot run this GGUF file's layers")
                self._attach_blocks(gguf)
        elif lean:
            raise ValueError("a model without its linear weights runs on the integer path only")
        # Rotary tables per attention type, from the transformers module (it knows every rope variant).
        rot = inner.rotary_emb
        self._inv_freq = {}
        self._rope_scale = {}
        for t in set(arch.layer_types):
            per_type = hasattr(rot, f"{t}_inv_freq")  # Gemma 3: local and global layers rotate differently
            self._inv_freq[t] = getattr(rot, f"{t}_inv_freq" if per_type else "inv_freq").detach().float().to(self.device)
            self._rope_scale[t] = getattr(rot, f"{t}_attention_scaling" if per_type else "attention_scaling", 1.0)
        self._pack = pack_linear
        self._body_choice = {"kernel": None}  # shared with forks: chosen once (see body_kernel)
        self._want_invariant = batch_invariant
        self.exact_greedy = exact_greedy
        self._exact = None  # undecided; then the screened exact head, or False (float32 logits)
        self._hf_model = hf_model
        self._cap = 0
        self._rope_tabs = {}  # the integer path's rotary tables (see _rope_table), shared with forks
        self._len = 0
        self.k_cache = self.v_cache = None
        self._fixed = FixedRows(self) if fixed_rows and self.quant is None else None
        self._tree_scratch = None  # keys and values of a tree row, laid out for its pass (``fixed_rows``)

    # GGUF layer names of each _Layer linear, in the order its weight stacks them
    _GGUF_PARTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",),
                   "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}

    def _attach_integer(self, path: str) -> bool:
        """Repack every layer's GGUF blocks and the LM head for ``qrows.c``; False (nothing kept)
        where a weight's type is not handled or the kernels do not build."""
        from forerun.backends.block_weights import gguf_codes
        from forerun.gguf_file import GGUFFile

        try:
            g = GGUFFile.open(path)
        except (OSError, ValueError) as e:
            log.info("no GGUF blocks (%s): layers run on float32 weights", e)
            return False
        files = self._files
        if files is not None:
            head = files.head_name or files.embed_name
        else:
            head = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
        return self.attach_integer(lambda names, w: gguf_codes(g, [head] if names == ["output"] else names, w,
                                                               files.row_orders if files is not None else None))

    def attach_integer(self, codes_of) -> bool:
        """Run every layer and the LM head on the integer kernels, with the blocks that
        ``codes_of(gguf_names, weight)`` gives ((Codes, GGUF type) per tensor, stacked as ``weight``
        stacks them, or None); the head is asked for as ``["output"]``. False (nothing changed)
        where one is missing or the kernels cannot run it."""
        from forerun.backends.qweights import ACT_CODES, QLayer, QLayerC, QLinear, qrows_lib

        if (qrows_lib() is None or self.arch.act not in ACT_CODES or self.head_dim > 1024
                or self.hidden_size % 32 or self.device.type != "cpu" or self.dtype != torch.float32):
            return False
        quant = []
        for i, layer in enumerate(self.layers):
            lins = {}
            for attr, parts in self._GGUF_PARTS.items():
                codes = codes_of([f"blk.{i}.{p}.weight" for p in parts], getattr(layer, attr).weight)
                if codes is None or any(c.codes.shape[1] % 32 for c, _ in codes):
                    log.info("layer %d %s: a weight type the integer kernels do not take; float32 path", i, attr)
                    return False
                lins[attr] = QLinear(codes)
            quant.append(QLayer(layer, lins, self.arch.act, self.arch.sandwich))
        codes = codes_of(["output"], self.lm_head._weight)  # not built from a file where it was left there
        if codes is None:
            log.info("LM head: a weight type the integer kernels do not take; float32 path")
            return False
        self.lm_head.qlin = QLinear(codes)
        self.quant = quant
        self._fixed = None  # the integer path computes every row alone already, in its own kernels
        self._qlayers = (QLayerC * len(quant))(*[q.c for q in quant])  # every layer, for one native call per pass
        # float16 keys and values from now on (as llama.cpp keeps them): half the bytes a step reads
        # at long contexts; a cache of the float32 path is not carried over
        self.k_cache = self.v_cache = None
        self._cap = self._len = 0
        self._exact = None
        # never read again: the layers' float32 weights (stacked copies of the model's) and
        # oneDNN copies, and the LM head's oneDNN copy (sub-heads and trained heads have their own)
        for layer in self.layers:
            for attr in self._GGUF_PARTS:
                lin = getattr(layer, attr)
                lin.packed = None
                lin.weight = lin.weight.to("meta")
        self.lm_head.packed, self.lm_head.autotune = None, False
        log.info("integer kernels: %d layers and the LM head on GGUF blocks (%.0f MB)", len(quant),
                 (sum(q.nbytes for q in quant) + self.lm_head.qlin.nbytes) / 1e6)
        return True

    def _attach_blocks(self, path: str) -> None:
        """Give each layer linear the GGUF file's blocks of its weights, where they rebuild them."""
        from forerun.backends.block_weights import block_rows_kernel, from_gguf
        from forerun.gguf_file import GGUFFile

        if block_rows_kernel() is None or f32_rows_kernel() is None:
            return
        try:
            g = GGUFFile.open(path)
        except (OSError, ValueError) as e:
            log.info("no GGUF blocks (%s): layers run on float32 weights", e)
            return
        done = total = 0
        blocks = floats = 0
        for i, layer in enumerate(self.layers):
            for attr, parts in self._GGUF_PARTS.items():
                lin = getattr(layer, attr)
                total += 1
                lin.blocks = from_gguf(g, [f"blk.{i}.{p}.weight" for p in parts], lin.weight)
                if lin.blocks is not None:
                    done += 1
                    blocks += lin.blocks.nbytes
                    floats += lin.weight.numel() * 4
        head = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
        self.lm_head.blocks = from_gguf(g, [head], self.lm_head.weight)
        log.info("%d of %d layer products and %s LM head read GGUF blocks (%.0f MB instead of %.0f MB of float32)",
                 done, total, "the" if self.lm_head.blocks is not None else "not the", blocks / 1e6, floats / 1e6)

    @property
    def embed(self) -> torch.Tensor:
        """The token embeddings [vocab, hidden] (drafters and training read them whole; a model
        read from its GGUF file builds them here, once, on first use)."""
        box = self._embed
        if box["t"].is_meta:
            log.info("reading the token embeddings whole (%s)", self._files.embed_name)
            box["t"] = self._files.full(self._files.embed_name)
        return box["t"]

    def _embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        t = self._embed["t"]
        if t.is_meta:
            return self._files.embed_rows(tokens).to(self.dtype)
        return F.embedding(tokens, t)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps, self.arch.gemma_norms)

    # -- cache -----------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self._len

    @property
    def kv_dtype(self) -> torch.dtype:
        """The cache's type: float16 on the integer path (its kernels widen each value exactly), else
        the model's."""
        return torch.float16 if self.quant is not None else self.dtype

    def _ensure_capacity(self, n: int) -> None:
        if n <= self._cap:
            return
        cap = max(256, self._cap)
        while cap < n:
            cap *= 2
        cap = min(cap, self.max_context)
        if self._fixed is not None:  # whole at once (its strides never change), and a spare slot for padding rows
            cap = self.max_context + 1
        shape = (self.num_layers, self.n_kv_heads, cap, self.head_dim)
        k = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        if self.k_cache is not None:
            k[:, :, : self._cap] = self.k_cache
            v[:, :, : self._cap] = self.v_cache
        self.k_cache, self.v_cache, self._cap = k, v, cap

    def reserve(self, n: int) -> None:
        """Allocate the cache for ``n`` positions now (a server slot: memory stays flat afterwards)."""
        self._ensure_capacity(min(n, self.max_context))

    def truncate(self, length: int) -> None:
        # Static cache: positions past `length` are overwritten by the next forward.
        self._len = min(self._len, max(0, length))

    def reset(self) -> None:
        self._len = 0

    def kv_segment(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the cached keys and values of positions start..end-1 (see ``load_kv_segment``)."""
        if not 0 <= start <= end <= self._len:
            raise ValueError(f"kv_segment({start}, {end}) but {self._len} positions are cached")
        return self.k_cache[:, :, start:end].clone(), self.v_cache[:, :, start:end].clone()

    def load_kv_segment(self, pos: int, segment: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Put a ``kv_segment`` back at positions pos..: the cache then holds exactly what the
        forward pass that made it left there (a prompt's prefix shared by an earlier request)."""
        k, v = segment
        n = k.shape[2]
        if pos > self._len or pos + n > self.max_context:
            raise ValueError(f"load_kv_segment at {pos} of {n} positions with {self._len} cached")
        self._ensure_capacity(pos + n)
        self.k_cache[:, :, pos: pos + n] = k
        self.v_cache[:, :, pos: pos + n] = v
        self._len = pos + n

    def fork(self) -> "NativeBackend":
        self.exact_head()  # decided once, so that every twin takes greedy tokens the same way
        return self._twin()

    def _twin(self) -> "NativeBackend":
        twin = object.__new__(NativeBackend)
        twin.__dict__.update(self.__dict__)
        twin._cap, twin._len, twin.k_cache, twin.v_cache = 0, 0, None, None
        return twin

    @property
    def body_kernel(self) -> str:
        """How the layers' linear products run for passes of up to ``INVARIANT_ROWS`` rows:
        ``onednn`` (prepacked weights) or ``rows`` (``f32_rows.c``: each weight row read once for
        all rows of the pass; a row's sums do not depend on the other rows). ``rows`` wherever it
        builds when the backend is to be batch-invariant (the default), else chosen on first use
        by timing whole body passes of 1 and 5 rows both ways (timed alone, a small layer's weights
        sit in cache and mislead the choice); longer passes (prompts) stay on oneDNN."""
        if self.quant is not None:
            return "int8"
        if self._body_choice["kernel"] is None:
            self._body_choice["kernel"] = "onednn"  # meanwhile, and wherever ``rows`` cannot run
            if (self._pack and self.device.type == "cpu" and self.dtype == torch.float32
                    and f32_rows_kernel() is not None):
                self._body_choice["kernel"] = "rows" if self._want_invariant else self._time_body_kernels()
        return self._body_choice["kernel"]

    @property
    def batch_invariant(self) -> bool:
        """Whether every row of a pass of up to ``INVARIANT_ROWS`` rows (a chain, a token tree) is
        computed bit for bit as a one-token step at that position computes it: the layers' products
        by ``rows`` (each row's sums alone) and attention row by row over exactly the keys that row
        sees, in cache order. With the screened exact head deciding each row from its hidden state,
        greedy verification then cannot differ from plain decoding, not even on near ties. On by
        default on the CPU where ``f32_rows.c`` builds (float32); ``batch_invariant=False`` lets the
        body take whichever kernel times faster and attention take all rows at once."""
        if self._fixed is not None:
            return True  # fixed shapes (``fixed_rows``)
        return self.body_kernel in ("rows", "int8") and self._want_invariant

    def _time_body_kernels(self) -> str:
        from forerun.timing import median_s

        twin = self._twin()
        ids = torch.randint(0, min(self.vocab_size, 20000), (70,), generator=torch.Generator().manual_seed(0), device="cpu")
        twin.forward(ids[:64], 0, logits=False)
        times = {}
        for how in ("onednn", "rows"):
            self._body_choice["kernel"] = how

            def passes():
                for n in (1, 5):
                    twin.truncate(64)
                    twin.forward(ids[64: 64 + n], 64, logits=False)

            times[how] = median_s(passes, 3)
        best = min(times, key=times.get)
        log.info("body kernel: %s (passes of 1 and 5 rows: oneDNN %.1f ms, rows %.1f ms)",
                 best, times["onednn"] * 1000, times["rows"] * 1000)
        return best

    def sub_head(self, rows: torch.Tensor) -> PackedLinear:
        """An LM head over the vocabulary rows ``rows`` only (logits come back in that order)."""
        return PackedLinear(self.lm_head.weight[rows.to(self.device)].contiguous(), self._pack)

    # -- forward ---------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor, start: int | None = None):
        """Rotary cos and sin [T, head_dim] per attention type for ``positions`` (``start``: they
        are start, start + 1, ..., read as a slice). The integer path reads them from tables kept
        for every cached position (``_rope_table``); the float path computes them as transformers does."""
        if self.quant is not None:
            tab = self._rope_table(int(positions.max()) + 1 if positions.numel() else 0)
            if start is not None:
                end = start + positions.numel()
                return {t: (c[start:end], s[start:end]) for t, (c, s) in tab.items()}
            return {t: (c[positions], s[positions]) for t, (c, s) in tab.items()}
        out = {}
        for t, inv in self._inv_freq.items():
            freqs = positions[:, None].float() * inv[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            s = self._rope_scale[t]
            out[t] = ((emb.cos() * s).to(self.dtype), (emb.sin() * s).to(self.dtype))
        return out

    def _rope_table(self, n: int) -> dict:
        """cos and sin [>= n, head_dim] (float32) per attention type for positions 0.., shared with
        forks, grown by doubling: every row of every pass reads the same values for its position
        (one-token steps and verify passes alike). The angle is the float32 product transformers
        forms (position x inverse frequency); its cos and sin are taken in float64, then rounded."""
        tab = self._rope_tabs
        have = next(iter(tab.values()))[0].shape[0] if tab else 0
        if n > have:
            size = max(256, 2 * have, n)
            pos = torch.arange(size, dtype=torch.float32, device="cpu")  # the table is made on the CPU (float64)
            for t, inv in self._inv_freq.items():
                freqs = (pos[:, None] * inv.cpu()[None, :]).double()
                emb = torch.cat((freqs, freqs), dim=-1)
                sc = self._rope_scale[t]
                tab[t] = ((emb.cos() * sc).float().contiguous(), (emb.sin() * sc).float().contiguous())
        return tab

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        pos: int,
        *,
        skip_layers: Sequence[int] = (),
        return_hidden: bool = False,
        last_only: bool = False,
        head: "PackedLinear | None" = None,
        layers: Sequence[int] = (),
        logits: bool = True,
        tree: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """``head`` replaces the LM head (e.g. a drafter's reduced vocabulary, see ``sub_head``).
        ``layers``: return these layers' outputs (residual stream) at every position;
        ``logits=False`` skips the LM head (feature extraction). ``tree``: parents [T - 1] of rows
        1.. (see ``forerun.tree``): rows sit at pos + depth and see only their ancestors."""
        self._check_forward(tokens, pos)
        T = tokens.numel()
        end = pos + T
        self._ensure_capacity(end)
        tokens = tokens.to(self.device)
        if self._fixed is not None and T <= MAX_ROWS and not skip_layers and head is None:
            h, lg, feats = self._fixed.forward(self, tokens, pos, tree, layers, logits)
            self._len = end
            if last_only:
                h, lg = h[-1:], None if lg is None else lg[-1:]
            return ForwardOutput(logits=lg, hidden=h if return_hidden else None, layers=feats)
        if tree is None:
            positions = torch.arange(pos, end, device=self.device)
            masks = self._masks(pos, T)
            rope = self._rope(positions, pos)
        else:
            positions, masks = self._tree_masks(pos, tree)
            rope = self._rope(positions)
        h = self._embeddings(tokens) * self.embed_scale  # [T, hidden]
        h, feats = self._body(h, [(self, pos, T, rope, masks)], set(skip_layers), layers)
        self._len = end
        if not logits and not return_hidden:
            return ForwardOutput(logits=None, layers=feats)
        h = self._norm(h[-1:] if last_only else h, self.final_norm)
        return ForwardOutput(logits=self._logits(h, head) if logits else None, hidden=h if return_hidden else None,
                             layers=feats)

    # -- exact greedy targets --------------------------------------------------------------
    def exact_head(self, h: torch.Tensor | None = None):
        """The screened exact argmax head (``greedy_head.ExactFloatArgmax``), built on first use;
        None on GPUs, without a C compiler, with ``exact_greedy`` off, or where it lost the timing
        (then greedy takes the argmax of float32 logits). With ``exact_greedy="auto"`` (the
        default) the first call times both on one row of ``h`` (final normed hidden states; a
        random row when None) and keeps the faster for the model's lifetime, so every pass size,
        method and forked twin decides greedy tokens the same way."""
        if self._exact is None and self.quant is not None:
            self._exact = False  # integer logits: each row's own, so their argmax is batch-invariant already
        if self._exact is None:
            head = None
            if self.exact_greedy and self.device.type == "cpu" and self.hidden_size % 32 == 0:
                from forerun.backends.greedy_head import ExactFloatArgmax

                head = ExactFloatArgmax(self.lm_head.weight, threads=torch.get_num_threads(), float_logits=self.lm_head)
                if not head.available:
                    head = None
            if head is not None and self.exact_greedy == "auto":
                head = head if self._exact_is_faster(head, h) else None
            self._exact = head if head is not None else False
        return self._exact or None

    @property
    def greedy_head(self) -> str:
        """What decides greedy tokens: ``integer`` on the integer path (the argmax of its logits),
        ``exact-q8-screened`` once the exact head is in use, else ``float32``."""
        if self.quant is not None:
            return "integer"
        return "exact-q8-screened" if self._exact else "float32"

    def _exact_is_faster(self, head, h: torch.Tensor | None) -> bool:
        from forerun.timing import median_s

        if h is None:
            g = torch.Generator().manual_seed(0)
            h = self._norm(torch.randn(1, self.hidden_size, generator=g, device="cpu").to(self.device, self.dtype), self.final_norm)
        row = h[-1:].float().cpu()
        exact_s = median_s(lambda: head.argmax(row), 3)
        float_s = median_s(lambda: self._logits(row.to(self.device, self.dtype)).argmax(-1), 3)
        log.info("greedy head: %s (one row: screened exact %.1f ms, float32 logits %.1f ms)",
                 "screened exact" if exact_s < float_s else "float32 logits", exact_s * 1000, float_s * 1000)
        return exact_s < float_s

    def argmax_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """Greedy tokens [n] of final normed hidden states h [n, hidden], each decided from its
        own row: the screened exact head where it is in use, on the integer path the argmax of its
        logits found inside the kernel (no logits formed; tanh soft-capped heads, where capping can
        make near logits equal, take the logits), else the argmax of float32 logits."""
        fn = self._argmax_without_logits(h)
        return self._logits(h).argmax(-1) if fn is None else fn(h)

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
        262,144-row head, while a GPU does all rows of a pass in about the time of one."""
        return self.device.type == "cpu"

    @torch.inference_mode()
    def argmax_forward(self, tokens: torch.Tensor, pos: int, layers: Sequence[int] = (),
                       tree: torch.Tensor | None = None) -> ArgmaxOutput:
        """Greedy targets of a verify pass: the argmax [T] at every row (of a chain or a ``tree``),
        decided from each row's own hidden state alone, and the outputs of ``layers``."""
        tree_kw = {} if tree is None else {"tree": tree}
        if self._fixed is not None and tokens.numel() <= MAX_ROWS:  # each row's logits from its own fixed-shape pass
            passed = self.forward(tokens, pos, layers=layers, **tree_kw)
            return ArgmaxOutput(passed.logits.argmax(-1), passed.layers if layers else None)
        passed = self.forward(tokens, pos, layers=layers, logits=False, return_hidden=True, **tree_kw)
        return ArgmaxOutput(self.argmax_hidden(passed.hidden), passed.layers if layers else None)

    def _logits(self, h: torch.Tensor, head: "PackedLinear | None" = None) -> torch.Tensor:
        """Float32 logits of normed hidden states h [rows, hidden] (soft-capped where the model caps)."""
        out = (head or self.lm_head)(h).float()
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def _body(self, h, parts, skip, layers):
        """The transformer layers over the rows ``h`` [rows, hidden] of one or more sequences.

        ``parts``: per sequence (backend holding its cache, pos, T, rope, masks), in row order.
        Linear layers run on every row at once; attention runs per sequence on its own cache.
        Returns the last hidden states and the asked-for layers' outputs (or None)."""
        if self.quant is not None:
            return self._qbody(h, parts, skip, layers)
        want = {l: None for l in layers}
        how = self.body_kernel
        if len(parts) > 1 and self.batch_invariant:
            how = ROWS_ANY
        # rotary tables of every row of the pass, per attention type: rows rotate all at once
        # (elementwise, so each row's values do not depend on the others)
        ropes = {kind: tuple(torch.cat(t) if len(parts) > 1 else t[0] for t in zip(*(p[3][kind] for p in parts)))
                 for kind in parts[0][3]}
        D, n_all = self.head_dim, h.shape[0]
        # several sequences, every row batch-invariant: one attention call per layer for all of them
        joined = None
        if (len(parts) > 1 and not self.arch.attn_softcap and self.dtype == torch.float32 and self.device.type == "cpu"
                and attn_rows_kernel() is not None and all(len(p[4][sl]) > 2 for p in parts for sl in p[4])):
            joined = {sl: SequenceRows([p[0] for p in parts], [p[4][sl][2] for p in parts], [p[1] for p in parts])
                      for sl in parts[0][4]}
        for i, layer in enumerate(self.layers):
            if i in skip:
                continue
            x = self._norm(h, layer.norms[0])
            qkv = _add(layer.qkv(x, how), layer.qkv_bias)
            q = qkv[:, : layer.n_q].view(n_all, self.n_heads, D)
            k = qkv[:, layer.n_q : layer.n_q + layer.n_kv].view(n_all, self.n_kv_heads, D)
            v = qkv[:, layer.n_q + layer.n_kv :].view(n_all, self.n_kv_heads, D)
            if layer.q_norm is not None:
                q = self._norm(q, layer.q_norm)
                k = self._norm(k, layer.k_norm)
            kind = "sliding_attention" if layer.sliding else "full_attention"
            cos, sin = ropes[kind] if kind in ropes else next(iter(ropes.values()))
            c, s = cos[:, None, :], sin[:, None, :]
            q = q * c + _rotate_half(q) * s
            k = k * c + _rotate_half(k) * s
            if joined is None:
                outs, r = [], 0
                for seq, pos, T, _, masks in parts:
                    outs.append(seq._attention(layer, i, q[r: r + T], k[r: r + T], v[r: r + T], pos, masks[layer.sliding]))
                    r += T
            else:
                rows = joined[layer.sliding]
                rows.store(k, v, i)
                outs = [rows.attend(q, i, self.scale)]
            x = _add(layer.o(outs[0] if len(outs) == 1 else torch.cat(outs), how), layer.o_bias)
            if self.arch.sandwich:  # Gemma 2/3: normed outputs, then a norm before the MLP
                h = h + self._norm(x, layer.norms[1])
                x = self._norm(h, layer.norms[2])
            else:
                h = h + x
                x = self._norm(h, layer.norms[1])
            gu = _add(layer.gate_up(x, how), layer.gate_up_bias)
            x = _add(layer.down(layer.act(gu[:, : layer.inter]) * gu[:, layer.inter :], how), layer.down_bias)
            h = h + (self._norm(x, layer.norms[3]) if self.arch.sandwich else x)
            if i in want:
                want[i] = h
        return h, (torch.cat([want[l] for l in layers], -1) if layers else None)

    def _qbody(self, h, parts, skip, layers):
        """``_body`` on the integer path: one ``forerun_q_layers`` call for every layer and every row of
        every sequence (norms, products, rotary embeddings, the cache writes and attention in C)."""
        from forerun.backends.qweights import KIND, QPassC, qrows_lib

        lib = qrows_lib()
        lib.forerun_q_threads(torch.get_num_threads())
        kinds = {KIND[kind]: tuple(torch.cat(t) if len(parts) > 1 else t[0] for t in zip(*(p[3][kind] for p in parts)))
                 for kind in parts[0][3]}
        ps = QPassC()
        ps.N, ps.hidden, ps.H, ps.KVH, ps.D = h.shape[0], self.hidden_size, self.n_heads, self.n_kv_heads, self.head_dim
        ps.eps, ps.scale, ps.softcap = self.eps, self.scale, self.arch.attn_softcap or 0.0
        rows = {sl: SequenceRows([p[0] for p in parts], [p[4][sl][2] for p in parts], [p[1] for p in parts])
                for sl in (False, True)}
        keep = []  # tensors the pass reads through pointers, alive until the layers have run
        for k in (0, 1):
            cos, sin = kinds.get(k) or next(iter(kinds.values()))
            cos, sin = cos.float().contiguous(), sin.float().contiguous()
            r = rows[bool(k)]
            keep += [cos, sin]
            ps.cos[k], ps.sin[k] = cos.data_ptr(), sin.data_ptr()
            ps.lo[k], ps.hi[k], ps.xp[k], ps.extra[k] = (r.lo.data_ptr(), r.hi.data_ptr(), r.xp.data_ptr(),
                                                         r.extra.data_ptr())
        r = rows[False]
        ps.kbase, ps.vbase, ps.cap, ps.slot = r.k_base.data_ptr(), r.v_base.data_ptr(), r.caps.data_ptr(), r.pos.data_ptr()
        kinds_kv = {p[0].k_cache.dtype for p in parts}
        if len(kinds_kv) != 1:  # one flag tells the kernels how every sequence's cache is stored
            raise ValueError(f"a batched pass over caches of different types: {sorted(map(str, kinds_kv))}")
        ps.kv_f16 = int(kinds_kv.pop() == torch.float16)
        h = h.to(torch.float32).contiguous().clone()
        n = len(self.quant)
        want = {l: torch.empty_like(h) for l in layers}
        keep_at = (ctypes.c_void_p * n)(*[want[i].data_ptr() if i in want else None for i in range(n)]) if want else None
        skips = (ctypes.c_uint8 * n)(*[i in skip for i in range(n)]) if skip else None
        if lib.forerun_q_layers(self._qlayers, n, skips, keep_at, ctypes.byref(ps), h.data_ptr()) != 0:
            raise MemoryError("qrows: out of memory in a layer")
        return h, (torch.cat([want[l] for l in layers], -1) if layers else None)

    @torch.inference_mode()
    def forward_batch(self, seqs: Sequence["NativeBackend"], feeds: Sequence[torch.Tensor],
                      positions: Sequence[int], layers: Sequence[int] = (),
                      greedy: Sequence[bool] = (), trees: Sequence[torch.Tensor | None] = ()) -> list:
        """One pass over several sequences: ``feeds[i]`` runs at ``positions[i]`` on ``seqs[i]``'s
        cache (forks of this backend); where ``trees[i]`` is given, its rows 1.. are a token tree
        with those parents (as ``forward(tree=)``). Returns each sequence's logits [T_i, vocab]
        (float32) and, with ``layers``, those layers' outputs; a sequence marked in ``greedy`` gets
        the exact argmax of every row instead of logits (``ArgmaxOutput``), where it is found without logits
        (``argmax_hidden``: the integer path or the screened exact head)."""
        if self._fixed is not None and all(f.numel() <= MAX_ROWS for f in feeds):
            # fixed-shape chunks over every sequence's rows: a row's result cannot depend on the batch
            for i, (seq, feed, pos) in enumerate(zip(seqs, feeds, positions)):
                seq._check_forward(feed, pos)
                seq._ensure_capacity(pos + feed.numel())
                tree = trees[i] if i < len(trees) else None
                if tree is not None and tree.numel() != feed.numel() - 1:
                    raise ValueError(f"a tree of {tree.numel()} parents for a feed of {feed.numel()} rows")
            outs = self._fixed.forward_batch(self, seqs, feeds, positions, trees, layers, True)
            for seq, feed, pos in zip(seqs, feeds, positions):
                seq._len = pos + feed.numel()
            return [ForwardOutput(logits=lg, layers=ft) for _, lg, ft in outs]
        parts, ids = [], []
        for i, (seq, feed, pos) in enumerate(zip(seqs, feeds, positions)):
            seq._check_forward(feed, pos)
            T = feed.numel()
            seq._ensure_capacity(pos + T)
            tree = trees[i] if i < len(trees) else None
            if tree is None:
                rope, masks = self._rope(torch.arange(pos, pos + T, device=self.device), pos), seq._masks(pos, T)
            else:
                if tree.numel() != T - 1:
                    raise ValueError(f"a tree of {tree.numel()} parents for a feed of {T} rows")
                qpos, masks = seq._tree_masks(pos, tree)
                rope = self._rope(qpos)
            parts.append((seq, pos, T, rope, masks))
            ids.append(feed.to(self.device))
        h = self._embeddings(torch.cat(ids)) * self.embed_scale  # [rows, hidden]
        h, feats = self._body(h, parts, set(), layers)
        for seq, pos, T, _, _ in parts:
            seq._len = pos + T
        sizes = [p[2] for p in parts]
        hn = self._norm(h, self.final_norm).split(sizes)
        per_seq = feats.split(sizes) if feats is not None else [None] * len(parts)
        argmax = self._argmax_without_logits() if any(greedy) else None
        flags = [argmax is not None and i < len(greedy) and bool(greedy[i]) for i in range(len(parts))]

        def run(fn, chosen):  # one pass of fn over the chosen sequences' rows, split back per sequence
            rows = [x for x, f in zip(hn, flags) if f == chosen]
            return iter(fn(torch.cat(rows)).split([len(x) for x in rows]) if rows else [])

        lg, am = run(self._logits, False), run(argmax, True)
        return [ArgmaxOutput(next(am), f) if g else ForwardOutput(logits=next(lg), layers=f)
                for g, f in zip(flags, per_seq)]

    def _masks(self, pos: int, T: int):
        """Boolean masks [T, S] (True = attend) with the first key index, for full and sliding layers."""
        end = pos + T
        if self.quant is not None:  # the integer path reads each row's keys only
            start = max(0, pos - self.window + 1) if self.window else 0
            return {False: (0, None, RowKeys.chain(pos, T, None)), True: (start, None, RowKeys.chain(pos, T, self.window))}
        q = torch.arange(pos, end, device=self.device)[:, None]
        full_k = torch.arange(0, end, device=self.device)[None, :]
        full = None if T == 1 else (full_k <= q)
        start = max(0, pos - self.window + 1) if self.window else 0
        k = torch.arange(start, end, device=self.device)[None, :]
        sliding = (k <= q) & (k > q - self.window) if self.window else (k <= q)
        if T == 1 and bool(sliding.all()):
            sliding = None
        if (T <= INVARIANT_ROWS or self.quant is not None) and self.batch_invariant:  # each row: exactly the keys a one-token step sees
            return {False: (0, full, RowKeys.chain(pos, T, None)), True: (start, sliding, RowKeys.chain(pos, T, self.window))}
        return {False: (0, full), True: (start, sliding)}

    def _tree_masks(self, pos: int, parents: torch.Tensor):
        """Positions [T] and masks like ``_masks`` for a tree pass (keys: the prefix, then the rows)."""
        from forerun.tree import tree_layout

        depth, anc = tree_layout(parents)
        T = depth.numel()
        dev = self.device
        qpos = (pos + depth).to(dev)
        kpos = torch.cat([torch.arange(pos, device=dev), qpos])
        seen = torch.cat([torch.ones(T, pos, dtype=torch.bool, device=dev), anc.to(dev)], 1)  # [T, pos + T]
        start = max(0, pos - self.window + 1) if self.window else 0
        sliding = seen
        if self.window:
            sliding = seen & (kpos[None, :] > qpos[:, None] - self.window)
        if (T <= INVARIANT_ROWS or self.quant is not None) and self.batch_invariant:  # the prefix, then the row's ancestors and itself
            rows = [r.nonzero().view(-1).tolist() for r in anc]  # each row's ancestors and itself, in row order
            dep = depth.tolist()
            w = self.window
            extras = [[pos + j for j in a] for a in rows]
            return qpos, {False: (0, seen, RowKeys([0] * T, [pos] * T, extras)),
                          True: (start, sliding[:, start:], RowKeys(
                              [min(pos, max(0, pos + dep[i] - w + 1)) if w else 0 for i in range(T)], [pos] * T,
                              [[pos + j for j in a if not w or dep[j] > dep[i] - w] for i, a in enumerate(rows)]))}
        return qpos, {False: (0, seen), True: (start, sliding[:, start:])}

    @torch.inference_mode()
    def keep_rows(self, pos: int, rows: Sequence[int]) -> None:
        """After a tree pass at ``pos``: move the kept rows (1-based, in path order) to the slots
        right after the root's, so the cache holds the accepted path only."""
        if rows:
            src = torch.tensor([pos + r for r in rows], device=self.device)
            n = len(rows)
            self.k_cache[:, :, pos + 1 : pos + 1 + n] = self.k_cache[:, :, src]
            self.v_cache[:, :, pos + 1 : pos + 1 + n] = self.v_cache[:, :, src]
        self._len = min(self._len, pos + 1 + len(rows))

    def _store(self, idx: int, k: torch.Tensor, v: torch.Tensor, pos: int) -> None:
        """Keys and values k, v [T, kv_heads, D] of positions pos.. into layer ``idx`` of the cache."""
        self.k_cache[idx, :, pos: pos + k.shape[0]] = k.transpose(0, 1)
        self.v_cache[idx, :, pos: pos + k.shape[0]] = v.transpose(0, 1)

    def _attention(self, layer: _Layer, idx: int, q, k, v, pos, mask_info):
        """Attention of rows q [T, heads, D] at pos.. over this backend's cache, after their keys
        and values k, v [T, kv_heads, D] (normed and rotated) join it; [T, heads * D], before the
        output projection."""
        T, D = q.shape[0], self.head_dim
        end = pos + T
        self._store(idx, k, v, pos)
        start, mask = mask_info[:2]
        if self.arch.attn_softcap:
            return self._capped_attention(q, idx, start, end, mask_info)
        if len(mask_info) > 2:  # batch-invariant: every row as a one-token step over its own keys
            return attention_rows(q, self.k_cache[idx], self.v_cache[idx], mask_info[2], self.scale)
        keys = self.k_cache[idx, :, start:end]  # [kv_heads, S, D]
        vals = self.v_cache[idx, :, start:end]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys[None],
            vals[None],
            attn_mask=None if mask is None else mask[None, None],
            scale=self.scale,
            enable_gqa=self.n_heads != self.n_kv_heads,
        )  # [1, heads, T, D]
        return out[0].transpose(0, 1).reshape(T, self.n_heads * D)

    def _capped_attention(self, q, idx, start, end, mask_info):
        """Attention with Gemma 2's soft cap on the scores (cap * tanh(s / cap)), which the fused
        kernels lack: q [T, heads, D] -> [T, heads * D]. Batch-invariant passes take each row alone
        over its own keys (as a one-token step does)."""
        T, H, D = q.shape
        cap, group = self.arch.attn_softcap, self.n_heads // self.n_kv_heads
        k_all, v_all = self.k_cache[idx], self.v_cache[idx]

        def attend(qr, kk, vv, mask=None):  # qr [H, t, D], kk/vv [kv_heads, S, D]
            kk, vv = kk.repeat_interleave(group, 0), vv.repeat_interleave(group, 0)
            scores = torch.tanh((qr @ kk.transpose(1, 2)).float() * self.scale / cap) * cap
            if mask is not None:
                scores = scores.masked_fill(~mask[None], float("-inf"))
            return (scores.softmax(-1).to(vv.dtype) @ vv).transpose(0, 1)  # [t, H, D]

        qt = q.transpose(0, 1)
        if len(mask_info) > 2:
            keys = mask_info[2]
            outs = [attend(qt[:, t: t + 1], *keys.keys_values(t, k_all, v_all)) for t in range(T)]
            return torch.cat(outs).reshape(T, H * D)
        mask = mask_info[1]
        if mask is None:
            mask = torch.ones(T, end - start, dtype=torch.bool, device=q.device)
        return attend(qt, k_all[:, start:end], v_all[:, start:end], mask).reshape(T, H * D)
