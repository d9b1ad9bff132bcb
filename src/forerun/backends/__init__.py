"""Backends: what the engine drives to run a model (``base``: the interface and declared
capabilities; ``native``: our forward; ``hf``: transformers; ``llamacpp``: GGUF via llama.cpp; the C
kernels and GGUF blocks they use)."""

from forerun.backends.base import Backend, Capabilities, ForwardOutput

__all__ = ["Backend", "Capabilities", "ForwardOutput"]
