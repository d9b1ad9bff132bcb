"""One way to build a generation setup from options: the target model behind its backend, the
drafter, and the engine that drives them.

``forerun generate``, ``forerun bench``, ``forerun serve`` and ``eval-draft`` all build through
here: a method runs on the same backend with the same checks however it is asked for, and every
option is checked before a model loads. Which backend runs which method is
``method_backend``'s answer, from the method's row (``drafters.method_row``).

Bench method names (also ``eval-draft --replay``):
``METHOD[-tree[+lookup|+auto|+suffix|+suffix-auto]][:K][+adapt]``, e.g. ``ngram:auto``,
``eagle-tree+lookup:8``, ``eagle-tree+suffix-auto:10``, ``medusa:3+adapt``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from forerun import models
from forerun.backends.llamacpp_lib import available
from forerun.batching import BatchEngine
from forerun.draft_length import K_MAX
from forerun.drafters import (
    check_adapt_save,
    check_method,
    check_method_options,
    head_methods,
    make_drafter,
    method_names,
    method_row,
    parse_skip_layers,
    tree_methods,
    tree_shape,
)
from forerun.drafters.base import Drafter
from forerun.engine import Engine, check_k
from forerun.errors import ForerunError, OptionError
from forerun.models import LoadedModel, load_model
from forerun.split_models import default_draft

# bench's tree suffixes -> the drafter's lookup branch (none, on every tree, or chosen per step) and
# where its chain comes from (prompt lookup, or suffix drafting over the context and earlier outputs)
DRAFT_QUANTS = ("q4_0", "file")  # --draft-quant: the draft model re-coded to 4 bits, or as loaded
DRAFT_LOOKUPS = {"draft+ngram": "ngram", "draft+suffix": "suffix"}  # bench names: --method draft --draft-lookup X
TREE_SUFFIXES = {"-tree": (None, None), "-tree+lookup": ("always", "ngram"), "-tree+auto": ("auto", "ngram"),
                 "-tree+suffix": ("always", "suffix"), "-tree+suffix-auto": ("auto", "suffix")}


@dataclass(frozen=True)
class Method:
    """A bench method name, parsed: ``eagle-tree+lookup:8`` -> kind eagle, tree "-tree+lookup", k 8."""

    name: str
    kind: str  # the drafting method (a row of ``drafters.method_names()``)
    tree: str | None  # a key of TREE_SUFFIXES ("-tree", "-tree+lookup", ...) or None (a chain)
    k: int | str | None  # its own draft length, if it names one
    adapt: bool  # the head keeps learning over the run
    draft_lookup: str | None = None  # draft+ngram / draft+suffix: the draft model with a model-free chain

    @property
    def lookup(self) -> str | None:
        return TREE_SUFFIXES[self.tree][0] if self.tree else None

    @property
    def lookup_from(self) -> str:
        return (TREE_SUFFIXES[self.tree][1] if self.tree else None) or "ngram"


def parse_method(name: str) -> Method:
    """A bench method name, checked (an unknown name is a clear error)."""
    base, _, k = name.removesuffix("+adapt").partition(":")
    if base in DRAFT_LOOKUPS:
        return Method(name, "draft", None, check_k(k) if k else None, False, DRAFT_LOOKUPS[base])
    tree = next((s for s in TREE_SUFFIXES if base.endswith(s)), None)
    kind = base.removesuffix(tree) if tree else base
    if kind not in method_names() or (tree and kind not in tree_methods()):
        heads, trees = head_methods(), [m for m in tree_methods() if m not in head_methods()]
        raise ForerunError(f"unknown method {base!r} (choose {', '.join(method_names())}; "
                           + "".join(f"{h} also as {h}-tree, {h}-tree+lookup, {h}-tree+auto, {h}-tree+suffix or "
                                     f"{h}-tree+suffix-auto; " for h in heads)
                           + "".join(f"{t} as {t}-tree; " for t in trees) + "draft as draft+ngram or draft+suffix)")
    if tree and tree != "-tree" and kind not in head_methods():
        raise ForerunError(f"{name}: the lookup branch is grafted onto a head's tree ({' or '.join(head_methods())})")
    adapt = name.endswith("+adapt")
    if adapt and kind not in head_methods():
        raise ForerunError(f"{name}: +adapt trains {' and '.join(head_methods())} heads only")
    return Method(name, kind, tree, check_k(k) if k else None, adapt)


@dataclass
class Options:
    """What a user asks for (the command line's options, or a library caller's)."""

    model: str
    method: str = "none"
    draft: str | None = None  # method draft: the draft model; eagle/medusa: a trained head folder
    backend: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    threads: int | None = None
    max_context: int | None = None
    skip_layers: str | list | None = None  # layerskip: "1,2,3" or a list (default: the calibrated choice)
    tree_nodes: int = 0  # eagle/medusa/suffix: a token tree of this many nodes (0: a chain)
    tree_depth: int | None = None
    tree_lookup: str | None = None  # None, "always" or "auto"
    lookup_from: str = "ngram"  # the lookup branch's chain: "ngram" (prompt lookup) or "suffix"
    adapt: bool = False
    adapt_save: str | None = None
    serving: bool = False  # for the server: a backend that batches sequences
    draft_tokens: int | None = None  # method draft: the draft vocabulary's size (None: auto, 0: all)
    draft_window: int | None = None  # method draft: the most prompt tokens the draft model reads (None: default, 0: all)
    draft_p_min: float | None = None  # method draft: stop drafting under this draft probability (None: default)
    draft_lookup: str | None = None  # method draft: also a model-free chain each round, "ngram" or "suffix"
    draft_quant: str = "q4_0"  # method draft: the draft model's weights re-coded to 4 bits ("q4_0") or as loaded ("file")

    def __post_init__(self):
        if self.method == "draft" and not self.draft:  # a named model's own draft model (the Qwen2.5-Coder pair)
            self.draft = default_draft(self.model)

    @classmethod
    def from_args(cls, args, **override) -> Options:
        """From an argparse namespace: the fields it has (others keep their defaults)."""
        kw = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**(kw | override))

    def check(self) -> Options:
        """Everything that can be checked before a model loads; returns itself."""
        check_method(self.method, bool(self.draft))
        check_adapt_save(self.adapt, self.adapt_save)
        if self.draft_tokens is not None and self.draft_tokens < 0:
            raise OptionError("{draft_tokens} must be >= 0 (0: every token), got {got}", got=self.draft_tokens)
        check_method_options(self.method, tree=self.tree, tree_lookup=self.tree_lookup, lookup_from=self.lookup_from,
                             adapt=self.adapt, **self.draft_settings)
        self.skip  # noqa: B018 - a bad list fails now
        if self.threads is not None and self.threads < 1:
            raise OptionError("{threads} must be >= 1, got {got}", got=self.threads)
        if self.max_context is not None and self.max_context < 2:
            raise OptionError("{max_context} must be >= 2, got {got}", got=self.max_context)
        if self.draft_quant not in DRAFT_QUANTS:
            raise OptionError("{draft_quant} must be one of {choices}, got {got}", choices=", ".join(DRAFT_QUANTS),
                              got=repr(self.draft_quant))
        return self

    @property
    def tree(self):
        return tree_shape(self.tree_nodes, self.tree_depth)

    @property
    def skip(self):
        return self.skip_layers if isinstance(self.skip_layers, list) else parse_skip_layers(self.skip_layers)

    @property
    def head_path(self):
        return self.draft if method_row(self.method).head else None

    @property
    def draft_settings(self) -> dict:
        """The draft model's settings, for a method that drafts with one (the command line gives
        them to every method; a bench's other methods ignore them)."""
        if not method_row(self.method).draft_model:
            return {}
        return dict(draft_tokens=self.draft_tokens, draft_window=self.draft_window, draft_p_min=self.draft_p_min,
                    draft_lookup=self.draft_lookup)


