"""Our own forward pass for Llama, Mistral, Qwen2/3 and Gemma 1/2/3 text models, with a static
per-position KV cache.

Why not the transformers module: we need positions we choose, a cache rolled back by
bookkeeping, layer skipping for self-speculation, hidden states, and the least possible
per-step overhead. The weights are the transformers model's own tensors (no copy),
except that linear layers are prepacked for oneDNN on CPU (``backends/linear.py``); the architecture
and its layers in ``backends/arch.py``, attention that is every row's own in ``backends/attention.py``,
fixed-shape passes for GPUs in ``backends/fixed_rows.py``.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Sequence

import torch
import torch.nn.functional as F

from forerun.backends.base import ArgmaxOutput, BackendBase, Capabilities, ForwardOutput
from forerun.backends.arch import Arch, Layer, add_bias, norm_weight, rms_norm, rotate_half
from forerun.backends.attention import RowKeys, SequenceRows, attention_rows, attn_rows_kernel
from forerun.backends.fixed_rows import FIXED_DEFAULT_CONTEXT, MAX_ROWS, FixedRows
from forerun.backends.linear import INVARIANT_ROWS, ROWS_ANY, PackedLinear, f32_rows_kernel
from forerun.timing import median_s

log = logging.getLogger("forerun")


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
        self.final_norm = norm_weight(inner.norm) if arch.gemma_norms else inner.norm.weight.detach()
        head_source = None
        if file_tensors is not None:
            head_source = ((lambda: self.embed) if file_tensors.head_name is None
                           else (lambda: file_tensors.full(file_tensors.head_name)))
        self.lm_head = PackedLinear(hf_model.lm_head.weight.detach(), pack_linear, autotune=True, source=head_source)
        self.softcap = arch.final_softcap
        self.layers = [Layer(layer, arch.layer_types[i], pack_linear, arch) for i, layer in enumerate(inner.layers)]
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

    # GGUF layer names of each Layer linear, in the order its weight stacks them
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
            qkv = add_bias(layer.qkv(x, how), layer.qkv_bias)
            q = qkv[:, : layer.n_q].view(n_all, self.n_heads, D)
            k = qkv[:, layer.n_q : layer.n_q + layer.n_kv].view(n_all, self.n_kv_heads, D)
            v = qkv[:, layer.n_q + layer.n_kv :].view(n_all, self.n_kv_heads, D)
            if layer.q_norm is not None:
                q = self._norm(q, layer.q_norm)
                k = self._norm(k, layer.k_norm)
            kind = "sliding_attention" if layer.sliding else "full_attention"
            cos, sin = ropes[kind] if kind in ropes else next(iter(ropes.values()))
            c, s = cos[:, None, :], sin[:, None, :]
            q = q * c + rotate_half(q) * s
            k = k * c + rotate_half(k) * s
            if joined is None:
                outs, r = [], 0
                for seq, pos, T, _, masks in parts:
                    outs.append(seq._attention(layer, i, q[r: r + T], k[r: r + T], v[r: r + T], pos, masks[layer.sliding]))
                    r += T
            else:
                rows = joined[layer.sliding]
                rows.store(k, v, i)
                outs = [rows.attend(q, i, self.scale)]
            x = add_bias(layer.o(outs[0] if len(outs) == 1 else torch.cat(outs), how), layer.o_bias)
            if self.arch.sandwich:  # Gemma 2/3: normed outputs, then a norm before the MLP
                h = h + self._norm(x, layer.norms[1])
                x = self._norm(h, layer.norms[2])
            else:
                h = h + x
                x = self._norm(h, layer.norms[1])
            gu = add_bias(layer.gate_up(x, how), layer.gate_up_bias)
            x = add_bias(layer.down(layer.act(gu[:, : layer.inter]) * gu[:, layer.inter :], how), layer.down_bias)
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

    def _attention(self, layer: Layer, idx: int, q, k, v, pos, mask_info):
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
