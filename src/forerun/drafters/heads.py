"""Trained draft heads that read the target's hidden states: EAGLE-style and Medusa.

Notation. The target runs token x_i at position i and leaves hidden states f_i there (at a few
layers); from f_i the target itself predicts x_{i+1}. A head predicts further ahead:

* EAGLE (one decoder layer): entry i takes (embedding of x_{i+1}, fused features f_i) and
  predicts x_{i+2}; its output g_i stands in for f_{i+1} at the next depth, so the head can
  run ahead of the target autoregressively. Low, middle and high-layer features are fused
  by one linear layer (EAGLE-3).
* Medusa: head k (1..K) maps the top-layer f_i to x_{i+1+k} through one residual block.

Both predict over a reduced draft vocabulary (the most frequent tokens of the training data):
the target's 262k-token LM head would otherwise be most of a draft step. ``draft_to_target``
maps a draft token index to the target's token id. A head file is a folder with
``config.json`` and ``model.safetensors``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from forerun.backends.head_kernels import FusedLayer, int8_available, pack_linear
from forerun.errors import ForerunError

FORMAT_VERSION = 1


@dataclass
class HeadConfig:
    kind: str  # "eagle" or "medusa"
    hidden_size: int  # the target's
    vocab_size: int  # the target's
    draft_vocab: int
    feature_layers: list[int]  # target layers whose outputs are read (medusa: the last one only)
    target: dict = field(default_factory=dict)  # fingerprint of the target it was trained for
    n_heads: int = 8
    head_dim: int = 80
    intermediate: int = 1536
    medusa_heads: int = 4
    rope_theta: float = 10000.0
    eps: float = 1e-6
    embed_scale: float = 1.0  # the target scales token embeddings by this (Gemma: sqrt(hidden))
    # eagle: an RMSNorm on each feature layer before the fusing layer. False is EAGLE-3's own shape (the
    # fusing layer reads the raw features), which every engine loads; see forerun.training.export.
    feature_norms: bool = True
    training: dict = field(default_factory=dict)  # recipe and validation results, for the record
    format_version: int = FORMAT_VERSION


def default_feature_layers(num_layers: int) -> list[int]:
    """Low, middle and high: the outputs of layers 2, N/2 and N-1 (the last)."""
    return sorted({min(2, num_layers - 1), num_layers // 2, num_layers - 1})


def eagle3_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's own choice, the one vLLM and SGLang default to: the outputs of layers 1, N/2 - 1 and
    N - 4 (the inputs of layers 2, N/2 and N - 3). Never the last layer, whose output SGLang
    cannot hand to a drafter."""
    return sorted({max(0, min(i, num_layers - 2)) for i in (1, num_layers // 2 - 1, num_layers - 4)})


def target_fingerprint(embed: torch.Tensor, num_layers: int) -> dict:
    """What a head must match: shapes, and a checksum of a few embedding rows (tells apart two
    models that share a tokenizer and shape)."""
    rows = embed[:: max(1, embed.shape[0] // 16)][:16].float()
    # signed sums of 32 rows spread over the vocabulary: two models of one shape differ there
    signed = embed[:: max(1, embed.shape[0] // 32)][:32].float().sum(-1)
    return {"vocab_size": int(embed.shape[0]), "hidden_size": int(embed.shape[1]), "num_layers": int(num_layers),
            "embed_checksum": [round(float(v), 3) for v in rows.abs().mean(-1)],
            "embed_row_sums": [round(float(v), 4) for v in signed]}


def fingerprint_mismatch(trained_for: dict, fingerprint: dict) -> str | None:
    """Why a head trained for ``trained_for`` does not fit a target of ``fingerprint`` (None: it fits)."""
    for key in ("vocab_size", "hidden_size", "num_layers"):
        if trained_for.get(key) != fingerprint.get(key):
            return f"{key} {trained_for.get(key)}, this target has {fingerprint.get(key)}"
    a, b = trained_for.get("embed_checksum"), fingerprint.get("embed_checksum")
    if b is not None and (not isinstance(a, list) or len(a) != len(b)):
        return "the head records no checksum of its target's weights"  # an empty one would match anything
    if b is not None and any(abs(x - y) > 2e-3 for x, y in zip(a, b)):
        return "same shapes, different weights"
    a, b = trained_for.get("embed_row_sums"), fingerprint.get("embed_row_sums")
    if a is not None and b is not None and (len(a) != len(b) or any(abs(x - y) > 2e-3 * max(1.0, abs(x))
                                                                    for x, y in zip(a, b))):
        return "same shapes, different weights"
    return None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, init: torch.Tensor | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(init.clone().float() if init is not None else torch.ones(dim))

    def forward(self, x):  # x * rsqrt(mean(x^2) + eps) * weight, in one operation
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


_ROPE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (theta, d, device) -> cos, sin [positions, d]


def _rope_table(theta: float, d: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [>= n, d] of every position below n: computed once per shape and grown by
    doubling, instead of a dozen small operations per drafting step."""
    key = (float(theta), d, str(device))
    tab = _ROPE.get(key)
    if tab is None or tab[0].shape[0] < n:
        size = max(256, n, 2 * (tab[0].shape[0] if tab is not None else 0))
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
        ang = torch.arange(size, device=device).float()[:, None] * inv[None]
        tab = _ROPE[key] = (torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1))
    return tab


def _rope(x, positions, theta, end: int):  # x: [..., T, d]; positions [T] (integers below end)
    d = x.shape[-1]
    cos, sin = _rope_table(theta, d, end, x.device)  # the bound comes from the caller: no device sync
    cos, sin = cos[positions], sin[positions]
    half = d // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


class DraftHead(nn.Module):
    """Common parts: config, the reduced vocabulary and its output layer, save/load."""

    def __init__(self, cfg: HeadConfig, draft_to_target: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("draft_to_target", draft_to_target.long().clone())
        self.norm_out = RMSNorm(cfg.hidden_size, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab, bias=False)

    def init_from_target(self, lm_head_weight: torch.Tensor, final_norm: torch.Tensor | None) -> None:
        """Start the output layer at the target's own LM head rows for the draft vocabulary.

        The target's final norm scale goes on the head's input norm of the top-layer features, not
        on its output norm: Gemma's scales some dimensions by ~300, and as an output scale it would
        blow every small weight update up into huge logits; as an input scale it makes those
        dimensions large in the head's own hidden space, where small updates barely move them."""
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_weight[self.draft_to_target].float())
            if final_norm is not None:
                self.top_norm().weight.copy_(final_norm.float())

    def top_norm(self) -> RMSNorm:
        """The norm applied to the top-layer features on their way in."""
        raise NotImplementedError

    def logits(self, g):  # [..., hidden] -> [..., draft_vocab]
        return self._lin(self.lm_head, self.norm_out(g))

    def pack_for_inference(self, kernel: str = "onednn", half: bool = True, int8: bool | None = None) -> DraftHead:
        """Use the backend's CPU matrix kernels for every linear layer: PyTorch's own one-row product
        is several times slower on CPU. The LM head takes the fastest kernel per row count; the
        other layers take ``kernel`` (the target's ``body_kernel``: ``onednn`` prepacked weights,
        or ``rows``). With ``half`` (the default), a layer whose weights float16 holds exactly (a
        head loaded from its float16 file) reads them as float16 for drafting passes (half the
        bytes; the same float32 products, see ``f16w_rows``). With ``int8`` (default: wherever
        ``qrows.c`` builds and every layer's input is whole blocks of 32), every layer reads 8-bit
        weights (Q8_0 blocks) with 8-bit activations in the integer kernels the target's GGUF
        layers use: a quarter of float32's bytes, and drafting is mostly reading weights (a
        SmolLM2 head step 2.5 -> 1.2 ms). Drafts change a little, never the output: the target
        verifies every token. Inference only: packed weights do not train."""
        self._half = half
        if int8 is None:
            int8 = int8_available() and all(m.in_features % 32 == 0 for m in self.modules()
                                                   if isinstance(m, nn.Linear))
        self._int8 = int8
        self._packed = {id(m): self._pack_layer(m) for m in self.modules() if isinstance(m, nn.Linear)}
        self._kernel = kernel
        self._derive_for_drafting()
        return self

    def _derive_for_drafting(self) -> None:
        """State drafting derives from the weights, rebuilt whenever they change (EAGLE: its layer
        as one native call, the feature norms' scales stacked once)."""
        self._native = None

    def _pack_layer(self, m: nn.Linear):
        return pack_linear(m.weight, int8=getattr(self, "_int8", False), half=self._half, autotune=m is self.lm_head)

    def refresh_packed(self) -> None:
        """After the weights changed (online adaptation): repack every layer but the output layer
        (it does not learn; its tuned kernel choice stays)."""
        packed = getattr(self, "_packed", None)
        if not packed:
            return
        for m in self.modules():
            if isinstance(m, nn.Linear) and m is not self.lm_head:
                packed[id(m)] = self._pack_layer(m)
        self._derive_for_drafting()

    def _lin(self, mod: nn.Linear, x):
        kern = getattr(self, "_packed", {}).get(id(mod))
        if kern is None or x.requires_grad:
            return mod(x)
        out = kern(x.reshape(-1, x.shape[-1]), None if mod is self.lm_head else self._kernel)
        if mod.bias is not None:
            out = out + mod.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def save(self, path: str | Path, dtype: torch.dtype | str = torch.float16) -> None:
        """Weights are stored as ``dtype`` (half the size of float32) and computed in float32 after
        loading; a loaded head saves back bit-identically. ``dtype="q8"``: every matrix as 8-bit
        blocks with scales; ``"q5"`` etc. fewer bits (``store_quantized``; the shipped heads are q5 and q6)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        meta = None
        if isinstance(dtype, str):  # "q8", "q5", ...: codes of that many bits
            if not (dtype[:1] == "q" and dtype[1:].isdigit() and 2 <= int(dtype[1:]) <= 8):
                raise ValueError(f"dtype {dtype!r}: a torch dtype or q2..q8")
            tensors, meta = store_quantized(state, int(dtype[1:]))
        else:
            tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
        save_file(tensors, str(path / "model.safetensors"), metadata=meta)
        cfg = asdict(self.cfg)
        if cfg["feature_norms"]:  # the default: left out, so a forerun that predates the field reads the file
            del cfg["feature_norms"]
        (path / "config.json").write_text(json.dumps(cfg, indent=1))

    def content_hash(self) -> str:
        h = hashlib.sha256()
        for k, v in sorted(self.state_dict().items()):
            h.update(k.encode())
            h.update(v.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


class HeadCache:
    """An EAGLE head's keys and values [1, heads, capacity, d] and how many entries are in use.
    Entries are written in place (capacity grows by doubling): a drafting step copies only its
    own rows, not the whole cache."""

    def __init__(self):
        self.k = self.v = None
        self.n = 0

    def put(self, k: torch.Tensor, v: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write entries [1, heads, T, d] at pos..pos+T-1 (dropping any past pos); returns views
        of entries 0..pos+T-1."""
        end = pos + k.shape[2]
        self.reserve(pos, end, k.shape[1], k.shape[3], k)
        self.k[:, :, pos:end], self.v[:, :, pos:end] = k, v
        return self.k[:, :, :end], self.v[:, :, :end]

    def reserve(self, pos: int, end: int, heads: int, d: int, like: torch.Tensor) -> None:
        """Room for entries up to ``end`` ([1, heads, capacity, d], ``like``'s dtype and device),
        keeping the first ``pos``; entries pos..end-1 count as in use (the caller writes them)."""
        if pos > self.n:
            raise ValueError(f"head cache: writing at {pos} past its {self.n} entries")
        if self.k is None or end > self.k.shape[2]:
            cap = max(64, end, 2 * (self.k.shape[2] if self.k is not None else 0))
            k_new = like.new_empty(1, heads, cap, d)
            v_new = torch.empty_like(k_new)
            if self.k is not None:
                k_new[:, :, :pos], v_new[:, :, :pos] = self.k[:, :, :pos], self.v[:, :, :pos]
            self.k, self.v = k_new, v_new
        self.n = end


class EagleHead(DraftHead):
    def __init__(self, cfg: HeadConfig, draft_to_target: torch.Tensor):
        super().__init__(cfg, draft_to_target)
        H, n = cfg.hidden_size, len(cfg.feature_layers)
        self.feat_norms = nn.ModuleList(RMSNorm(H, cfg.eps) for _ in range(n)) if cfg.feature_norms else None
        self.fuse = nn.Linear(n * H, H, bias=False)
        self.norm_emb = RMSNorm(H, cfg.eps)
        self.norm_hid = RMSNorm(H, cfg.eps)
        A = cfg.n_heads * cfg.head_dim
        self.qkv = nn.Linear(2 * H, 3 * A, bias=False)
        self.o = nn.Linear(A, H, bias=False)
        self.norm_mlp = RMSNorm(H, cfg.eps)
        self.gate_up = nn.Linear(H, 2 * cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, H, bias=False)
        for lin in (self.fuse, self.qkv, self.o, self.gate_up, self.down):
            nn.init.normal_(lin.weight, std=1.0 / math.sqrt(lin.in_features))
        with torch.no_grad():
            # Start at "g = the top layer's features", which the target's own output layer (the initial
            # lm_head) reads well: the residual branches and the other layers start at zero (their
            # gradients are not zero, so they still learn).
            self.o.weight.zero_()
            self.down.weight.zero_()
            self.fuse.weight.zero_()
            self.fuse.weight[:, (n - 1) * H :] = torch.eye(H)

    def _derive_for_drafting(self) -> None:
        if self.feat_norms is not None:  # the feature norms' scales stacked once, not per drafting round
            self._feat_scales = torch.stack([norm.weight for norm in self.feat_norms]).detach().clone()
        cfg = self.cfg
        native = getattr(self, "_int8", False) and int8_available() and cfg.head_dim <= 1024
        self._native = FusedLayer([self._packed[id(m)] for m in (self.qkv, self.o, self.gate_up, self.down)],
                                  [self.norm_hid.weight, self.norm_mlp.weight, self.norm_emb.weight],
                                  n_heads=cfg.n_heads, head_dim=cfg.head_dim, intermediate=cfg.intermediate,
                                  eps=cfg.eps) if native else None

    def top_norm(self) -> RMSNorm:
        # Without feature norms the raw top-layer features pass the fusing layer unscaled, so the
        # target's final norm belongs where the target has it: before the output layer.
        return self.feat_norms[-1] if self.feat_norms is not None else self.norm_out

    def fuse_features(self, feats):  # [..., n_layers * hidden] -> [..., hidden]
        if self.feat_norms is None:
            return self._lin(self.fuse, feats.float())
        H, n = self.cfg.hidden_size, len(self.feat_norms)
        # each layer's slice normed with its own scale: one norm over [..., n, H], one product
        x = F.rms_norm(feats.float().unflatten(-1, (n, H)), (H,), None, self.cfg.eps)
        scales = getattr(self, "_feat_scales", None) if not torch.is_grad_enabled() else None
        x = x * (scales if scales is not None else torch.stack([norm.weight for norm in self.feat_norms]))
        return self._lin(self.fuse, x.flatten(-2))

    def _qkv(self, emb, hid, positions, end: int):  # emb, hid: [B, T, H] -> q, k, v: [B, heads, T, d]
        B, T, _ = emb.shape
        x = torch.cat([self.norm_emb(emb), self.norm_hid(hid)], -1)
        qkv = self._lin(self.qkv, x).view(B, T, 3, self.cfg.n_heads, self.cfg.head_dim).permute(2, 0, 3, 1, 4)
        q, k = _rope(qkv[:2], positions, self.cfg.rope_theta, end)  # queries and keys rotated at once
        return q, k, qkv[2]

    def _finish(self, hid, attn):  # attn: [B, heads, T, d] -> g: [B, T, H]
        B, _, T, _ = attn.shape
        h = hid + self._lin(self.o, attn.transpose(1, 2).reshape(B, T, -1))
        gu = self._lin(self.gate_up, self.norm_mlp(h))
        a, b = gu.chunk(2, -1)
        return h + self._lin(self.down, F.silu(a) * b)

    def step(self, emb, hid, pos: int, cache: HeadCache | None, *, positions=None, mask=None):
        """Inference: run T entries after the first ``pos`` entries of ``cache`` (None: empty).
        emb, hid: [T, H]. By default the entries sit at positions pos..pos+T-1, causally;
        a token tree passes its own ``positions`` [T] (each below pos + T) and ``mask`` [T, pos + T].
        Returns (g [T, H], the cache holding the first pos entries and the new ones: the same
        object, written in place, whose entries past pos + T are stale)."""
        T = emb.shape[0]
        native = getattr(self, "_native", None)
        if native is not None and emb.device.type == "cpu" and not torch.is_grad_enabled():
            if cache is None:
                cache = HeadCache()
            if positions is None:
                positions = torch.arange(pos, pos + T, device=emb.device)
            cos, sin = _rope_table(self.cfg.rope_theta, self.cfg.head_dim, pos + T, emb.device)
            return native.step(emb, hid, pos, cache, cos[positions], sin[positions], mask), cache
        if positions is None:
            positions = torch.arange(pos, pos + T, device=emb.device)
        q, k, v = self._qkv(emb[None], hid[None], positions, pos + T)
        if cache is None:
            cache = HeadCache()
        k, v = cache.put(k, v, pos)
        if mask is None and T > 1:
            mask = torch.ones(T, pos + T, dtype=torch.bool, device=emb.device).tril(pos)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self._finish(hid[None], attn)[0], cache

    def ttt_forward(self, emb_at, fused, steps: int, pad_mask=None):
        """Training-time test: unroll ``steps`` depths over whole sequences at once.

        emb_at(j): [B, T, H] embeddings of x_{i+j} for every start i (the token fed at depth j);
        fused: [B, T, H] fused target features f_i. Depth 1 attends causally to depth-1 entries;
        depth j > 1 at start i sits at position i+j-1 and attends to depth-1 entries 0..i and to its
        own chain (depths 2..j at start i), exactly as drafting does after a verify pass.
        Returns the output hidden state g of every depth: list of [B, T, H] (``logits`` maps them).
        """
        B, T, H = fused.shape
        dev = fused.device
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        if pad_mask is not None:  # [B, T] True where real
            causal = causal[None] & pad_mask[:, None, :]
            causal = causal[:, None]
        scale = 1.0 / math.sqrt(self.cfg.head_dim)
        out, hid, chain_k, chain_v, k1 = [], fused, [], [], None
        base = torch.arange(T, device=dev)
        for j in range(1, steps + 1):
            q, k, v = self._qkv(emb_at(j), hid, base + (j - 1), T + j - 1)
            if j == 1:
                k1, v1 = k, v
                attn = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
            else:
                chain_k.append(k)
                chain_v.append(v)
                s1 = (q @ k1.transpose(-1, -2)) * scale  # [B, h, T, T]
                s1 = s1.masked_fill(~causal, float("-inf"))
                sd = torch.stack([(q * ck).sum(-1) for ck in chain_k], -1) * scale  # [B, h, T, j-1]
                p = torch.softmax(torch.cat([s1, sd], -1), -1)
                attn = p[..., :T] @ v1 + (p[..., T:, None] * torch.stack(chain_v, -2)).sum(-2)
            hid = self._finish(hid, attn)
            out.append(hid)
        return out


class MedusaHeads(DraftHead):
    def __init__(self, cfg: HeadConfig, draft_to_target: torch.Tensor):
        super().__init__(cfg, draft_to_target)
        H = cfg.hidden_size
        self.norm_in = RMSNorm(H, cfg.eps)
        self.blocks = nn.ModuleList(nn.Linear(H, H) for _ in range(cfg.medusa_heads))
        for b in self.blocks:  # zero init: every head starts as the target's own next-token head
            nn.init.zeros_(b.weight)
            nn.init.zeros_(b.bias)

    def top_norm(self) -> RMSNorm:
        return self.norm_in

    def hidden(self, feats):  # [..., hidden] top-layer features -> one [..., hidden] per head
        x = self.norm_in(feats.float())
        return [x + F.silu(self._lin(b, x)) for b in self.blocks]

    def forward(self, feats):  # [..., hidden] -> [heads, ..., draft_vocab]
        return torch.stack([self.logits(g) for g in self.hidden(feats)])


KINDS = {"eagle": EagleHead, "medusa": MedusaHeads}

Q_BLOCK = 32
Q_SCALE = ".q_scale"  # suffix of a matrix's block scales in a file stored with ``dtype="q5"`` etc.
Q_BITS = "forerun_q_bits"  # the file's metadata: bits per code


def store_quantized(state: dict[str, torch.Tensor], bits: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every float matrix whose rows split into blocks of 32 as ``bits``-bit codes in [-m, m]
    (m = 2^(bits-1) - 1), packed into bytes, and one float16 scale per block [rows, cols / 32]
    (block amax / m, rounded to nearest); vectors (norms, biases) as float16, other tensors as
    they are. Returns the tensors and the file's metadata."""
    m = 2 ** (bits - 1) - 1
    out = {}
    for k, v in state.items():
        if v.is_floating_point() and v.ndim == 2 and v.shape[1] % Q_BLOCK == 0:
            blocks = v.float().reshape(v.shape[0], -1, Q_BLOCK)
            d = (blocks.abs().amax(-1) / m).half()
            inv = torch.where(d != 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
            codes = (torch.round(blocks * inv[..., None]).clamp(-m, m) + m).to(torch.uint8).numpy()
            bitplanes = np.unpackbits(codes.reshape(-1, 1), axis=1)[:, 8 - bits:]  # [n, bits], high bit first
            out[k] = torch.from_numpy(np.packbits(bitplanes.reshape(-1)))
            out[k + Q_SCALE] = d
        else:
            out[k] = v.half() if v.is_floating_point() else v
    return out, {Q_BITS: str(bits)}


def load_quantized(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> dict[str, torch.Tensor]:
    """``store_quantized``'s matrices back as float32 (code x scale: exact in float32); every other
    tensor as stored."""
    bits = int((metadata or {}).get(Q_BITS, 0))
    out = {}
    for k, v in tensors.items():
        if k.endswith(Q_SCALE):
            continue
        d = tensors.get(k + Q_SCALE)
        if d is not None:
            if not bits:
                raise ValueError(f"{k} has block scales but the file does not say its bits per code")
            rows, nb = d.shape
            n = rows * nb * Q_BLOCK
            planes = np.unpackbits(v.numpy())[: n * bits].reshape(n, bits)
            codes = np.packbits(np.concatenate([np.zeros((n, 8 - bits), np.uint8), planes], 1), axis=1)[:, 0]
            q = torch.from_numpy(codes.astype(np.float32) - (2 ** (bits - 1) - 1)).reshape(rows, nb, Q_BLOCK)
            v = (q * d.float()[..., None]).reshape(rows, nb * Q_BLOCK)
        out[k] = v
    return out


def build_head(cfg: HeadConfig, draft_to_target: torch.Tensor) -> DraftHead:
    if cfg.kind not in KINDS:
        raise ForerunError(f"unknown head kind {cfg.kind!r} (choose {', '.join(KINDS)})")
    return KINDS[cfg.kind](cfg, draft_to_target)


def load_head(path: str | Path, *, fingerprint: dict | None = None, kind: str | None = None) -> DraftHead:
    """Load a head folder; check it is whole, of the expected kind, and made for this target."""
    path = Path(path)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    if not cfg_file.exists() or not weights.exists():
        raise ForerunError(f"{path} is not a draft head (needs config.json and model.safetensors)")
    try:
        raw = json.loads(cfg_file.read_text())
        cfg = HeadConfig(**raw)
    except (json.JSONDecodeError, TypeError) as e:
        raise ForerunError(f"{cfg_file} is not a valid head config: {e}") from None
    if cfg.format_version != FORMAT_VERSION:
        raise ForerunError(f"{path}: head format {cfg.format_version}, this forerun reads {FORMAT_VERSION}")
    if kind is not None and cfg.kind != kind:
        raise ForerunError(f"{path} holds a {cfg.kind} head, not {kind}")
    why = fingerprint_mismatch(cfg.target, fingerprint) if fingerprint is not None else None
    if fingerprint is not None and not why:  # the head's own shapes must be the target's too
        for key in ("vocab_size", "hidden_size"):
            if getattr(cfg, key) != fingerprint.get(key):
                why = f"its {key} is {getattr(cfg, key)}, this target has {fingerprint.get(key)}"
    if why:
        raise ForerunError(f"{path} was trained for another target ({why})")
    vocab = fingerprint["vocab_size"] if fingerprint is not None else cfg.vocab_size
    try:
        with safe_open(str(weights), "pt") as f:
            tensors = load_quantized({k: f.get_tensor(k) for k in f.keys()}, f.metadata())
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
        raise ForerunError(f"{weights} is corrupt or unreadable: {e}") from None
    d2t = tensors.get("draft_to_target")
    if d2t is None or d2t.ndim != 1 or d2t.numel() != cfg.draft_vocab:
        raise ForerunError(f"{weights}: draft_to_target missing or not {cfg.draft_vocab} entries")
    if int(d2t.min()) < 0 or int(d2t.max()) >= min(vocab, cfg.vocab_size):
        raise ForerunError(f"{weights}: draft_to_target holds token ids outside the target vocabulary "
                           f"(0..{min(vocab, cfg.vocab_size) - 1})")
    head = build_head(cfg, d2t)
    try:
        head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()})
    except RuntimeError as e:
        raise ForerunError(f"{weights} does not match its config: {str(e).splitlines()[0]}") from None
    return head.eval()
