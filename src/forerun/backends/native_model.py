"""The native model: what every sequence over one set of weights shares. Weights, architecture,
layers, LM head, the kernels chosen for them, the greedy-token rule, the rotary tables, and the
passes over the rows of one or more sequences (each with its own ``KVCache``).

Why not the transformers module: we need positions we choose, a cache rolled back by
bookkeeping, layer skipping for self-speculation, hidden states, and the least possible per-step
overhead. The weights are the transformers model's own tensors (no copy), except that linear
layers are prepacked for oneDNN on CPU. A ``NativeBackend`` is one sequence over a model."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from forerun.backends.arch import Arch, Layer, norm_weight, rms_norm
from forerun.backends.fixed_rows import FIXED_DEFAULT_CONTEXT, FixedRows, fixed_chunks, fixed_takes
from forerun.backends.gguf_weights import (
    attach_blocks,
    attach_gguf_integer,
    requantize_4bit,
    tune_byte_codes,
    tune_prefetch,
    tune_wide_tiles,
)
from forerun.backends.greedy_targets import GreedyTargets
from forerun.backends.kv_cache import KVCache
from forerun.backends.linear import ROWS_ANY, PackedLinear, f32_rows_kernel, time_body_kernels
from forerun.backends.runners import Rows, float_rows, integer_rows

log = logging.getLogger("forerun")


class NativeModel:
    """One model's weights and choices for the native forward (Llama, Mistral, Qwen2/3, Gemma 1/2/3)."""

    def __init__(self, hf_model, *, max_context: int | None = None, pack_linear: bool = True,
                 exact_greedy: bool | str = "auto", batch_invariant: bool = True, gguf: str | None = None,
                 integer: bool = True, file_tensors=None, fixed_rows: bool | None = None, requantize: bool = False):
        """``gguf``: the GGUF file the weights were dequantized from. With ``integer`` (the default)
        every layer then runs in ``qrows.c`` on the file's blocks with 8-bit activations, one native
        call per pass (see ``qweights``), where every linear weight is of a handled type and the
        kernels build; otherwise the blocks serve the layers' small passes in float32, bit for bit
        as the dequantized weights (see ``block_weights``). A model built by ``gguf_model.skeleton``
        (weights on the meta device, ``file_tensors`` from it) runs on the integer path or not at
        all (ValueError); its token embeddings and LM head are read from the file when used.
        ``fixed_rows``: passes of up to ``fixed_rows.MAX_ROWS`` rows run in fixed shapes (see
        ``fixed_rows``; lossless in any dtype): None (the default) everywhere but the CPU's float32
        path, which is batch-invariant by its own kernels. ``requantize``: on the integer path, the
        layer weights re-coded to 4 bits (``gguf_weights.requantize_4bit``: a draft model's) before
        the kernels are timed."""
        cfg = hf_model.config
        arch = Arch.of(cfg)
        self.arch = arch
        inner = hf_model.model
        self.config = cfg
        self.hf_model = hf_model
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
        self.files = file_tensors
        # the token embeddings: on the meta device until ``embed`` is first asked for where the
        # file holds them (steps read their rows alone)
        self._embed = inner.embed_tokens.weight.detach()
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5 if arch.gemma_norms else 1.0, dtype=self.dtype, device=self.device)
        self.final_norm = norm_weight(inner.norm) if arch.gemma_norms else inner.norm.weight.detach()
        head_source = None
        if file_tensors is not None:
            head_source = ((lambda: self.embed) if file_tensors.head_name is None
                           else (lambda: file_tensors.full(file_tensors.head_name)))
        self.lm_head = PackedLinear(hf_model.lm_head.weight.detach(), pack_linear, autotune=True, source=head_source)
        self.softcap = arch.final_softcap
        self.layers = [Layer(layer, arch.layer_types[i], pack_linear, arch) for i, layer in enumerate(inner.layers)]
        self.pack = pack_linear
        self.want_invariant = batch_invariant
        self.greedy = GreedyTargets(self, exact_greedy)
        self._body_kernel = None  # chosen on first use (``body_kernel``)
        self.quant = None  # QLayer per layer: the integer path (``runners.integer_rows``)
        self.qlayers = None  # the same, as the C array one pass hands to the kernels
        self.head_file = None  # the GGUF file and tensor the integer path's LM head came from
        self.requantized = False  # ``gguf_weights.requantize_4bit`` has re-coded the layers
        self.fixed = None  # set below: fixed-shape passes (``fixed_rows``), or None
        # Rotary tables per attention type, from the transformers module (it knows every rope variant).
        rot = inner.rotary_emb
        self.inv_freq, self.rope_scale = {}, {}
        for t in set(arch.layer_types):
            per_type = hasattr(rot, f"{t}_inv_freq")  # Gemma 3: local and global layers rotate differently
            self.inv_freq[t] = getattr(rot, f"{t}_inv_freq" if per_type else "inv_freq").detach().float().to(self.device)
            self.rope_scale[t] = getattr(rot, f"{t}_attention_scaling" if per_type else "attention_scaling", 1.0)
        self.rope_tables = {}  # the integer path's rotary tables (see ``positions.rope_table``)
        lean = file_tensors is not None
        if gguf and pack_linear and self.device.type == "cpu" and self.dtype == torch.float32:
            if not (integer and attach_gguf_integer(self, gguf)):
                if lean:
                    raise ValueError("the integer kernels cannot run this GGUF file's layers")
                attach_blocks(self, gguf)
        elif lean:
            raise ValueError("a model without its linear weights runs on the integer path only")
        self.fixed = FixedRows(self) if fixed_rows and self.quant is None else None
        if self.quant is not None:
            if not (requantize and requantize_4bit(self)):  # which times the kernels on what it made
                tune_prefetch(self)  # measured once per model shape and machine, then kept
                tune_wide_tiles(self)  # the same, under the prefetch chosen
            tune_byte_codes(self)  # the same, for 6-bit weights read as bytes by passes of several rows

    # -- pieces -------------------------------------------------------------------------------
    @property
    def embed(self) -> torch.Tensor:
        """The token embeddings [vocab, hidden] (drafters and training read them whole; a model
        read from its GGUF file builds them here, once, on first use)."""
        if self._embed.is_meta:
            log.info("reading the token embeddings whole (%s)", self.files.embed_name)
            self._embed = self.files.full(self.files.embed_name)
        return self._embed

    @property
    def embed_in_file(self) -> bool:
        """Whether the token embeddings are still in the GGUF file (steps read their rows alone)."""
        return self._embed.is_meta

    def embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        if self._embed.is_meta:
            return self.files.embed_rows(tokens).to(self.dtype)
        return F.embedding(tokens, self._embed)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps, self.arch.gemma_norms)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The caches' type: float16 on the integer path (its kernels widen each value exactly),
        else the model's."""
        return torch.float16 if self.quant is not None else self.dtype

    @property
    def body_kernel(self) -> str:
        """How the layers' linear products run for passes of up to ``INVARIANT_ROWS`` rows:
        ``int8`` on the integer path; else ``onednn`` (prepacked weights) or ``rows``
        (``f32_rows.c``: each weight row read once for all rows of the pass; a row's sums do not
        depend on the other rows). ``rows`` wherever it builds when the model is to be
        batch-invariant (the default), else chosen on first use by timing whole body passes
        (``linear.time_body_kernels``); longer passes (prompts) stay on oneDNN."""
        if self.quant is not None:
            return "int8"
        if self._body_kernel is None:
            self._body_kernel = "onednn"  # meanwhile, and wherever ``rows`` cannot run
            if self.pack and self.device.type == "cpu" and self.dtype == torch.float32 and f32_rows_kernel() is not None:
                self._body_kernel = "rows" if self.want_invariant else time_body_kernels(self)
        return self._body_kernel

    @body_kernel.setter
    def body_kernel(self, how: str) -> None:
        self._body_kernel = how

    @property
    def batch_invariant(self) -> bool:
        """Whether every row of a pass of up to ``INVARIANT_ROWS`` rows (a chain, a token tree) is
        computed bit for bit as a one-token step at that position computes it: the layers' products
        by ``rows`` (each row's sums alone), attention row by row over exactly the keys that row
        sees, in cache order, and the LM head's logits by the same row kernel (``lm_logits``; also in
        a batched pass of any size), so sampled rows read the logits a one-token step gives them.
        With the screened exact head deciding each row from its hidden state,
        greedy verification then cannot differ from plain decoding, not even on near ties. On by
        default on the CPU where ``f32_rows.c`` builds (float32); ``batch_invariant=False`` lets the
        body take whichever kernel times faster and attention take all rows at once."""
        if self.fixed is not None:
            return True  # fixed shapes (``fixed_rows``)
        return self.body_kernel in ("rows", "int8") and self.want_invariant

    def lm_logits(self, h: torch.Tensor, head: PackedLinear | None = None, batched: bool = False) -> torch.Tensor:
        """Float32 logits of normed hidden states h [rows, hidden] (soft-capped where the model caps).
        On a batch-invariant model a row gets the same bits in a pass of any size, as in the body:
        passes of up to ``INVARIANT_ROWS`` rows, and every ``batched`` pass (several sequences'
        rows), take the row-by-row kernel rather than the one timed fastest for their row count."""
        how = (ROWS_ANY if batched else "rows") if self.batch_invariant else None
        out = (head or self.lm_head)(h, how).float()
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def sub_head(self, rows: torch.Tensor) -> PackedLinear:
        """An LM head over the vocabulary rows ``rows`` only (logits come back in that order)."""
        return PackedLinear(self.lm_head.weight[rows.to(self.device)].contiguous(), self.pack)

    def report(self) -> dict:
        out = {"threads": torch.get_num_threads(), "greedy_head": self.greedy.kind, "body_kernel": self.body_kernel,
               "batch_invariant": self.batch_invariant}
        if self.quant is not None:
            out["weights"] = "gguf blocks (integer kernels)"
        if self.fixed is not None:
            out["fixed_rows"] = True
            if not self.fixed.graphs_off:  # captured, replayed, and every failed capture (an error)
                out["cuda_graphs"] = self.fixed.stats()
        return out

    # -- passes -------------------------------------------------------------------------------
    def runner(self, rows: int, tree=None, skip: Sequence[int] = (), head=None):
        """The runner of a pass of ``rows`` rows (``tree``: a token tree's parents; ``skip``: layers
        left out; ``head``: an LM head of its own): fixed-shape chunks where the model runs them and
        the pass is theirs (``fixed_takes``: not a prompt; every layer and the model's own head),
        else the integer rows on the integer path, else the float rows."""
        if self.fixed is not None and fixed_takes(rows, tree) and not skip and head is None:
            return fixed_chunks
        return integer_rows if self.quant is not None else float_rows

    @torch.inference_mode()
    def run_rows(self, caches: Sequence[KVCache], feeds: Sequence[torch.Tensor], positions: Sequence[int],
                 trees: Sequence[torch.Tensor | None] = (), skip: Sequence[int] = (), layers: Sequence[int] = (),
                 finish: str = "none", last_only: bool = False, head: PackedLinear | None = None) -> Rows:
        """One pass: ``feeds[i]`` at ``positions[i]`` on ``caches[i]`` through the runner ``runner``
        picks (the ``runners`` signature); ``head`` (finish ``logits``): logits from that LM head
        instead of the model's (a draft vocabulary's)."""
        run = self.runner(sum(f.numel() for f in feeds), trees[0] if len(trees) == 1 else None, skip, head)
        if head is None or finish != "logits":
            return run(self, caches, feeds, positions, trees, skip, layers, finish, last_only)
        out = run(self, caches, feeds, positions, trees, skip, layers, "hidden", last_only)
        return Rows(out.hidden, self.lm_logits(out.hidden, head, batched=len(caches) > 1), out.layers)
