"""What the native forward needs to know of an architecture of the Llama lineage, and its layers'
weights as it holds them (projections stacked, norms folded)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from forerun.backends.linear import PackedLinear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_float: bool = True) -> torch.Tensor:
    """RMS norm with the norm's effective weight (Gemma's ``1 + w`` folded in). ``weight_in_float``:
    Gemma multiplies by the weight before casting back to x's dtype, Llama-style norms after."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_float:
        return (xf * weight).type_as(x)
    return weight * xf.type_as(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
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
    def of(cls, cfg) -> Arch:
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


class Layer:
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
        fold = norm_weight if arch.gemma_norms else (lambda n: n.weight.detach())
        # sandwich: [before attention, after attention, before the MLP, after the MLP]; else
        # [before attention, before the MLP]
        self.norms = [fold(getattr(hf_layer, n)) for n in names]
        # Gemma 3 and Qwen3 norm queries and keys per head
        self.q_norm = fold(a.q_norm) if hasattr(a, "q_norm") else None
        self.k_norm = fold(a.k_norm) if hasattr(a, "k_norm") else None
        self.sliding = attention_type == "sliding_attention"


def norm_weight(norm) -> torch.Tensor:
    """Gemma's norms scale by (1 + w): fold the 1 in once."""
    return 1.0 + norm.weight.detach().float()


def _bias(*linears) -> torch.Tensor | None:
    """The linear layers' biases side by side, or None where they have none."""
    if all(getattr(l, "bias", None) is None for l in linears):
        return None
    return torch.cat([l.bias.detach() if l.bias is not None else l.weight.new_zeros(l.out_features)
                      for l in linears])


def add_bias(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias


def decoder_layer(i: int, layer: Layer, h: torch.Tensor, sandwich: bool, norm, linear, qkv, attend) -> torch.Tensor:
    """Decoder layer ``i`` over the rows ``h`` [rows, hidden], written once for the torch paths (the
    float rows of ``runners`` and the fixed-shape chunks of ``fixed_rows``; the integer path
    runs the same layer in C, ``qlayer.c``, checked against this one by the tests). What differs
    between the paths comes in as functions: ``norm(x, weight)``, ``linear(linear, x, bias)``,
    ``qkv(i, layer, projected)`` -> (q, k, v) split, normed where the architecture norms them and
    rotated, and ``attend(i, layer, q, k, v)`` -> the attention output [rows, heads * head_dim], the cache written.
    ``sandwich``: Gemma 2/3's normed outputs, then a norm before the MLP."""
    x = norm(h, layer.norms[0])
    q, k, v = qkv(i, layer, linear(layer.qkv, x, layer.qkv_bias))
    x = linear(layer.o, attend(i, layer, q, k, v), layer.o_bias)
    if sandwich:
        h = h + norm(x, layer.norms[1])
        x = norm(h, layer.norms[2])
    else:
        h = h + x
        x = norm(h, layer.norms[1])
    gu = linear(layer.gate_up, x, layer.gate_up_bias)
    x = linear(layer.down, layer.act(gu[:, : layer.inter]) * gu[:, layer.inter :], layer.down_bias)
    return h + (norm(x, layer.norms[3]) if sandwich else x)
