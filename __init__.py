"""logitproc: compiled logit processing and sampling for LLM serving.

Kernels are written once in TVM's TIR (``logitproc.tir_kernels``), compiled for CPU, CUDA, ROCm, Vulkan and Metal
(``logitproc.compile``), and driven by a lean Python runtime (``logitproc.runtime``)::

    from logitproc import GenerationConfig, RequestState, LogitProcessor, Sampler
"""

__version__ = "0.1.0"

# Importing TVM must not import torch (seconds at every start); see torch_guard.py. Only as the package: pytest's
# collection of a checkout also imports this file alone, as a plain module, where a relative import has no parent.
if __package__:
    from . import cpu_threads, torch_guard

    torch_guard.install()
    cpu_threads.configure()  # one TVM thread per physical core (TVM alone takes half the cores on x86 VMs)

__all__ = ["GenerationConfig", "LogitProcessor", "RequestState", "Sampler", "__version__"]


def __getattr__(name: str):  # the runtime (and TVM) load on first use, so `logitproc --help` stays fast
    if name in __all__:
        from . import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'logitproc' has no attribute {name!r}")
