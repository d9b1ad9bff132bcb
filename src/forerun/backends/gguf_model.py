"""A transformers model skeleton straight from a GGUF file, for the torch backend's integer path.

The integer kernels read a GGUF model's linear layers in their own blocks (``qweights``), so the
float32 copies that transformers' GGUF conversion makes of them (4 bytes a weight, twice the
model's size once stacked) are never read. This module builds the model class on the meta device
and makes real only the small tensors the native forward reads in float32 (norms, biases, the
rotary tables), each dequantized and processed as transformers does at conversion (the same
values, bit for bit). Everything large stays in the file (``FileTensors``): the layers' linear
weights, with the order in which their GGUF rows must be read to be the rows of the transformers
weight (Llama files store query and key rows permuted for rotary embeddings), and the token
embeddings and LM head, read by row or whole when asked for.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, dequantize, get_tensor_name_map
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

from forerun.gguf_file import BLOCKS, GGUFFile

# the linear layers of a decoder block, left on the meta device
_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
# GGUF types read as they are (F32, F16, BF16)
_PLAIN = {0: np.float32, 1: np.float16}
_BF16 = 30


def tensor_array(g: GGUFFile, name: str) -> np.ndarray:
    """One tensor of the file as float32, shaped as transformers reads it (rows last dimension
    first), dequantized by the ``gguf`` package as transformers' conversion does."""
    t = g.tensors[name]
    shape = tuple(reversed(t.shape))
    n = int(np.prod(shape))
    if t.type in _PLAIN:
        a = np.frombuffer(g.buf, dtype=_PLAIN[t.type], count=n, offset=t.offset)
        return a.astype(np.float32).reshape(shape)
    if t.type == _BF16:
        a = np.frombuffer(g.buf, dtype=np.uint16, count=n, offset=t.offset).astype(np.uint32) << 16
        return a.view(np.float32).reshape(shape)
    if t.type not in BLOCKS:
        raise ValueError(f"tensor {name}: GGUF type {t.type} is not handled")

    return dequantize(g.raw_rows(name), GGMLQuantizationType(t.type)).reshape(shape)


def _processor(g: GGUFFile, config):
    arch = g.metadata.get("general.architecture")
    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())


def weights_map(model: torch.nn.Module, arch: str, proc) -> dict[str, str]:
    """GGUF tensor name -> transformers parameter name, as transformers' conversion maps them
    (its own map walks every submodule and rebuilds the ``gguf`` package's name table at each,
    seconds for a small model; the decoders here need only the top level)."""
    arch_id = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_id is None:
        raise ValueError(f"the gguf package does not know the architecture {arch!r}")
    table = get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    out = {}
    for hf in model.state_dict():
        hf = proc.preprocess_name(hf)
        base, dot, suffix = hf.rpartition(".") if hf.endswith((".weight", ".bias")) else (hf, "", "")
        gname = table.get_name(base)
        if gname is not None:
            out[gname + dot + suffix] = hf
    return out