def method_backend(method: str, spec: str, device: str = "auto", serving: bool = False) -> str:
    """``--backend auto`` per method: the one place that says which backend runs what (generate,
    bench and serve ask it). On the CPU with llama-cpp-python installed, a GGUF model's methods
    that run on its outputs alone (none, ngram, suffix, draft) take the faster backend measured on
    this machine (``models.timed_backend``, one choice per file) where the integer path runs the
    file, else llama.cpp; methods whose row ``needs_torch`` (they skip layers or read hidden
    states: layerskip, eagle, medusa), and anything not a GGUF file, torch. A server
    (``serving``) always takes torch: it batches sequences into one pass, where a llama.cpp
    context holds one sequence."""
    if serving:
        return "torch"
    kind, loc = models.resolve_source(spec)
    on_cpu = models.resolve_device(device).type == "cpu"
    if kind == "gguf" and on_cpu and available() and not method_row(method).needs_torch:
        return models.timed_backend(loc) if models.integer_ready(loc) else "llama.cpp"
    return "torch"


def backend_for(options: Options, methods=()) -> str:
    """The backend that runs ``methods`` (default: the options' method): ``--backend`` as given,
    else ``method_backend``'s choice (torch where the methods differ)."""
    if options.backend != "auto":
        return options.backend
    chosen = {method_backend(m, options.model, options.device, serving=options.serving)
              for m in (methods or (options.method,))}
    return chosen.pop() if len(chosen) == 1 else "torch"


