# fmt: off
"""TVM's WGSL kernels run through wgpu on Vulkan (lavapipe on a machine without a GPU), against the numpy references.

Skipped, with the reason printed, when wgpu or a Vulkan adapter is missing. The session selects Mesa's lavapipe
(``VK_ICD_FILENAMES``) itself when that variable is unset and the ICD file exists.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from logitproc.compile import resolve_target
from logitproc.runtime import wgsl
from logitproc.runtime.wgsl_layout import PodField, ShaderLayout, fold_grid, parse_shader, split_shaders
from logitproc.tir_kernels import KERNEL_FACTORIES
from logitproc.tir_kernels import reference as ref
from tvm.script import tirx as T

LAVAPIPE = wgsl.use_lavapipe_if_unset()  # before the first adapter request creates wgpu's instance

BIAS, PENALTY, BITMASK = "apply_logit_bias_inplace", "apply_penalty_inplace", "apply_bitmask_inplace"
SHAPES = [(1, 33), (7, 33), (99, 33), (1, 128001), (7, 128001)]


def _skip(reason: str) -> None:
    print(f"test_wgsl skipped: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def device():
    if wgsl.wgpu is None:
        _skip("the wgpu package is not installed (pip install 'logitproc[vulkan]')")
    adapter = wgsl.request_adapter()
    if adapter is None:
        _skip("no Vulkan adapter (install mesa-vulkan-drivers for lavapipe, or a GPU Vulkan driver)")
    print(f"wgpu {wgsl.wgpu.__version__} on {adapter.info['device']} ({adapter.info['backend_type']})")
    return wgsl.create_device(adapter)


@pytest.fixture(scope="module")
def kernels(device):
    target = resolve_target("vulkan").tvm_target()
    funcs = {name: KERNEL_FACTORIES[name](target) for name in (BIAS, PENALTY, BITMASK)}
    return wgsl.WGSLKernels.from_prim_funcs(device, funcs)


def _sparse_entries(rng: np.random.Generator, batch: int, vocab: int, per_row: int) -> tuple[np.ndarray, np.ndarray]:
    """Duplicate-free (row, token) pairs, including the first and last token of the vocabulary."""
    rows, toks = [], []
    for r in range(batch):
        chosen = np.unique(np.concatenate([[0, vocab - 1], rng.choice(vocab, size=min(per_row, vocab), replace=False)]))
        rows += [r] * chosen.size
        toks += chosen.tolist()
    return np.asarray(rows, np.int32), np.asarray(toks, np.int32)


# ----------------------------------------------------------------------------------------------------------------
# What TVM emits (pure text checks, no device needed beyond compilation)


def test_tvm_wgsl_layout_is_by_name_and_matches_tvm_compile():
    target = resolve_target("vulkan").tvm_target()
    func = KERNEL_FACTORIES[BITMASK](target)
    _, device_mod, source = wgsl.lower_to_webgpu({BITMASK: func}, target)
    with tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}):
        ex = tvm.compile(tvm.IRModule({BITMASK: func}), target=target)
    assert source == ex.mod.imports[0].inspect_source("")  # same WGSL as tvm.compile's

    shaders = split_shaders(source)
    assert list(shaders) == [BITMASK + "_kernel"]
    layout = parse_shader(shaders[BITMASK + "_kernel"])
    # buffers sorted by name, not parameter order (logits, row_ids, bitmask); only logits is written; the POD holds
    # the logits' batch too (the kernel skips row ids outside it)
    assert [(b.name, b.read_only) for b in layout.storage] == [
        ("bitmask_ptr", True), ("logits_ptr", False), ("row_ids_ptr", True)]
    assert layout.pod_binding == 3
    assert [f.name for f in layout.pod_fields] == ["batch", "num_rows", "num_words", "vocab", "packGridDimX"]
    assert layout.workgroup_size == (256, 1, 1)
    assert layout.grid_guard == ">"
    assert "cse_v" not in source


def test_pod_packing_and_grid_folding():
    fields = (PodField("n", "i32", 0), PodField("s", "f32", 4), PodField("packGridDimX", "u32", 8))
    layout = ShaderLayout("k", (), 0, fields, (64, 1, 1), ">")
    data = layout.pack_pod({"n": -3, "s": 0.5}, blocks_x=70000)
    assert len(data) == 16
    assert np.frombuffer(data[:4], "<i4")[0] == -3
    assert np.frombuffer(data[4:8], "<f4")[0] == 0.5
    assert np.frombuffer(data[8:12], "<u4")[0] == 69999  # '>' guard: the last valid block index
    assert fold_grid(65535, 1) == (65535, 1, 1)
    assert fold_grid(65536, 1) == (32768, 1, 2)
    assert fold_grid(66001, 3) == (33001, 3, 2)
    assert fold_grid(200001, 1) == (50001, 1, 4)


# ----------------------------------------------------------------------------------------------------------------
# The logitproc kernels on the device


@pytest.mark.parametrize("batch,vocab", SHAPES)
def test_logit_bias(kernels, batch, vocab):
    rng = np.random.default_rng(batch * 1000 + vocab)
    logits = rng.standard_normal((batch, vocab)).astype(np.float32)
    pos2seq, token_ids = _sparse_entries(rng, batch, vocab, 9)
    bias = rng.uniform(-5, 5, pos2seq.size).astype(np.float32)
    out = logits.copy()
    kernels(BIAS, out, pos2seq, token_ids, bias)
    np.testing.assert_array_equal(out, ref.apply_logit_bias(logits, pos2seq, token_ids, bias))


@pytest.mark.parametrize("batch,vocab", SHAPES)
def test_penalty(kernels, batch, vocab):
    rng = np.random.default_rng(batch * 1000 + vocab + 1)
    logits = rng.standard_normal((batch, vocab)).astype(np.float32) * 4
    pos2seq, token_ids = _sparse_entries(rng, batch, vocab, 12)
    token_cnt = rng.integers(0, 4, pos2seq.size).astype(np.int32)
    penalties = np.stack([rng.uniform(0, 1, batch), rng.uniform(0, 1, batch), rng.uniform(0.5, 2, batch)],
                         axis=1).astype(np.float32)
    out = logits.copy()
    kernels(PENALTY, out, pos2seq, token_ids, token_cnt, penalties)
    np.testing.assert_allclose(out, ref.apply_penalty(logits, pos2seq, token_ids, token_cnt, penalties),
                               rtol=2e-7, atol=1e-7)


@pytest.mark.parametrize("batch,vocab", SHAPES)
def test_bitmask(kernels, batch, vocab):
    rng = np.random.default_rng(batch * 1000 + vocab + 2)
    logits = rng.standard_normal((batch, vocab)).astype(np.float32)
    row_ids = rng.permutation(batch)[: max(1, batch - 2)].astype(np.int32)
    allowed = rng.random((row_ids.size, vocab)) < 0.4
    allowed[0] = False  # every token of one row masked
    bitmask = ref.pack_bitmask(allowed)
    out = logits.copy()
    kernels(BITMASK, out, row_ids, bitmask)
    expected = ref.apply_bitmask(logits, row_ids, bitmask)
    np.testing.assert_array_equal(out, expected)
    assert np.array_equal(np.isneginf(out), np.isneginf(expected))  # masked means exactly -inf
    assert np.isneginf(out[row_ids[0]]).all()


def test_bitmask_grid_is_rows_by_vocab_blocks(kernels):
    # One block row per masked row (blockIdx.y) and 501 blocks of 256 threads along 128001 tokens. Grids above
    # 65535 blocks in x (folded into z) are covered by test_generic_host_protocol_and_padding_block. (13 rows: 133
    # took 8 s on lavapipe and checked nothing more.)
    batch, vocab = 13, 128001
    rows = 12
    kernel = kernels[BITMASK].kernels[0]
    assert kernel.grid({"num_rows": rows, "vocab": vocab}) == ((vocab + 255) // 256, rows)
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((batch, vocab)).astype(np.float32)
    row_ids = np.arange(1, batch, dtype=np.int32)[::-1].copy()
    allowed = rng.random((rows, vocab)) < 0.5
    bitmask = ref.pack_bitmask(allowed)
    out = logits.copy()
    kernels(BITMASK, out, row_ids, bitmask)
    np.testing.assert_array_equal(out, ref.apply_bitmask(logits, row_ids, bitmask))


def test_kernels_in_sequence_see_each_others_writes(kernels, device):
    batch, vocab = 7, 128001
    rng = np.random.default_rng(11)
    logits = rng.standard_normal((batch, vocab)).astype(np.float32)
    pos2seq, token_ids = _sparse_entries(rng, batch, vocab, 50)
    bias = rng.uniform(-3, 3, pos2seq.size).astype(np.float32)
    token_cnt = rng.integers(0, 3, pos2seq.size).astype(np.int32)
    penalties = np.tile(np.array([[0.5, 0.25, 1.3]], np.float32), (batch, 1))
    row_ids = np.array([6, 0, 3], np.int32)
    bitmask = ref.pack_bitmask(rng.random((3, vocab)) < 0.3)

    gpu_logits = wgsl.GPUArray.from_numpy(device, logits)
    up = [wgsl.GPUArray.from_numpy(device, a) for a in (pos2seq, token_ids, bias, token_cnt, penalties, row_ids,
                                                         bitmask)]
    g_pos, g_tok, g_bias, g_cnt, g_pen, g_rows, g_mask = up
    kernels(BIAS, gpu_logits, g_pos, g_tok, g_bias)
    kernels(PENALTY, gpu_logits, g_pos, g_tok, g_cnt, g_pen)
    kernels(BITMASK, gpu_logits, g_rows, g_mask)
    out = gpu_logits.numpy()

    expected = ref.apply_logit_bias(logits, pos2seq, token_ids, bias)
    expected = ref.apply_penalty(expected, pos2seq, token_ids, token_cnt, penalties)
    expected = ref.apply_bitmask(expected, row_ids, bitmask)
    assert np.array_equal(np.isneginf(out), np.isneginf(expected))
    np.testing.assert_allclose(out, expected, rtol=2e-7, atol=1e-7)


def test_no_entries_launches_nothing(kernels):
    logits = np.ones((3, 33), np.float32)
    empty_i, empty_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    kernels(BIAS, logits, empty_i, empty_i, empty_f)
    assert (logits == 1).all()


# ----------------------------------------------------------------------------------------------------------------
# The host protocol on a kernel without bounds checks: two kernels, blockIdx.y, scalar parameters, a folded grid


@T.prim_func
def _fill_then_gather(var_out: T.handle, var_first: T.handle, var_block_ids: T.handle, scale: T.float32,
                      offset: T.int32):
    T.func_attr({"tirx.noalias": True})
    blocks, size, rows = T.int32(), T.int32(), T.int32()
    out = T.match_buffer(var_out, (size,), "float32")
    first = T.match_buffer(var_first, (rows, 2), "float32")
    block_ids = T.match_buffer(var_block_ids, (blocks,), "int32")
    # kernel 1: no bounds check at all, so a padding block of a folded grid would write past blocks * 32
    for bx in T.thread_binding(blocks, thread="blockIdx.x"):
        for tx in T.thread_binding(32, thread="threadIdx.x"):
            out[bx * 32 + tx] = T.Cast("float32", bx * 32 + tx + offset) * scale
            block_ids[bx] = bx
    # kernel 2 reads what kernel 1 wrote: first[r, y] = out[r * 32 + y]
    for bx in T.thread_binding((rows + 63) // 64, thread="blockIdx.x"):
        for by in T.thread_binding(2, thread="blockIdx.y"):
            for tx in T.thread_binding(64, thread="threadIdx.x"):
                if bx * 64 + tx < rows:
                    first[bx * 64 + tx, by] = out[(bx * 64 + tx) * 32 + by]


def test_generic_host_protocol_and_padding_block(device):
    fill = wgsl.WGSLKernels.from_prim_funcs(device, {"fill": _fill_then_gather})["fill"]
    # kernels are named after the PrimFunc's global symbol, in launch order
    assert [k.name for k in fill.kernels] == ["_fill_then_gather_kernel", "_fill_then_gather_kernel_1"]
    assert [f.name for f in fill.kernels[0].layout.pod_fields] == ["blocks", "offset", "scale", "packGridDimX"]
    assert fill.kernels[1].extents["blockIdx.y"].value == 2
    blocks, rows = 65537, 300  # 65537 blocks fold into 32769 x 1 x 2: one padding block
    size = blocks * 32 + 64
    out = wgsl.GPUArray.from_numpy(device, np.full(size, -1, np.float32))
    first = wgsl.GPUArray.empty(device, (rows, 2), np.float32)
    block_ids = wgsl.GPUArray.from_numpy(device, np.full(blocks, -1, np.int32))
    fill(out, first, block_ids, 0.5, 3)
    got = out.numpy()
    idx = np.arange(blocks * 32, dtype=np.float64)
    np.testing.assert_array_equal(got[: blocks * 32], ((idx + 3) * 0.5).astype(np.float32))
    assert (got[blocks * 32:] == -1).all(), "a padding block of the folded grid ran"
    np.testing.assert_array_equal(block_ids.numpy(), np.arange(blocks, dtype=np.int32))
    np.testing.assert_array_equal(first.numpy(), got[: rows * 32].reshape(rows, 32)[:, :2])


@T.prim_func
def _add_one_1024(var_x: T.handle):
    n = T.int32()
    x = T.match_buffer(var_x, (n,), "float32")
    for bx in T.thread_binding((n + 1023) // 1024, thread="blockIdx.x"):
        for tx in T.thread_binding(1024, thread="threadIdx.x"):
            if bx * 1024 + tx < n:
                x[bx * 1024 + tx] = x[bx * 1024 + tx] + T.float32(1)


def test_1024_threads_need_the_raised_limit(device):
    if device.limits["max-compute-invocations-per-workgroup"] < 1024:
        _skip("the adapter allows fewer than 1024 invocations per workgroup")
    kernels = wgsl.WGSLKernels.from_prim_funcs(device, {"add_one": _add_one_1024})
    assert kernels["add_one"].kernels[0].layout.workgroup_size == (1024, 1, 1)
    x = np.arange(3001, dtype=np.float32)
    kernels("add_one", x)
    np.testing.assert_array_equal(x, np.arange(1, 3002, dtype=np.float32))


@T.prim_func
def _scaled_by_row_sums(var_x: T.handle, var_out: T.handle):
    T.func_attr({"tirx.noalias": True})
    rows, n = T.int32(), T.int32()
    x = T.match_buffer(var_x, (rows, n), "float32")
    out = T.match_buffer(var_out, (rows, n), "float32")
    sums = T.alloc_buffer((rows,), "float32", scope="global")  # a workspace: written by kernel 1, read by kernel 2
    for bx in T.thread_binding(rows, thread="blockIdx.x"):
        for _ in T.thread_binding(1, thread="threadIdx.x"):
            sums[bx] = T.float32(0)
            for i in range(n):
                sums[bx] = sums[bx] + x[bx, i]
    for bx in T.thread_binding(rows, thread="blockIdx.x"):
        for tx in T.thread_binding(64, thread="threadIdx.x"):
            for k in range((n + 63) // 64):
                if k * 64 + tx < n:
                    out[bx, k * 64 + tx] = x[bx, k * 64 + tx] / sums[bx]


def test_a_workspace_carries_values_between_kernels_and_is_kept(device):
    scaled = wgsl.WGSLKernels.from_prim_funcs(device, {"scaled": _scaled_by_row_sums})["scaled"]
    assert [(w.name, w.dtype) for w in scaled.workspaces] == [("sums", "float32")]
    for rows in (3, 2, 9):  # kept for the smaller call, grown for the larger one
        x = np.random.default_rng(rows).random((rows, 100)).astype(np.float32) + 0.5
        out = np.zeros_like(x)
        scaled(x, out)
        np.testing.assert_allclose(out, x / x.sum(axis=1, keepdims=True), rtol=1e-5)