def _set(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    mod = module.get_submodule(owner)
    old = getattr(mod, leaf)
    if tuple(old.shape) != tuple(value.shape):
        raise ValueError(f"{name}: the file has shape {tuple(value.shape)}, the model {tuple(old.shape)}")
    if leaf in dict(mod.named_parameters(recurse=False)):
        setattr(mod, leaf, torch.nn.Parameter(value, requires_grad=False))
    else:  # a buffer: assigned in place, its persistence kept
        setattr(mod, leaf, value)


class FileTensors:
    """What ``skeleton`` left in the file: the linear weights' row orders (``row_orders``: GGUF
    name -> order of its rows, None where as stored), and the token embeddings and LM head,
    read on demand (a 262,144-token vocabulary is 671 MB in float32; plain decoding reads a
    handful of its rows per step)."""

    def __init__(self, g: GGUFFile, proc, kw: dict, row_orders: dict, embed: str, head: str | None):
        self.g, self._proc, self._kw = g, proc, kw
        self.row_orders = row_orders
        self.embed_name, self.head_name = embed, head  # head None: tied to the embeddings
        self._rows: dict[int, torch.Tensor] = {}  # token -> its dequantized embedding row

    def _process(self, name: str, w: np.ndarray) -> torch.Tensor:
        w = self._proc.process(weights=w, name=name, **self._kw).weights
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))

    def full(self, name: str) -> torch.Tensor:
        """A whole tensor in float32, as transformers' conversion gives it."""
        return self._process(name, tensor_array(self.g, name))

    ROWS_KEPT = 16384  # dequantized embedding rows kept for reuse (a generation reuses few tokens)

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the token embeddings, the values ``full`` has there (the ``gguf``
        dequantizer works block by block, so a row alone comes out the same). Rows are kept once
        dequantized (at most ``ROWS_KEPT``, the oldest dropped first): a step costs a lookup."""
        rows = self._rows
        idx = ids.reshape(-1).tolist()
        miss = sorted({i for i in idx if i not in rows})
        if miss:
            t = self.g.tensors[self.embed_name]
            if t.type in BLOCKS:
                w = dequantize(self.g.raw_rows(self.embed_name)[miss], GGMLQuantizationType(t.type))
            else:
                w = tensor_array(self.g, self.embed_name)[miss]
            new = self._process(self.embed_name, w.reshape(len(miss), t.shape[0]))
            for i, row in zip(miss, new):
                rows[i] = row
        out = torch.stack([rows[i] for i in idx])
        while len(rows) > self.ROWS_KEPT:
            del rows[next(iter(rows))]
        return out


def skeleton(path: str | Path, config) -> tuple[torch.nn.Module, FileTensors]:
    """(model, file tensors): the transformers model of ``config`` on the meta device, with
    the norms, biases and rotary tables real (read from the GGUF file at ``path`` or computed);
    the decoder layers' linear weights, the token embeddings and the LM head stay in the file
    (see ``FileTensors``). Raises ValueError where the file does not fit the model."""
    g = GGUFFile.open(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    proc = _processor(g, config)
    names = weights_map(model, g.metadata.get("general.architecture"), proc)
    kw = {"tensor_key_mapping": names, "parsed_parameters": {"config": config.to_dict()}}
    orders: dict[str, np.ndarray | None] = {}
    wanted = {n for n, p in model.named_parameters()}
    seen, embed, head = set(), None, None
    for gname, t in g.tensors.items():
        hf = names.get(gname)
        if hf is None:
            continue
        if _LINEAR.match(hf):
            rows = t.shape[1]
            order = proc.process(weights=np.arange(rows).reshape(rows, 1), name=gname, **kw).weights.reshape(-1)
            if not np.array_equal(np.sort(order), np.arange(rows)):
                raise ValueError(f"{gname}: transformers changes this weight's values, not only its row order")
            orders[gname] = None if np.array_equal(order, np.arange(rows)) else order
        elif hf == "model.embed_tokens.weight":
            embed = gname
        elif hf == "lm_head.weight":
            head = gname
        else:
            w = proc.process(weights=tensor_array(g, gname), name=gname, **kw).weights
            _set(model, hf, torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)))
        seen.add(hf)
    if embed is None:
        raise ValueError("the GGUF file has no token embeddings")
    if getattr(config, "tie_word_embeddings", False) or head is None:
        head = None
        seen.add("lm_head.weight")
    for gname in (embed, head):
        if gname is not None and len(g.tensors[gname].shape) != 2:
            raise ValueError(f"{gname}: not a matrix")
    missing = sorted(n for n in wanted - seen if not _LINEAR.match(n))
    if missing:
        raise ValueError(f"the GGUF file has no tensor for {', '.join(missing[:3])}")
    if not orders:
        raise ValueError("the GGUF file has no linear layers this model reads")
    # rotary tables are computed, not stored: build them on the CPU
    rot = model.model.rotary_emb
    model.model.rotary_emb = type(rot)(config=config)
    return model, FileTensors(g, proc, kw, orders, embed, head)
