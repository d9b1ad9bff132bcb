"""Drafters, one module each, and the method table: one row per drafting method (its name, what it
drafts from, what it can do, how it is built), from which the method lists, the command line's
help, the option checks and the backend choice are all derived. Adding a method is a ``Drafter``
class and a row (``register_method``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from forerun.backends.arch import SUPPORTED_ARCHITECTURES
from forerun.drafters.adapt import OnlineAdapter
from forerun.drafters.base import Draft, Drafter
from forerun.drafters.draft_model import DraftModelDrafter
from forerun.drafters.draft_vocab import auto_draft_tokens, draft_vocabulary
from forerun.drafters.eagle import EagleDrafter, MedusaDrafter
from forerun.drafters.heads import fingerprint_mismatch, load_head, target_fingerprint
from forerun.drafters.layer_skip import LayerSkipDrafter, default_calibration
from forerun.drafters.lookup import NgramLookup, SuffixLookup
from forerun.drafters.ngram import NgramDrafter
from forerun.drafters.suffix import SuffixDrafter
from forerun.errors import ForerunError, OptionError
from forerun.models import LoadedModel

LOOKUP_SOURCES = ("ngram", "suffix")  # where a tree's lookup branch comes from (--lookup-from)
MAX_TREE_NODES = 64  # the most draft nodes a token tree may have (--tree-nodes)
# method draft's defaults (docs/drafters.md, "What a draft model reads"): the draft model reads the
# whole context (None; a window of its last N tokens lost half the accepted tokens on summaries), and
# the draft-length policy alone stops the draft (no minimum probability)
DRAFT_WINDOW = None
DRAFT_P_MIN = 0.0


def shipped_head(kind: str, fingerprint: dict):
    """The head of this kind shipped inside the package for the target with this fingerprint, or None."""
    root = resources.files("forerun") / "data" / "heads"
    for folder in sorted(root.iterdir(), key=lambda p: p.name):
        cfg = folder / "config.json"
        if not cfg.is_file():
            continue
        raw = json.loads(cfg.read_text())
        if raw.get("kind") == kind and fingerprint_mismatch(raw.get("target", {}), fingerprint) is None:
            return folder
    return None


def load_trained_head(kind: str, target, head_path=None, option: str = "head_path"):
    """The head at ``head_path`` (default: the one shipped for this target, found by its
    fingerprint), checked against the target and moved to its device. ``option``: the option that
    names a head, for the error."""
    be = target.backend
    fingerprint = target_fingerprint(be.embed, be.num_layers)
    path = head_path or shipped_head(kind, fingerprint)
    if path is None:
        raise OptionError("no {kind} head is shipped for {name}; train one with `forerun train-draft --kind {kind} "
                          "--model {name} --out DIR` and pass DIR as {" + option + "}", kind=kind, name=target.name)
    return load_head(path, fingerprint=fingerprint, kind=kind).to(be.device)


def require_hidden_states(target, what: str, alternative: str = "") -> None:
    """Refuse ``what`` (a method or command) unless ``target``'s backend hands out its hidden
    states and embeddings, as trained heads need."""
    if not target.backend.capabilities.hidden_states:
        raise ForerunError(f"{what} reads the target's hidden states: it needs the torch backend on a "
                           f"{SUPPORTED_ARCHITECTURES} model{alternative}")


def load_head_drafter(method: str, target, head_path=None, tree=None, lookup=None, adaptive: bool = False, adapt=None):
    be = target.backend
    require_hidden_states(target, f"method {method}", " (--backend torch), or the llama.cpp backend with a Q8_0 "
                          "LM head and a C compiler")
    if tree is not None and not be.capabilities.token_trees:
        raise OptionError("token trees need the torch backend ({backend}=torch); on llama.cpp the heads draft chains")
    head = load_trained_head(method, target, head_path)
    adapter = None
    if adapt:
        adapter = OnlineAdapter(head, be.embed, **(adapt if isinstance(adapt, dict) else {}))
        adapter.on_update = head.refresh_packed
    if be.device.type == "cpu":
        # A head that keeps learning is repacked after every update: it stays in float (quantizing
        # it again each time would cost more than its 8-bit reads save).
        head.pack_for_inference(be.report().get("body_kernel", "onednn"), int8=False if adapter is not None else None)
    return (EagleDrafter if method == "eagle" else MedusaDrafter)(head, be.embed, tree=tree, lookup=lookup, adaptive=adaptive,
                                                                  adapter=adapter)


def check_vocab(target, draft) -> None:
    """A draft model must share the target's vocabulary: token ids mean the same thing."""
    tv, dv = target.backend.vocab_size, draft.backend.vocab_size
    if tv != dv:
        raise ForerunError(f"draft model vocabulary ({dv} tokens) differs from the target's ({tv} tokens)")
    ttok, dtok = target.tokenizer, draft.tokenizer
    if ttok is not None and dtok is not None and ttok.get_vocab() != dtok.get_vocab():
        raise ForerunError("draft model tokenizer differs from the target's (same size, different tokens)")


