"""The suite's own tools: which sources key a standalone kernel in the build cache, which builds a selection of tests
gets in the background."""

from __future__ import annotations

from kernel_harness import package_sources
from prebuild import BUILDS, wanted_builds


def test_a_kernel_factory_is_keyed_by_what_it_imports_and_not_by_the_rest_of_the_package() -> None:
    sources = {path.as_posix() for path in package_sources("logitproc.compile.quant_matvec")}
    assert any(path.endswith("compile/quant_matvec.py") for path in sources)
    assert any(path.endswith("compile/quant_formats.py") for path in sources)  # imported by it
    assert any(path.endswith("compile/__init__.py") for path in sources)  # its package, run by the import
    assert not any(path.endswith(("runtime/engine.py", "compile/model_compile.py")) for path in sources)


def test_a_module_imported_through_a_package_brings_what_that_package_runs() -> None:
    sources = {path.as_posix() for path in package_sources("logitproc.compile.decode_attention")}
    # decode_attention imports tir_kernels._common, which imports runtime.kernel_abi: runtime/__init__ runs too
    assert any(path.endswith("tir_kernels/_common.py") for path in sources)
    assert any(path.endswith("runtime/kernel_abi.py") for path in sources)
    assert any(path.endswith("runtime/__init__.py") for path in sources)


def test_the_background_builds_are_those_the_selected_tests_ask_for() -> None:
    everything = [build.name for build in BUILDS]
    quick_library = [("tests/test_library.py::test_rocm_code_object_is_an_amdgpu_elf_with_every_kernel[gfx90a]", ()),
                     ("tests/test_engine.py::test_x", ("tiny_compiled",))]
    assert wanted_builds(quick_library) == ["cpu kernels and --model tiny", "rocm gfx90a kernels"]
    assert "default model" in wanted_builds([("tests/test_x.py::test_y", ("default_model_in_cache",))])
    assert wanted_builds([]) == []
    assert len(set(everything)) == len(everything)
