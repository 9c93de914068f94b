"""logitproc: compiled logit processing and sampling for LLM serving.

Kernels are written once in TVM's TIR (``logitproc.tir_kernels``), compiled for CPU, CUDA, ROCm, Vulkan and Metal
(``logitproc.compile``), and driven by a lean Python runtime (``logitproc.runtime``)::

    from logitproc import GenerationConfig, RequestState, LogitProcessor, Sampler

Importing the package (or ``logitproc.runtime``, ``logitproc.serve``) installs no import hook and sets no environment
variable: the ``logitproc`` command hides torch from TVM's import (``torch_guard.py``) and sizes TVM's thread pool
(``cpu_threads.py``) when it starts; in a library, opening a kernel library or a compiled model (its first
``runtime_module``) sizes the pool, setting ``TVM_NUM_THREADS`` then unless it or ``OMP_NUM_THREADS`` is set.
"""

__version__ = "0.1.0"

__all__ = ["GenerationConfig", "LogitProcessor", "RequestState", "Sampler", "__version__"]


def __getattr__(name: str):  # the runtime (and TVM) load on first use, so `logitproc --help` stays fast
    if name in __all__:
        from . import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'logitproc' has no attribute {name!r}")