def load_target(options: Options, methods=(), backend: str | None = None):
    """The target model, on ``backend`` (default: ``backend_for(options, methods)``)."""
    return load_model(options.model, dtype=options.dtype, device=options.device,
                      backend=backend or backend_for(options, methods), threads=options.threads,
                      max_context=options.max_context)


def load_draft_model(options: Options, backend: str):
    """Method draft's draft model, on the target's ``backend`` (None for other methods); with
    ``draft_quant`` "q4_0", its weights of more than 4 bits a code re-coded to Q4_0 where it runs
    on the integer kernels (``requantize_4bit``: cheaper steps; the target still decides every token)."""
    if options.method != "draft":
        return None
    recode = options.draft_quant == "q4_0"
    model = load_model(options.draft, dtype=options.dtype, device=options.device, backend=backend,
                       threads=options.threads, max_context=options.max_context, requantize=recode)
    if recode and hasattr(model.backend, "requantize_4bit"):  # loaded another way (a file converted first)
        model.backend.requantize_4bit()
    return model


def drafter_for(options: Options, target, draft_model=None):
    """The drafter the options ask for, over ``target`` (None for plain decoding)."""
    return make_drafter(options.method, target, draft_model=draft_model, skip_layers=options.skip,
                        head_path=options.head_path, tree=options.tree, tree_lookup=options.tree_lookup,
                        lookup_from=options.lookup_from, adapt=options.adapt, **options.draft_settings)


@dataclass
class Setup:
    """A target, its drafter and what built them, ready to decode."""

    options: Options
    target: LoadedModel
    drafter: Drafter | None
    draft_model: LoadedModel | None = None

    def engine(self) -> Engine:
        """One sequence at a time (``Engine``)."""
        return Engine(self.target.backend, self.drafter, self.target.eos_token_ids)

    def batch_engine(self, *, max_batch: int = 8, max_waiting: int = 64, k_max: int = K_MAX,
                     prefix_cache_mb: int = 0, speculate: bool = True) -> BatchEngine:
        """Many sequences together (``BatchEngine``): every slot forks this setup's drafter
        (``speculate=False``: plain batched decoding)."""
        return BatchEngine(self.target.backend, self.target.eos_token_ids, drafter=self.drafter, max_batch=max_batch,
                           max_waiting=max_waiting, k_max=k_max, speculate=speculate,
                           prefix_cache_bytes=prefix_cache_mb << 20)


def build(options: Options, *, target=None, draft_model=None) -> Setup:
    """Check the options, load the target (and a draft model) unless given, build the drafter.

    ``target``: a model already loaded (``models.LoadedModel``): bench runs its methods over one
    load, the training data pass and the tests build over the model they hold."""
    options.check()
    if target is None:
        backend = backend_for(options)
        target = load_target(options, backend=backend)
        if draft_model is None:
            draft_model = load_draft_model(options, backend=backend)
    elif draft_model is None and options.method == "draft":
        raise ForerunError("method draft over a loaded target needs its draft model (draft_model=)")
    return Setup(options, target, drafter_for(options, target, draft_model), draft_model)
