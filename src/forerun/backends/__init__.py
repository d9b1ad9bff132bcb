from forerun.backends.base import Backend, ForwardOutput

__all__ = ["Backend", "ForwardOutput"]
