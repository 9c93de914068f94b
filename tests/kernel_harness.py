"""Run kernels in tests: single kernels compiled for the CPU, and the whole library on each device (cached)."""

from __future__ import annotations

import ast
import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import logitproc
import numpy as np
import pytest
import tvm
from logitproc.compile import build_kernels
from logitproc.compile.build_options import pass_context
from logitproc.compile.kernel_library import MANIFEST, build_in_cache, cache_root
from logitproc.compile.macro_lookup import fast_macro_lookup
from logitproc.runtime.targets import resolve_target
from logitproc.tir_kernels import KERNEL_FACTORIES

#: the folder of the build cache that holds ``compiled_for_cpu``'s kernels
STANDALONE_KERNELS = "test-kernels"

#: (batch, vocab) pairs for the probability kernels: vocab 1, not a multiple of 32, and the 128k/152k vocabularies.
PROB_SHAPES = [(1, 1), (7, 1), (99, 1), (1, 31), (7, 31), (99, 31), (1, 33), (7, 33), (99, 33),
               (1, 128001), (7, 128001), (1, 128256), (7, 128256), (1, 151936), (7, 151936)]


def make_probs(rng: np.random.Generator, batch: int, vocab: int, scale: float = 2.5) -> np.ndarray:
    """Softmax rows of Gaussian logits (float64 softmax, rounded to float32)."""
    logits = rng.standard_normal((batch, vocab)) * scale
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


@functools.cache
def cpu_library() -> Any:
    """The kernel library for this machine's CPU: the build the ``lib`` fixture uses (once per session, in the
    tests' private cache), so that the kernel tests compile nothing of their own."""
    return build_kernels("cpu")


@functools.cache
def cpu_kernel(name: str) -> tvm.runtime.Function:
    """The kernel ``name`` compiled for this machine's CPU, from ``cpu_library`` (every kernel of KERNEL_FACTORIES)."""
    if name not in KERNEL_FACTORIES:
        raise KeyError(f"no kernel named {name!r}")
    return cpu_library()[name]


def built_for_cpu(factory: Callable[..., tvm.tir.PrimFunc], *args: object, **kwargs: object) -> tvm.runtime.Function:
    """``compiled_for_cpu(factory(*args, **kwargs))`` without making the kernel when the cache has it: keyed by the
    factory's name, its arguments (plain values: their ``repr``), the sources of the factory's module and of every
    module of the package it imports, directly or not (``package_sources``: a change anywhere else, e.g. in the
    engine, keeps the cached kernels), the build options' sources, the CPU target and TVM's version. Making a kernel
    (TVMScript's parser) takes seconds of its own; a warm cache then costs nothing."""
    target = resolve_target("cpu").tvm_target()
    material = json.dumps([tvm.__version__, str(target), _sources_hash(factory.__module__), _options_hash(),
                           factory.__module__, factory.__qualname__, repr(args), repr(sorted(kwargs.items()))])
    key = "f" + hashlib.sha256(material.encode()).hexdigest()[:23]
    if key not in _standalone:
        _standalone[key] = _build_standalone(key, lambda: factory(*args, **kwargs), target)
    return _standalone[key]


@functools.cache
def _sources_hash(module: str) -> str:
    digest = hashlib.sha256()
    for path in package_sources(module):
        digest.update(path.relative_to(_PACKAGE_ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


_PACKAGE_ROOT = Path(logitproc.__file__).parent


def _options_hash() -> str:
    """The sources of the build options (``compile/build_options.py``): a change of the passes rebuilds every kernel."""
    return _sources_hash(pass_context.__module__)


def package_sources(module: str) -> list[Path]:
    """The source files of the package module ``module`` (``logitproc.…``) and of every package module it imports,
    directly or through others, with their packages' ``__init__.py``: whatever code importing and calling ``module``
    can run. Every import statement of an imported module counts, those inside its functions too; of a package whose
    submodules only are imported, the statements at its top level (those its import runs)."""
    found: dict[str, Path] = {}
    whole: set[str] = set()
    todo = [(module, True)]
    while todo:
        name, all_statements = todo.pop()
        if name in whole or (name in found and not all_statements):
            continue
        path = _module_file(name)
        if path is None:
            continue
        found[name] = path
        if all_statements:
            whole.add(name)
        todo.append((name.rpartition(".")[0], False))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_bytes())
        for node in ast.walk(tree) if all_statements else tree.body:
            if isinstance(node, ast.Import):
                todo += [(alias.name, True) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]) if node.level else ""
                base = ".".join(part for part in (base, node.module) if part)
                for alias in node.names:  # a submodule, or a name the package itself gives
                    submodule = f"{base}.{alias.name}"
                    todo += [(submodule, True), (base, False)] if _module_file(submodule) else [(base, True)]
    return sorted(found.values())


