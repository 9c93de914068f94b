"""``compile/macro_lookup.py``: kernels made while ``fast_macro_lookup`` is entered are the same TVMScript as TVM's
own lookup makes, entered from several threads at once or nested, and TVM's lookup is back after the last exit."""

from __future__ import annotations

import threading

import pytest
from logitproc.compile.decode_attention import decode_attention_kernel
from logitproc.compile.macro_lookup import fast_macro_lookup
from tvm.script import tirx as T


def small_kernel(scale: float):
    """A PrimFunc that calls a macro from a macro, with a closure value: what the package's kernels do."""

    @T.macro
    def scaled(out, x, i):
        out[i] = x[i] * T.float32(scale)

    @T.macro
    def row(out, x):
        for i in range(8):
            scaled(out, x, i)

    @T.prim_func
    def kernel(x: T.Buffer((8,), "float32"), out: T.Buffer((8,), "float32")):
        row(out, x)

    return kernel


def test_kernels_are_the_same_script_as_with_tvms_lookup() -> None:
    slow = small_kernel(2.0).script()
    with fast_macro_lookup():
        fast = small_kernel(2.0).script()
    assert fast == slow
    assert "2.0" in fast


@pytest.mark.slow  # 3 s of TVM's own lookup: the small kernel above keeps the property in the quick set
def test_an_attention_kernel_is_the_same_script_as_with_tvms_lookup() -> None:
    slow = decode_attention_kernel(3, 9, 64, "q8_0").script()
    with fast_macro_lookup():
        assert decode_attention_kernel(3, 9, 64, "q8_0").script() == slow


def test_nested_and_concurrent_entries_make_the_same_kernels() -> None:
    want = {scale: small_kernel(scale).script() for scale in (1.0, 3.0, 5.0, 7.0)}
    got: dict[float, str] = {}
    errors: list[BaseException] = []

    def make(scale: float) -> None:
        try:
            with fast_macro_lookup(), fast_macro_lookup():
                got[scale] = small_kernel(scale).script()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=make, args=(scale,)) for scale in want]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert got == want
    assert small_kernel(1.0).script() == want[1.0]  # after the last exit: TVM's own lookup again