def parse_skip_layers(text: str | None) -> list[int] | None:
    """``1,2,3`` -> [1, 2, 3] (``skip_layers`` as text); None when not given."""
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise OptionError("{skip_layers} must be comma-separated integers, got {got}", got=repr(text)) from None


def check_draft_settings(window: int | None, p_min: float | None, lookup: str | None) -> None:
    """Method draft's ``draft_window``, ``draft_p_min`` and ``draft_lookup``, refused with a reason."""
    if window is not None and window < 0:
        raise OptionError("{draft_window} must be >= 0 (0: the whole context), got {got}", got=window)
    if p_min is not None and not 0.0 <= p_min < 1.0:
        raise OptionError("{draft_p_min} must be in [0, 1), got {got}", got=p_min)
    if lookup is not None and lookup not in LOOKUP_SOURCES:
        raise OptionError("{draft_lookup} must be one of {choices}, got {got}", choices=", ".join(LOOKUP_SOURCES),
                          got=repr(lookup))


def lookup_source(source: str, ngram_max: int, ngram_min: int):
    """A model-free chain beside a drafter (``drafters.lookup``): "suffix" or "ngram" (prompt lookup)."""
    return SuffixLookup() if source == "suffix" else NgramLookup(ngram_max, ngram_min)


@dataclass
class DraftRequest:
    """What ``make_drafter`` was asked for, as a row's ``make`` reads it (see ``make_drafter``)."""

    method: str
    target: LoadedModel
    draft_model: LoadedModel | None = None
    skip_layers: list[int] | None = None
    ngram_max: int = 4
    ngram_min: int = 1
    head_path: object = None
    tree: tuple | None = None
    tree_lookup: bool | str | None = None
    lookup_from: str = "ngram"
    adapt: object = None
    draft_tokens: int | None = None
    draft_window: int | None = None
    draft_p_min: float | None = None
    draft_lookup: str | None = None


@dataclass(frozen=True)
class DraftingMethod:
    """One row of the method table."""

    name: str
    about: str  # what it drafts from (the command line's help)
    make: Callable[[DraftRequest], Drafter | None]  # the drafter, once the option checks passed
    trees: bool = False  # can draft token trees (tree=, --tree-nodes)
    head: bool = False  # a trained head on the target's hidden states (head_path=, adapt=, tree_lookup=)
    needs_torch: bool = False  # reads what only the torch backend gives (skipped layers, hidden states)
    draft_model: bool = False  # drafts with a second model (draft_model=, --draft MODEL)


def _ngram(r: DraftRequest):
    return NgramDrafter(max_ngram=r.ngram_max, min_ngram=r.ngram_min)


def _suffix(r: DraftRequest):
    if r.tree is not None and not r.target.backend.capabilities.token_trees:
        raise OptionError("token trees need the torch backend ({backend}=torch); on llama.cpp suffix drafts chains")
    return SuffixDrafter(tree_nodes=r.tree[0] if r.tree else None, max_depth=r.tree[1] if r.tree else None)


def _draft_model(r: DraftRequest):
    target, draft_model = r.target, r.draft_model
    check_vocab(target, draft_model)
    cuttable = hasattr(draft_model.backend, "sub_head")  # the llama.cpp backend runs its whole head
    if r.draft_tokens and not cuttable:
        raise OptionError("{draft_tokens} cuts the draft model's head: it needs the torch backend for the draft model")
    n = auto_draft_tokens(draft_model.backend.vocab_size, r.draft_tokens) if cuttable else 0
    lookup = lookup_source(r.draft_lookup, r.ngram_max, r.ngram_min) if r.draft_lookup else None
    return DraftModelDrafter(draft_model.backend, draft_vocabulary(draft_model.tokenizer, n) if n else None,
                             window=r.draft_window or DRAFT_WINDOW,
                             p_min=DRAFT_P_MIN if r.draft_p_min is None else r.draft_p_min, lookup=lookup)


def _layer_skip(r: DraftRequest):
    if not r.target.backend.capabilities.layer_skip:
        raise OptionError("layerskip needs a backend that can skip layers ({backend}=torch on a {archs} model); "
                          "llama.cpp has no per-call layer selection", archs=SUPPORTED_ARCHITECTURES)
    calib = default_calibration(r.target) if r.skip_layers is None else {}
    layers = r.skip_layers if r.skip_layers is not None else calib["best"]["skip"]
    return LayerSkipDrafter(r.target.backend, layers, extra_vocab=calib.get("draft_vocab", ()))


