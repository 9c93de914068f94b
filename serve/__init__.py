"""Serving: the engine (``Engine``), the model runners, the chat REPL and the command line.

``from logitproc.serve import Engine`` loads the engine on first use, so that ``logitproc --help`` stays fast.
"""

__all__ = ["Delta", "Engine", "EngineStats", "Output", "RequestStats"]


def __getattr__(name: str):
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name in __all__:
        from . import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'logitproc.serve' has no attribute {name!r}")
