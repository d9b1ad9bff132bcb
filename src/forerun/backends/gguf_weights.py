"""The native model on a GGUF file's own blocks: every layer and the LM head repacked for the
integer kernels (``qrows.c``, 8-bit activations; the default), or the blocks serving the float32
path's small passes bit for bit as the dequantized weights (``block_weights``)."""

from __future__ import annotations

import logging

import torch

from forerun import kept
from forerun.backends.block_weights import block_rows_kernel, from_gguf, gguf_codes, unpack
from forerun.backends.ckernels import chosen_isa, sources_id
from forerun.backends.kv_cache import KVCache
from forerun.backends.linear import PackedLinear, f32_rows_kernel
from forerun.backends.qweights import ACT_CODES, NEVER_WIDE, WIDE_ROWS, QLayer, QLayerC, QLinear, qrows_lib, tune_prefetch_level, tune_wide
from forerun.gguf_file import GGUFFile

log = logging.getLogger("forerun")


# GGUF layer names of each Layer linear, in the order its weight stacks them
GGUF_PARTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",),
              "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}


def attach_gguf_integer(model, path: str) -> bool:
    """Repack every layer's GGUF blocks and the LM head for ``qrows.c``; False (nothing kept)
    where a weight's type is not handled or the kernels do not build."""

    try:
        g = GGUFFile.open(path)
    except (OSError, ValueError) as e:
        log.info("no GGUF blocks (%s): layers run on float32 weights", e)
        return False
    files = model.files
    if files is not None:
        head = files.head_name or files.embed_name
    else:
        head = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
    model.head_file = (path, head)
    return attach_integer(model, lambda names, w: gguf_codes(g, [head] if names == ["output"] else names, w,
                                                           files.row_orders if files is not None else None))


def attach_integer(model, codes_of) -> bool:
    """Run every layer and the LM head on the integer kernels, with the blocks that
    ``codes_of(gguf_names, weight)`` gives ((Codes, GGUF type) per tensor, stacked as ``weight``
    stacks them, or None); the head is asked for as ``["output"]``. False (nothing changed)
    where one is missing or the kernels cannot run it."""

    if (qrows_lib() is None or model.arch.act not in ACT_CODES or model.head_dim > 1024
            or model.hidden_size % 32 or model.device.type != "cpu" or model.dtype != torch.float32):
        return False
    quant = []
    for i, layer in enumerate(model.layers):
        lins = {}
        for attr, parts in GGUF_PARTS.items():
            codes = codes_of([f"blk.{i}.{p}.weight" for p in parts], getattr(layer, attr).weight)
            if codes is None or any(c.codes.shape[1] % 32 for c, _ in codes):
                log.info("layer %d %s: a weight type the integer kernels do not take; float32 path", i, attr)
                return False
            lins[attr] = QLinear(codes)
        quant.append(QLayer(layer, lins, model.arch.act, model.arch.sandwich))
    codes = codes_of(["output"], model.lm_head.stored)  # not built from a file where it was left there
    if codes is None:
        log.info("LM head: a weight type the integer kernels do not take; float32 path")
        return False
    model.lm_head.qlin = QLinear(codes)
    model.quant = quant
    model.fixed = None  # the integer path computes every row alone already, in its own kernels
    model.qlayers = (QLayerC * len(quant))(*[q.c for q in quant])  # every layer, for one native call per pass
    # float16 keys and values from now on (as llama.cpp keeps them): half the bytes a step reads
    # at long contexts (``NativeModel.kv_dtype``; caches are made after the model is)
    model.greedy.exact = None
    # never read again: the layers' float32 weights (stacked copies of the model's) and
    # oneDNN copies, and the LM head's oneDNN copy (sub-heads and trained heads have their own)
    for layer in model.layers:
        for attr in GGUF_PARTS:
            lin = getattr(layer, attr)
            lin.packed = None
            lin.weight = lin.weight.to("meta")
    model.lm_head.packed, model.lm_head.autotune = None, False
    log.info("integer kernels: %d layers and the LM head on GGUF blocks (%.0f MB)", len(quant),
             (sum(q.nbytes for q in quant) + model.lm_head.qlin.nbytes) / 1e6)
    return True


def requantize_4bit(model) -> bool:
    """Re-code every layer weight of more than 4 bits a code (Q5_0, Q6_K, Q8_0, ...) as Q4_0,
    on the integer path (False, nothing changed, off it), and the LM heads cut from now on
    (``integer_sub_head``: a draft vocabulary's); the full LM head stays as it is. For a model
    that drafts: its steps read fewer bytes and its tokens stay the target's to accept, so the
    output is unchanged; its logits are no longer the file's."""
    if model.quant is None or model.requantized:
        return False
    before = sum(q.nbytes for q in model.quant)
    for i, q in enumerate(model.quant):
        q.set_linears({name: lin.requantized() for name, lin in q.linears.items()})
        model.qlayers[i] = q.c  # in place: the model holds one array
    model.requantized = True
    tune_prefetch(model)
    tune_wide_tiles(model)
    log.info("layer weights re-coded to 4 bits: %.0f MB -> %.0f MB", before / 1e6,
             sum(q.nbytes for q in model.quant) / 1e6)
    return True


