"""logitproc: compiled logit processing and sampling for LLM serving.

Kernels are written once in TVM's TIR (``logitproc.tir_kernels``), compiled for CPU, CUDA, ROCm, Vulkan and Metal
(``logitproc.compile``), and driven by a lean Python runtime (``logitproc.runtime``).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