def _head(r: DraftRequest):
    lookup = lookup_source(r.lookup_from, r.ngram_max, r.ngram_min) if r.tree_lookup else None
    return load_head_drafter(r.method, r.target, r.head_path, r.tree, lookup, adaptive=r.tree_lookup == "auto",
                             adapt=r.adapt)


_TABLE: dict[str, DraftingMethod] = {}


def register_method(row: DraftingMethod) -> DraftingMethod:
    """Add a row to the method table (or replace the row of that name); returns it."""
    _TABLE[row.name] = row
    return row


def unregister_method(name: str) -> None:
    _TABLE.pop(name, None)


for _row in (
    DraftingMethod("none", "plain decoding, no drafts", lambda r: None),
    DraftingMethod("ngram", "prompt lookup: what followed the context's last n-gram where it occurred before", _ngram),
    DraftingMethod("suffix", "the longest match of the context's end in the context and earlier outputs", _suffix,
                   trees=True),
    DraftingMethod("draft", "a smaller model with the target's vocabulary (--draft MODEL)", _draft_model,
                   draft_model=True),
    DraftingMethod("layerskip", "the target itself with some layers skipped", _layer_skip, needs_torch=True),
    DraftingMethod("eagle", "a trained head reading the target's hidden states, one token after another", _head,
                   trees=True, head=True, needs_torch=True),
    DraftingMethod("medusa", "trained heads reading the target's last hidden state, one per position", _head,
                   trees=True, head=True, needs_torch=True),
):
    register_method(_row)


def method_names() -> tuple[str, ...]:
    return tuple(_TABLE)


def tree_methods() -> tuple[str, ...]:
    """Methods that can draft token trees (--tree-nodes)."""
    return tuple(n for n, m in _TABLE.items() if m.trees)


def head_methods() -> tuple[str, ...]:
    """Trained heads on the target's hidden states (--adapt, --tree-lookup, --draft HEAD_FOLDER)."""
    return tuple(n for n, m in _TABLE.items() if m.head)


def method_row(method: str) -> DraftingMethod:
    """The table's row for ``method`` (an unknown name is a clear error)."""
    row = _TABLE.get(method)
    if row is None:
        raise ForerunError(f"unknown method {method!r} (choose {', '.join(_TABLE)})")
    return row


def method_help(default: str = "ngram") -> str:
    """The command line's --method help, from the table."""
    return " | ".join(_TABLE) + f" (default {default})"


def check_method(method: str, has_draft: bool) -> None:
    """Before any model loads: the method exists, and a draft-model method has its draft model."""
    if method_row(method).draft_model and not has_draft:
        raise OptionError("method {method} needs a draft model ({draft_model})", method=method)


def check_adapt_save(adapt: bool, adapt_save) -> None:
    """``adapt_save``, refused with a reason before a model loads (whether the method takes
    ``adapt`` is ``check_method_options``'s)."""
    if adapt_save and not adapt:
        raise OptionError("{adapt_save} keeps what {adapt} learned: give {adapt} too")
    if adapt_save:
        out = Path(adapt_save)
        if out.exists() and not out.is_dir():
            raise OptionError("{adapt_save} {out} exists and is not a folder", out=out)


def check_method_options(method: str, *, tree=None, tree_lookup: bool | str | None = None, lookup_from: str = "ngram",
                         adapt=None, draft_tokens: int | None = None, draft_window: int | None = None,
                         draft_p_min: float | None = None, draft_lookup: str | None = None) -> None:
    """The one check of a method's options against its row, before any model loads (``make_drafter``
    and ``build.Options.check`` both ask it): what only some methods take is refused elsewhere."""
    row = method_row(method)
    if (draft_window is not None or draft_p_min is not None or draft_lookup) and not row.draft_model:
        raise OptionError("{draft_window}, {draft_p_min} and {draft_lookup} set method draft's draft model, not {method}",
                          method=method)
    check_draft_settings(draft_window, draft_p_min, draft_lookup)
    if draft_tokens is not None and (not row.draft_model or draft_tokens < 0):
        raise OptionError("{draft_tokens} cuts a draft model's vocabulary: method draft and a count >= 0, "
                          "not {method} with {got}", method=method, got=draft_tokens)
    if adapt and not row.head:
        raise OptionError("{adapt} trains {heads} heads, not {method}", heads=" and ".join(head_methods()), method=method)
    if tree_lookup not in (None, False, True, "always", "auto"):
        raise OptionError("{tree_lookup} must be 'always' or 'auto', got {got}", got=repr(tree_lookup))
    if tree is not None and not row.trees:
        raise OptionError("token trees ({tree_nodes}) work with {trees}, not {method}", trees=", ".join(tree_methods()),
                          method=method)
    if tree is not None:
        tree_shape(*tree)
    if tree_lookup and not row.head:
        raise OptionError("{tree_lookup} adds a lookup branch to a trained head's tree ({heads}), not {method}'s{why}",
                          heads=", ".join(head_methods()), method=method,
                          why="; suffix trees already draft from lookups" if method == "suffix" else "")
    if lookup_from not in LOOKUP_SOURCES:
        raise OptionError("{lookup_from} must be one of {choices}, got {got}", choices=", ".join(LOOKUP_SOURCES),
                          got=repr(lookup_from))
    if lookup_from != "ngram" and not tree_lookup:
        raise OptionError("{lookup_from} {got} names where {tree_lookup}'s chain comes from: give {tree_lookup} too",
                          got=lookup_from)
    if tree_lookup and tree is None:
        raise OptionError("{tree_lookup} adds a branch to a token tree: give {tree_nodes} too")


