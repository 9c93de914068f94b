"""What CPU builds do to save time without changing code (``compile/build_options.py``,
``compile/function_objects.py``): the TIR passes they leave out change nothing in the lowered code of the kernel
library and of a model; a Relax module built from per-function objects computes the same bits as ``tvm.compile``'s
build, and a later build reuses the objects of the functions it shares."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tvm
from logitproc.compile.build_options import NO_OP_PASSES, pass_context
from logitproc.compile.function_objects import build_executable, lower_to_vm
from logitproc.compile.macro_lookup import fast_macro_lookup
from logitproc.compile.relax_llama import LlamaSpec, export_llama
from logitproc.compile.tiny_model import make_tiny_model
from logitproc.runtime.targets import resolve_target
from logitproc.tir_kernels import KERNEL_FACTORIES
from tvm import relax
from tvm.relax.frontend import nn
from tvm.target import Target
from tvm.tirx.build import split_host_device_mods

TARGET = resolve_target("cpu").tvm_target()


def _lowered(mod: tvm.IRModule, context: tvm.transform.PassContext) -> dict[str, str]:
    """Each function's host TIR as ``tvm.tirx.build`` hands it to the code generator, under ``context``."""
    target = Target(TARGET).with_host(Target(TARGET))
    with context:
        mod = tvm.tirx.transform.BindTarget(target)(mod)
        pipeline, finalize_host, _ = tvm.tirx.get_default_tir_pipeline(target)
        host, _ = split_host_device_mods(pipeline(mod))
        host = finalize_host()(host)
    return {gv.name_hint: func.script() for gv, func in host.functions.items()}


def _with_every_pass(context: tvm.transform.PassContext) -> tvm.transform.PassContext:
    kept = [name for name in context.disabled_pass if name not in NO_OP_PASSES]
    return tvm.transform.PassContext(opt_level=context.opt_level, disabled_pass=kept, config=dict(context.config))


def _assert_same_lowering(mod: tvm.IRModule) -> None:
    ours = pass_context(TARGET)
    assert set(NO_OP_PASSES) <= set(ours.disabled_pass)
    left_out, kept = _lowered(mod, ours), _lowered(mod, _with_every_pass(ours))
    assert left_out.keys() == kept.keys()
    for name in kept:
        assert left_out[name] == kept[name], name


@pytest.mark.slow  # about 4 s of CPU: the library lowered twice
def test_left_out_passes_change_no_kernel_of_the_library() -> None:
    with fast_macro_lookup():
        mod = tvm.IRModule({name: factory(TARGET) for name, factory in KERNEL_FACTORIES.items()})
    _assert_same_lowering(mod)


@pytest.mark.slow
def test_left_out_passes_change_no_function_of_a_model() -> None:
    """The tiny model with a float16 KV cache (its attention kernels, matmuls, RoPE, norms, Relax's own kernels)."""
    spec = replace(LlamaSpec.from_model(make_tiny_model(seed=0, context=64), "float32"), kv_dtype="float16")
    with fast_macro_lookup():
        mod, _ = export_llama(spec, TARGET)
    _, tir, _ = lower_to_vm(mod, TARGET)
    _assert_same_lowering(tir)


class _Mlp(nn.Module):
    """A small Relax model: two matmuls, an activation and a norm, over a dynamic number of rows."""

    def __init__(self) -> None:
        self.up = nn.Linear(24, 40, bias=True)
        self.down = nn.Linear(40, 24, bias=False)
        self.norm = nn.RMSNorm(24, axes=-1, bias=False)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return self.norm(self.down(nn.op.silu(self.up(x))))


def _mlp_module() -> tuple[tvm.IRModule, list[np.ndarray]]:
    mod, named = _Mlp().export_tvm(spec={"forward": {"x": nn.spec.Tensor(["n", 24], "float32")}})
    rng = np.random.default_rng(0)
    return mod, [rng.standard_normal(param.shape).astype(np.float32) for _, param in named]


def _run(path: Path, params: list[np.ndarray], x: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(path)), tvm.cpu())
    return vm["forward"](tvm.runtime.tensor(x), *[tvm.runtime.tensor(p) for p in params]).numpy()


def test_built_from_function_objects_gives_the_same_bits_and_reuses_them(tmp_path: Path) -> None:
    mod, params = _mlp_module()
    with pass_context(TARGET):
        tvm.compile(mod, target=TARGET).export_library(str(tmp_path / "whole.so"))
    store = tmp_path / "objects"
    build_executable(mod, TARGET, store).export_library(str(tmp_path / "split.so"))
    objects = sorted(store.iterdir())
    assert objects  # one entry per TIR function
    x = np.random.default_rng(1).standard_normal((7, 24)).astype(np.float32)
    want = _run(tmp_path / "whole.so", params, x)
    assert _run(tmp_path / "split.so", params, x).tobytes() == want.tobytes()

    stamps = {entry: (entry / "function.o").stat().st_mtime_ns for entry in objects}
    build_executable(mod, TARGET, store).export_library(str(tmp_path / "again.so"))
    assert {entry: (entry / "function.o").stat().st_mtime_ns for entry in sorted(store.iterdir())} == stamps
    assert _run(tmp_path / "again.so", params, x).tobytes() == want.tobytes()