def _module_file(name: str) -> Path | None:
    """The source file of package module ``name`` (``logitproc.…``); None for a name outside the package or none."""
    if name.split(".")[0] != "logitproc":
        return None
    parts = name.split(".")[1:]
    candidates = [_PACKAGE_ROOT.joinpath(*parts, "__init__.py")]
    candidates += [_PACKAGE_ROOT.joinpath(*parts[:-1], parts[-1] + ".py")] if parts else []
    return next((candidate for candidate in candidates if candidate.is_file()), None)


def compiled_for_cpu(func: tvm.tir.PrimFunc, target: tvm.target.Target | None = None) -> tvm.runtime.Function:
    """The standalone TIR kernel ``func`` compiled (``build_options.pass_context``) for ``target`` (this machine's CPU
    by default), as a callable. Compiled once per kernel into the tests' build cache, keyed by the kernel's whole
    TVMScript text, the target, the build options' sources and TVM's version (what the compiled code depends on), so
    that a run on a warm cache compiles none of the kernels it has seen and two test processes never compile the
    same one twice (``build_in_cache``'s lock)."""
    target = target or resolve_target("cpu").tvm_target()
    func = func.with_attr("global_symbol", "main")
    material = json.dumps([tvm.__version__, str(target), _options_hash(), func.script()])
    key = hashlib.sha256(material.encode()).hexdigest()[:24]
    if key not in _standalone:
        _standalone[key] = _build_standalone(key, lambda: func, target)
    return _standalone[key]


_standalone: dict[str, tvm.runtime.Function] = {}


def _build_standalone(key: str, make: Callable[[], tvm.tir.PrimFunc],
                      target: tvm.target.Target) -> tvm.runtime.Function:
    final = cache_root() / STANDALONE_KERNELS / key

    def build(out: Path) -> None:
        with fast_macro_lookup():
            func = make().with_attr("global_symbol", "main")
        with pass_context(target):
            executable = tvm.compile(tvm.IRModule({"main": func}), target=target)
        executable.export_library(str(out / "kernel.so"))
        (out / MANIFEST).write_text(json.dumps({"tvm_version": tvm.__version__, "target": str(target)}))

    build_in_cache(final, build)
    return tvm.runtime.load_module(str(final / "kernel.so"))["main"]


def run_cpu(name: str, *arrays: np.ndarray) -> list[np.ndarray]:
    """Call kernel ``name`` on copies of ``arrays``; return every argument's contents afterwards (in place and out)."""
    dev = tvm.cpu()
    tensors = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in arrays]
    cpu_kernel(name)(*tensors)
    return [t.numpy() for t in tensors]


@functools.cache
def open_device(kind: str) -> tuple[tuple[Any, dict[str, Any]] | None, str]:
    """((Device, its library's kernels), "") for a device this machine has, else (None, why not). One per process."""
    from logitproc.runtime import Device

    try:
        device = Device(kind)
        return (device, device.load(build_kernels(kind))), ""
    except (RuntimeError, ImportError) as err:
        return None, str(err)


def vulkan_kernels_or_skip() -> dict[str, Any]:
    """The library's kernels on Vulkan (lavapipe without a GPU); numpy arguments the kernel writes are written back."""
    opened, reason = open_device("vulkan")
    if opened is None:
        pytest.skip(f"no vulkan device: {reason}")
    return opened[1]


def assert_tiles_agree(outs: dict[tuple[str, int], np.ndarray], kinds: list[str], counts: range, label: str) -> None:
    """``outs[kind, n]`` (a kernel variant's output for its first ``n`` tokens) bit for bit the ``"narrow"``
    variant's for every kind and count, and the ``"pairs"`` variant's rows for ``n`` tokens those of its widest call
    (batch invariance)."""
    widest = max(counts)
    for n in counts:
        for kind in kinds:
            np.testing.assert_array_equal(outs[kind, n].view(np.uint32), outs["narrow", n].view(np.uint32),
                                          err_msg=f"{label}, {kind}: {n} tokens")
        np.testing.assert_array_equal(outs["pairs", n], outs["pairs", widest][:n], err_msg=f"{label}: {n} tokens")
