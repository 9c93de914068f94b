"""A Relax module compiled for the CPU with each TIR function's object code cached by content, so that model builds
share the kernels they have in common.

``tvm.compile`` (``relax.build``) lowers the Relax functions to VM bytecode and compiles every TIR function of the
module into one LLVM module. ``build_executable`` does the same first step, then compiles each TIR function alone
(``tvm.tirx.build`` of a module holding only it) into an object file kept in a store (``cache_root()/objects``),
keyed by the function's name and TVMScript, the target, the pass context and the TVM and logitproc versions: a
function another build already compiled is not lowered again. The executable imports the objects as static
libraries, which ``export_library`` links into the model's ``.so`` beside the VM's bytecode, as it links the one
object ``tvm.compile`` makes.

The tiny test models and the model families share most of their kernels (the attention kernels of a head layout,
the matmuls of a shape and weight format): of the 11 tiny builds of the test suite, 116.6 s of kernel builds were
48.1 s of distinct functions (2026-11-28, this machine). A function compiled alone is optimised as it is in the whole
module; what differs is outside the kernels' arithmetic: LLVM may inline the kernel into its argument-checking wrapper
where the whole module kept a call, and the error paths call a helper of their own instead of one shared with other
functions. The outputs are the same bits (the logits of the tiny model, the families and SmolLM2 compared with
``tvm.compile``'s build).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import tvm
from logitproc import __version__
from tvm import relax
from tvm.relax import vm_build
from tvm.runtime import Executable

from .build_options import pass_context
from .kernel_library import MANIFEST, build_in_cache

#: the object file of a store entry
OBJECT_FILE = "function.o"
#: TVM's pass that marks the only function of a module as the module's entry point (``__tvm_ffi_main``): a model's
#: functions are compiled one per module here, and none of them is the model's entry point.
_ENTRY_PASS = "tirx.AnnotateEntryFunc"


def _function_context(target: tvm.target.Target) -> tvm.transform.PassContext:
    """``pass_context(target)`` less the entry-point annotation (above)."""
    base = pass_context(target)
    return tvm.transform.PassContext(opt_level=base.opt_level, disabled_pass=[*base.disabled_pass, _ENTRY_PASS],
                                     config=dict(base.config))


def lower_to_vm(mod: tvm.IRModule, target: tvm.target.Target) -> tuple[relax.ExecBuilder, tvm.IRModule, dict]:
    """``relax.build``'s steps before the TIR is compiled, for a CPU target: the default Relax pipeline and the VM
    code generation. Returns the bytecode builder, the TIR functions to compile, and the module's attributes (external
    modules and constants), under ``pass_context(target)``."""
    with pass_context(target), target:
        mod = relax.get_pipeline("default")(mod)
    attrs = dict(mod.attrs) if mod.attrs else {}
    builder = relax.ExecBuilder()
    with pass_context(target):
        mod = vm_build._vmcodegen(builder, mod, "bytecode")
    tir = tvm.IRModule({gv: f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}, attrs=mod.attrs)
    return builder, tir, attrs


def function_key(name: str, func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> str:
    """The store key of TIR function ``name``: what its object code depends on (TVMScript, target, passes,
    versions)."""
    context = _function_context(target)
    material = json.dumps([__version__, tvm.__version__, str(target), sorted(context.disabled_pass),
                           sorted((k, str(v)) for k, v in context.config.items()), name, func.script()])
    return hashlib.sha256(material.encode()).hexdigest()[:32]


def function_object(name: str, func: tvm.tirx.PrimFunc, attrs: tvm.ir.DictAttrs | None,
                    target: tvm.target.Target, store: Path) -> Path:
    """The object file of TIR function ``name`` compiled alone for ``target``, from ``store`` (compiled into it when
    absent; one process compiles an entry at a time)."""
    entry = store / function_key(name, func, target)

    def build(out: Path) -> None:
        with _function_context(target):
            module = tvm.tirx.build(tvm.IRModule({name: func}, attrs=attrs), target=target)
        module.write_to_file(str(out / OBJECT_FILE))
        (out / MANIFEST).write_text(json.dumps({"function": name, "target": str(target),
                                                "tvm_version": tvm.__version__}))

    build_in_cache(entry, build)
    return entry / OBJECT_FILE


def build_executable(mod: tvm.IRModule, target: tvm.target.Target, store: Path | None) -> Executable:
    """``tvm.compile(mod, target)`` for a Relax module and a CPU target, with the TIR functions' objects from
    ``store`` (None: a temporary one). Export it with ``export_library`` (the objects are linked then)."""
    if target.kind.name != "llvm":
        raise ValueError(f"build_executable compiles for the CPU (llvm), not {target.kind.name!r}")
    builder, tir, attrs = lower_to_vm(mod, target)
    with tempfile.TemporaryDirectory(prefix="logitproc-objects-") as scratch:  # a static library keeps its bytes
        libraries = [tvm.runtime.load_static_library(
            str(function_object(gv.name_hint, func, tir.attrs, target, Path(scratch) if store is None else store)),
            [gv.name_hint]) for gv, func in sorted(tir.functions.items(), key=lambda item: item[0].name_hint)]
    if not libraries:
        raise ValueError("the module has no TIR function to compile")
    library = libraries[0]
    for other in libraries[1:]:
        library.import_module(other)
    linked = vm_build._ffi_api.VMLink(builder, target, library, list(attrs.get("external_mods", [])),
                                      dict(attrs.get("const_name_to_constant", {})))
    return vm_build.VMExecutable(linked)