def make_drafter(method: str, target, *, draft_model=None, skip_layers=None, ngram_max: int = 4, ngram_min: int = 1,
                 head_path=None, tree=None, tree_lookup: bool | str | None = None, lookup_from: str = "ngram",
                 adapt=None, draft_tokens: int | None = None, draft_window: int | None = None,
                 draft_p_min: float | None = None, draft_lookup: str | None = None):
    """Build the drafter for ``method`` (None for plain decoding). ``head_path``: a trained head
    folder for eagle/medusa (default: the one shipped for the bundled model); ``tree``: (nodes, depth)
    to verify token trees instead of chains (eagle, medusa, suffix); ``tree_lookup``: every tree also
    carries a lookup chain as one more branch: True or "always", or "auto" to choose per step between
    that tree and the lookup chain alone; ``lookup_from``: where that chain comes from, "ngram" (the
    prompt-lookup continuation, n-grams of ngram_max down to ngram_min tokens) or "suffix" (suffix
    drafting over the context and the drafter's earlier outputs, ``drafters.lookup``); ``adapt``: the
    head keeps learning from the verified tokens while it drafts (True, or ``OnlineAdapter`` options;
    eagle/medusa only); ``draft_tokens``: method draft drafts from that many tokens, its head cut
    to them (0: all; None: 32,768 where the draft model's vocabulary is over 65,536, see
    ``draft_vocab``); ``draft_window``: method draft reads a long prompt (or a long stretch it did
    not draft for) from its last that many tokens (0 or None: all);
    ``draft_p_min``: method draft stops drafting before a token it gives less than this
    probability (None: ``DRAFT_P_MIN``); ``draft_lookup``: method draft also offers a model-free
    chain every round, "ngram" (prompt lookup) or "suffix" (the suffix drafter's), verified alone
    where it promises more than the model's draft."""
    check_method_options(method, tree=tree, tree_lookup=tree_lookup, lookup_from=lookup_from, adapt=adapt,
                         draft_tokens=draft_tokens, draft_window=draft_window, draft_p_min=draft_p_min,
                         draft_lookup=draft_lookup)
    check_method(method, draft_model is not None)
    return method_row(method).make(DraftRequest(
        method, target, draft_model=draft_model, skip_layers=skip_layers, ngram_max=ngram_max, ngram_min=ngram_min,
        head_path=head_path, tree=tree_shape(*tree) if tree is not None else None, tree_lookup=tree_lookup,
        lookup_from=lookup_from, adapt=adapt, draft_tokens=draft_tokens, draft_window=draft_window,
        draft_p_min=draft_p_min, draft_lookup=draft_lookup))


__all__ = ["Draft", "Drafter", "DraftingMethod", "DraftRequest", "MAX_TREE_NODES", "LOOKUP_SOURCES", "make_drafter",
           "check_method", "check_method_options", "check_vocab", "head_methods", "method_help", "method_names",
           "method_row", "parse_skip_layers", "register_method", "tree_methods", "unregister_method"]


def tree_shape(nodes: int, depth: int | None):
    """(nodes, depth) for a token tree of ``nodes`` draft nodes, or None for a chain (nodes 0)."""
    if not 0 <= nodes <= MAX_TREE_NODES:
        raise OptionError("{tree_nodes} must be in 0..{most} (0: chains), got {got}", most=MAX_TREE_NODES, got=nodes)
    if depth is not None and depth < 1:
        raise OptionError("{tree_depth} must be >= 1, got {got}", got=depth)
    return (nodes, depth) if nodes else None