def integer_sub_head(model, rows: torch.Tensor):
    """An LM head over the vocabulary rows ``rows`` only (logits in that order), on the integer
    kernels from the file's own blocks of those rows: a draft model's head restricted to a
    draft vocabulary reads only its share of the head. None off the integer path."""
    if model.quant is None or model.head_file is None:
        return None
    path, name = model.head_file
    g = GGUFFile.open(path)
    typ = g.tensors[name].type
    head = PackedLinear(torch.empty(len(rows), model.hidden_size, device="meta"), False)
    head.qlin = QLinear([(unpack(g.raw_rows(name)[rows.cpu().numpy()], typ), typ)])
    if model.requantized:
        head.qlin = head.qlin.requantized()
    head.qlin.set_wide(model.lm_head.qlin.parts[0].wide)
    head.qlin.set_prefetch(model.lm_head.qlin.parts[0].pf_l1)
    return head


def joined_head(model, first, rows: torch.Tensor):
    """``first`` (an ``integer_sub_head``) with the vocabulary rows ``rows`` after its own, in one
    head (logits: first's rows, then these), its blocks shared, not copied: a draft vocabulary
    grown by the tokens a context brings (``drafters.draft_model.ContextVocab``). None off the
    integer path or where ``first`` is not an integer head."""
    if getattr(first, "qlin", None) is None or not len(rows):
        return None
    more = integer_sub_head(model, rows)
    if more is None:
        return None
    head = PackedLinear(torch.empty(first.qlin.shape[0] + len(rows), model.hidden_size, device="meta"), False)
    head.qlin = QLinear([*first.qlin.parts, *more.qlin.parts])  # the first's parts keep column 0
    return head


def tune_prefetch(model) -> None:
    """Whether the products prefetch the model's weights (layers and LM head) into L1 or L2:
    measured once per model shape, build and machine (``tune_prefetch_level``, kept) by whole
    passes of 1 and 5 rows, the head's products included, before the tile widths are (they are
    timed under the choice). The bits are the same either way."""
    if chosen_isa() in (None, "portable"):
        return
    every = [lin for q in model.quant for lin in q.linears.values()]
    head = model.lm_head.qlin
    key = ["prefetch-2", chosen_isa(), sources_id(), head.signature, *sorted({lin.signature for lin in every})]
    set_layers = _layers_setter(model, every, "set_prefetch")

    def set_l1(l1):
        set_layers(l1)
        head.set_prefetch(l1)

    body = _pass_of(model)
    g = torch.Generator().manual_seed(0)

    def run(n):
        body(n)
        head(torch.randn(n, head.shape[1], generator=g))

    chosen = kept.measured("qrows-prefetch", key, lambda: tune_prefetch_level(set_l1, run),
                           "timing where the integer kernels prefetch the weights, once for this model and machine")
    set_l1(int(chosen))


def tune_wide_tiles(model) -> None:
    """In the AVX-512 build, from how many rows of a pass the 512-bit tile takes the layers'
    weights, and the LM head's: measured once per model shape and machine (``tune_wide``,
    kept): the layers by whole passes (their weights stream from memory as in decoding), the
    head by its own products. The bits are the same either way."""
    if chosen_isa() != "vnni":
        return
    layers = [lin for q in model.quant for lin in q.linears.values()]
    head = model.lm_head.qlin
    key = ["wide-1", sources_id(), head.signature, *sorted({lin.signature for lin in layers}), _prefetch_of(layers)]
    set_layers = _layers_setter(model, layers, "set_wide")

    def measure():
        g = torch.Generator().manual_seed(0)
        return {"layers": tune_wide(set_layers, _pass_of(model), reps=2),
                "head": tune_wide(head.set_wide, lambda n: head(torch.randn(n, head.shape[1], generator=g)))}

    chosen = kept.measured("qrows-wide", key, measure,
                           "timing the integer kernels' tile widths once for this model's shapes and this machine")
    set_layers(int(chosen["layers"]))
    head.set_wide(int(chosen["head"]))


BYTES_MARGIN = 0.97  # the byte copies cost memory: kept where their passes take at most 97% of the time


