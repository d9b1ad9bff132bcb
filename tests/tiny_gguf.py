"""Tiny random GGUF files of the native architectures (no tokenizer), written with the ``gguf``
package and quantized by its own quantizers: for reading GGUF files as transformers does."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, LAYERS, FFN, HEADS, KV, VOCAB = 64, 2, 128, 4, 2, 320


def write_tiny_gguf(path: Path, arch: str, *, tied: bool = True, seed: int = 0) -> Path:
    """A random model of ``arch`` (llama, qwen2, qwen3, gemma3) whose linear weights are
    of several block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), norms and biases float32."""
    import gguf
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(seed)
    D = 128 if arch == "qwen3" else HIDDEN // HEADS  # transformers reads Qwen3's head size as 128 whatever the file says
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_rope_dimension_count(D)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    if arch == "gemma3":
        w.add_sliding_window(8)
    types = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
    k = [0]

    def quant(name, rows, cols, typ=None):
        typ = typ if typ is not None else types[k[0] % len(types)]
        k[0] += 1
        a = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(a, typ), raw_dtype=typ)

    def f32(name, *dims, around=1.0):
        w.add_tensor(name, (around + 0.1 * rng.standard_normal(dims)).astype(np.float32))

    quant("token_embd.weight", VOCAB, HIDDEN, T.Q8_0)
    f32("output_norm.weight", HIDDEN)
    if not tied:
        quant("output.weight", VOCAB, HIDDEN, T.Q5_0)
    for i in range(LAYERS):
        b = f"blk.{i}."
        f32(b + "attn_norm.weight", HIDDEN)
        quant(b + "attn_q.weight", HEADS * D, HIDDEN)
        quant(b + "attn_k.weight", KV * D, HIDDEN)
        quant(b + "attn_v.weight", KV * D, HIDDEN)
        quant(b + "attn_output.weight", HIDDEN, HEADS * D)
        f32(b + "ffn_norm.weight", HIDDEN)
        quant(b + "ffn_gate.weight", FFN, HIDDEN)
        quant(b + "ffn_up.weight", FFN, HIDDEN)
        quant(b + "ffn_down.weight", HIDDEN, FFN)
        if arch == "qwen2":
            for p, n in (("q", HEADS), ("k", KV), ("v", KV)):
                f32(b + f"attn_{p}.bias", n * D, around=0.0)
        if arch in ("qwen3", "gemma3"):
            f32(b + "attn_q_norm.weight", D)
            f32(b + "attn_k_norm.weight", D)
        if arch == "gemma3":
            f32(b + "post_attention_norm.weight", HIDDEN)
            f32(b + "post_ffw_norm.weight", HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
