"""Keep ``import tvm`` from importing torch: it costs seconds at every start and logitproc never needs it there.

``tvm_ffi`` and ``tvm.relax.base_py_module`` (both imported by ``import tvm``) run ``try: import torch`` / ``except
ImportError`` at import time, only to exchange torch tensors without copies. logitproc passes numpy arrays and TVM
tensors, never torch tensors, so :func:`install` makes those imports see torch as absent: while ``tvm`` (or
``tvm_ffi``) itself executes, ``sys.modules["torch"]`` is ``None`` (Python's documented way to make an import raise
ImportError), and the entry is removed right after. torch stays importable afterwards (the optional xgrammar engine
imports it when it is first used).

Nothing is changed when torch is already imported (TVM then uses it as usual), when TVM is already imported, or when
``LOGITPROC_TVM_TORCH=1`` is set (for code that passes torch tensors to TVM functions itself).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

ENV_VAR = "LOGITPROC_TVM_TORCH"
_GUARDED = ("tvm", "tvm_ffi")  # the packages whose import tries torch


class _TorchlessLoader(importlib.abc.Loader):
    """Runs the real loader of a guarded package with ``import torch`` failing; everything else is the real one's."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        blocked = "torch" not in sys.modules
        if blocked:
            sys.modules["torch"] = None  # type: ignore[assignment]
        try:
            self._loader.exec_module(module)
        finally:
            if blocked and "torch" in sys.modules and sys.modules["torch"] is None:
                del sys.modules["torch"]

    def __getattr__(self, name: str) -> Any:  # resource readers, is_package, ...: the real loader's
        return getattr(self._loader, name)


class _TvmFfiFinder(importlib.abc.MetaPathFinder):
    """Finds a guarded package through the other finders and wraps its loader; removes itself once both are in."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        if fullname not in _GUARDED:
            return None
        uninstall()
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            if any(name not in sys.modules and name != fullname for name in _GUARDED):
                sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None and "torch" not in sys.modules:
            spec.loader = _TorchlessLoader(spec.loader)
        return spec


_finder = _TvmFfiFinder()


def install() -> None:
    """Guard the first imports of ``tvm`` and ``tvm_ffi`` (no-op when they are in, or ``LOGITPROC_TVM_TORCH=1``)."""
    if all(name in sys.modules for name in _GUARDED) or os.environ.get(ENV_VAR) == "1" or _finder in sys.meta_path:
        return
    sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