def tune_byte_codes(model) -> None:
    """From how many rows of a pass the layers' 5- and 6-bit weights, and the LM head's, are
    read as bytes (``QLinear.set_many``: a copy laid a byte a code, no unpacking): measured once
    per model shape, build and machine (``tune_wide`` with medians and ``BYTES_MARGIN``, kept;
    the layers' tile width measured again with the copies in place), after the tile widths, where a
    SIMD build runs and some weight has such codes (a Q4_K_M file's Q6_K parts and head). A
    one-token step reads the file's bits and stays bound by memory; a verify pass of several rows
    is bound by its products, and there the unpacking is a third of a 6-bit vector's work. The
    bits are the same either way; the copies cost memory (a Q6_K weight a third more again),
    kept only where they pay."""
    if chosen_isa() == "portable":
        return
    layers = [lin for q in model.quant for lin in q.linears.values() if lin.has_planes]
    head = model.lm_head.qlin
    heads = [head] if head.has_planes else []
    if not layers and not heads:
        return
    every = [lin for q in model.quant for lin in q.linears.values()]
    key = ["many-2", chosen_isa(), sources_id(), head.signature, *sorted({lin.signature for lin in every}),
           _prefetch_of(every)]
    set_layers = _layers_setter(model, layers, "set_many")
    set_wide = _layers_setter(model, every, "set_wide")
    wide_before = [lin.parts[0].wide for lin in every]

    def measure():
        g = torch.Generator().manual_seed(0)
        out = {"layers": tune_wide(set_layers, _pass_of(model), reps=5, margin=BYTES_MARGIN) if layers else NEVER_WIDE,
               "head": tune_wide(head.set_many, lambda n: head(torch.randn(n, head.shape[1], generator=g)), reps=7,
                                 margin=BYTES_MARGIN) if heads else NEVER_WIDE}
        if layers and out["layers"] < NEVER_WIDE and chosen_isa() == "vnni":  # the tile width again, bytes in place
            set_layers(out["layers"])
            out["layers_wide"] = tune_wide(set_wide, _pass_of(model), reps=2)
        for lin, w in zip(every, wide_before):
            lin.set_wide(w)
        set_layers(NEVER_WIDE)  # and every layer's struct refreshed
        head.set_many(NEVER_WIDE)
        return out

    chosen = kept.measured("qrows-many", key, measure,
                           "timing the integer kernels on 6-bit weights read as bytes, once for this model and machine")
    if "layers_wide" in chosen:
        set_wide(int(chosen["layers_wide"]))
    for lins, rows in ((layers, int(chosen["layers"])), (heads, int(chosen["head"]))):
        for lin in lins:
            if rows < NEVER_WIDE:
                lin.set_many(rows)
            else:
                lin.drop_many()  # never pays here: no copy kept in memory
    _refresh_layers(model)


def _prefetch_of(lins) -> str:
    """The prefetch setting the weights run under (``tune_prefetch``), for the keys of what is timed after it."""
    return f"pf_l1={lins[0].parts[0].pf_l1 if lins else 0}"


def _layers_setter(model, lins, method: str):
    """set(rows): ``lins``' ``method`` (``set_wide``, ``set_many``) at ``rows``, and every layer's
    C struct refreshed in place (the model holds one array)."""
    def set_rows(rows):
        for lin in lins:
            getattr(lin, method)(rows)
        _refresh_layers(model)
    return set_rows


def _refresh_layers(model) -> None:
    """Every layer's C struct made again from its weights' settings, in place (the model holds one array)."""
    for i, q in enumerate(model.quant):
        q.refresh()
        model.qlayers[i] = q.c


def _pass_of(model):
    """run(n): one pass of n rows of the model's layers from position 0, on a cache of its own
    (the weights stream from memory as in decoding)."""
    scratch = KVCache(model)
    ids = torch.arange(max(WIDE_ROWS)) % min(model.vocab_size, 1000) + 3

    def body(n):
        scratch.truncate(0)
        model.run_rows([scratch], [ids[:n]], [0])
    return body


def attach_blocks(model, path: str) -> None:
    """Give each layer linear the GGUF file's blocks of its weights, where they rebuild them."""

    if block_rows_kernel() is None or f32_rows_kernel() is None:
        return
    try:
        g = GGUFFile.open(path)
    except (OSError, ValueError) as e:
        log.info("no GGUF blocks (%s): layers run on float32 weights", e)
        return
    done = total = 0
    blocks = floats = 0
    for i, layer in enumerate(model.layers):
        for attr, parts in GGUF_PARTS.items():
            lin = getattr(layer, attr)
            total += 1
            lin.blocks = from_gguf(g, [f"blk.{i}.{p}.weight" for p in parts], lin.weight)
            if lin.blocks is not None:
                done += 1
                blocks += lin.blocks.nbytes
                floats += lin.weight.numel() * 4
    head = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
    model.lm_head.blocks = from_gguf(g, [head], model.lm_head.weight)
    log.info("%d of %d layer products and %s LM head read GGUF blocks (%.0f MB instead of %.0f MB of float32)",
             done, total, "the" if model.lm_head.blocks is not None else "not the", blocks / 1e6, floats / 1e6)
