"""The packed Q4_1 matmuls (``quant_formats.Q4_1`` run by ``compile/quant_matvec.py``) and the packed Q8_0 head
(``compile/packed_matvec.py``). Q4_1: the repacked layout holds the GGUF's weights (gguf-py's ``dequantize`` bit
for bit, and read as the module doc describes it), the kernel equals float64 numpy on activations rounded as
``quantise_activations`` rounds them (its integer sums are exact, so only float rounding differs: within 1e-6 of the
output's scale), with 8-bit codes and with 16-bit codes (two int8 planes), in the AVX2 tile and (on CPUs with
AVX512-VNNI) the VNNI tiles; a token's row is bitwise the same whatever the other tokens (narrow, wide and pair
tiles); the VNNI kernel gives the AVX2 kernel's outputs bit for bit, with and without its wide tiles, and so does
the AVX2 kernel built for a CPU without AVX-512 (``mcpu=haswell``); float16 inputs
and outputs are the float32 sums rounded once; awkward shapes: rows not a multiple of the 8-row group, one and an
odd number of blocks, 1 to 9 tokens and a span of 128 crossed, all-zero and constant activation blocks, the extreme
codes 0 and 15. The packed Q8_0 layout holds the GGUF's weights (read as ``pack_q8_0`` describes it: pairs of row
groups interleaved); its kernel (VNNI only) equals numpy likewise, its pair tiles give the narrow tiles' outputs bit
for bit at 1-17 tokens with and without the prefetch, and its lookup the GGUF layout's bit for bit."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tvm
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from kernel_harness import assert_tiles_agree, built_for_cpu, compiled_for_cpu
from logitproc.compile.integer_matvec import has_int8_dot
from logitproc.compile.linear_kernels import embed_kernel
from logitproc.compile.packed_matvec import (
    has_vnni,
    pack_q8_0,
    packed_q8_0_embed_kernel,
    packed_q8_0_kernel,
    packed_q8_0_shapes,
    quantise_activations,
)
from logitproc.compile.quant_formats import Q4_1, dequantize_packed, pack, unpack_gguf, unpack_packed
from logitproc.compile.quant_matvec import quant_matmul_kernel
from logitproc.runtime.targets import build_features, resolve_target

TARGET = resolve_target("cpu").tvm_target()
pytestmark = pytest.mark.skipif(not has_int8_dot(build_features(TARGET)), reason="this CPU has no AVX2")
VNNI = pytest.mark.skipif(not has_vnni(build_features(TARGET)), reason="this CPU has no AVX512-VNNI")
#: the Q4_1 kernel's tiles: AVX2 (every CPU with AVX2; what CPUs without AVX512-VNNI run) and VNNI
TILES = [pytest.param(False, id="avx2"), pytest.param(True, id="vnni", marks=VNNI)]

#: (out, in): a SmolLM2 shape, rows below and not a multiple of the group of 8, 1 and 3 blocks
SHAPES = [(960, 576), (37, 96), (5, 32), (8, 64)]
TOKENS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 131)  # tiles of 3 or 4, a pair, one; a wide tile (8); a second span of 128


def _build(factory, *args, **kwargs):
    return built_for_cpu(factory, *args, **kwargs)


def _q4_1(*args, **kwargs):
    """The Q4_1 kernel (``quant_matmul_kernel(Q4_1, ...)``) compiled for this CPU."""
    return _build(quant_matmul_kernel, Q4_1, *args, **kwargs)


def _weights(n_out: int, n_in: int, rng: np.random.Generator):
    """GGUF Q4_1 blocks ``[n_out, n_in / 32 * 20]`` (the extreme nibbles in the first row) and the dense float64
    matrix they hold."""
    blocks = n_in // 32
    raw = rng.integers(0, 256, (n_out, blocks, 20)).astype(np.uint8)
    raw[0, :, 4:] = 0xF0  # weights 0 (low nibbles) and 15 (high nibbles)
    scales = rng.uniform(0.001, 0.02, (n_out, blocks)).astype(np.float16)
    mins = rng.uniform(-0.15, 0.0, (n_out, blocks)).astype(np.float16)
    raw[:, :, 0:2], raw[:, :, 2:4] = scales[..., None].view(np.uint8), mins[..., None].view(np.uint8)
    q = np.concatenate([raw[:, :, 4:] & 15, raw[:, :, 4:] >> 4], axis=2)
    dense = (q * scales[:, :, None].astype(np.float64) + mins[:, :, None]).reshape(n_out, n_in)
    return raw.reshape(n_out, -1), dense


def _packed(raw: np.ndarray) -> dict[str, np.ndarray]:
    return pack(Q4_1, unpack_gguf(Q4_1, raw))


def _arrays(raw: np.ndarray) -> list:
    return [tvm.runtime.tensor(a) for a in _packed(raw).values()]


def _unpack(packed: dict[str, np.ndarray], n_out: int, n_in: int) -> np.ndarray:
    """The dense float64 matrix a packed layout holds, read as ``quant_formats``' module doc describes it."""
    blocks = n_in // 32
    # [g // 2, b, v, g % 2, r, j]: the pairs of row groups interleave runs of 32 bytes -> [g, b, v, r, j]
    codes = packed["codes"].reshape(-1, blocks, 4, 2, 8, 4).transpose(0, 3, 1, 2, 4, 5).reshape(-1, blocks, 4, 8, 4)
    q = np.concatenate([codes & 15, codes >> 4], axis=4)  # [g, b, v, r, 8]: weights 8 v + (0..3 low, 4..7 high)
    q = q.transpose(0, 3, 1, 2, 4).reshape(-1, n_in)
    def rows(a):  # [g // 2, b, g % 2, r] -> [g * 8 + r, k]
        a = a.reshape(-1, blocks, 2, 8).transpose(0, 2, 3, 1).reshape(-1, blocks)
        return np.repeat(a.astype(np.float64), 32, axis=1)
    return (q * rows(packed["d"]) + rows(packed["m"]))[:n_out]


def test_the_packed_layout_holds_the_gguf_weights() -> None:
    rng = np.random.default_rng(0)
    for n_out, n_in in SHAPES:
        raw, dense = _weights(n_out, n_in, rng)
        parts = unpack_gguf(Q4_1, raw)
        packed = pack(Q4_1, parts)
        assert [(k, a.shape, str(a.dtype)) for k, a in packed.items()] == Q4_1.shapes(n_out, n_in)
        np.testing.assert_array_equal(_unpack(packed, n_out, n_in), dense)
        gguf = np.asarray(dequantize(raw, GGMLQuantizationType.Q4_1), np.float32).reshape(n_out, n_in)
        np.testing.assert_array_equal(dequantize_packed(Q4_1, packed, n_out).view(np.uint32), gguf.view(np.uint32))
        for key, array in unpack_packed(Q4_1, packed, n_out).items():
            np.testing.assert_array_equal(array, parts[key], err_msg=key)


def test_quantise_activations_rounds_blocks_to_127_steps() -> None:
    x = np.zeros((2, 64), np.float32)
    x[0, :32] = np.linspace(-2, 1, 32)
    x[1, 32:] = 3.0  # a constant block; the others all zero
    q, d = quantise_activations(x)
    assert q.dtype == np.int8 and d.dtype == np.float32
    assert q[0, 0] == -127 and q[1, 32] == 127 and not q[0, 32:].any() and not q[1, :32].any()
    assert d[0, 0] == np.float32(2) / np.float32(127) and d[0, 1] == 0
    assert np.abs(q[0, :32] * d[0, 0] - x[0, :32]).max() <= d[0, 0] / 2
    q16, d16 = quantise_activations(x, 16)
    assert q16[0, 0] == -32512 and q16[1, 32] == 32512 and d16[0, 0] == np.float32(2) / np.float32(32512)
    assert np.abs(q16[0, :32] * d16[0, 0] - x[0, :32]).max() <= d16[0, 0] / 2


@pytest.mark.parametrize("vnni", TILES)
@pytest.mark.parametrize("xbits", [8, 16])
def test_q4_1_kernel_matches_numpy_on_the_rounded_activations(xbits: int, vnni: bool) -> None:
    rng = np.random.default_rng(1)
    for n_out, n_in in SHAPES if xbits == 16 else SHAPES[1:3]:  # the default codes also on SmolLM2's shape
        run = _q4_1(n_out, n_in, xbits=xbits, vnni=vnni)
        raw, dense = _weights(n_out, n_in, rng)
        weights = _arrays(raw)
        for n in TOKENS:
            x = rng.standard_normal((n, n_in)).astype(np.float32) * rng.uniform(0.1, 10, (n, 1)).astype(np.float32)
            x[0, :32] = 0  # an all-zero block: scale 0, codes 0
            x[-1, -32:] = 1.5  # a constant block
            xq, xd = quantise_activations(x, xbits)
            rounded = (xq.reshape(n, -1, 32) * xd[:, :, None].astype(np.float64)).reshape(n, n_in)
            expected = rounded @ dense.T
            y = tvm.runtime.tensor(np.full((n, n_out), np.nan, np.float32))
            run(tvm.runtime.tensor(x), *weights, y)
            np.testing.assert_allclose(y.numpy(), expected, rtol=0, atol=1e-6 * np.abs(expected).max(),
                                       err_msg=f"{n_out}x{n_in}, {n} tokens")


def _assert_rows_independent(run, weights: list, x: np.ndarray, n_out: int) -> None:
    """The first n rows of ``run`` on ``x[:n]`` are bitwise those on all of ``x`` (every tile and span)."""
    rows = {}
    for n in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 25, len(x)):
        y = tvm.runtime.tensor(np.zeros((n, n_out), np.float32))
        run(tvm.runtime.tensor(x[:n]), *weights, y)
        rows[n] = y.numpy()
    for n, y in rows.items():
        np.testing.assert_array_equal(y, rows[len(x)][:n], err_msg=f"{n} tokens")


@pytest.mark.parametrize("vnni", TILES)
@pytest.mark.parametrize("xbits", [8, 16])
@pytest.mark.parametrize("n_out", [37, 29])
def test_a_tokens_q4_1_row_does_not_depend_on_the_other_tokens(n_out: int, xbits: int, vnni: bool) -> None:
    """37 rows: two pairs of whole row groups (the VNNI kernel's pair tiles) and 5 rows; 29: one pair, a whole group
    alone (its wide tile) and 5 rows; 140 tokens: a second span of 128."""
    rng = np.random.default_rng(2)
    n_in = 96
    run = _q4_1(n_out, n_in, xbits=xbits, vnni=vnni)
    _assert_rows_independent(run, _arrays(_weights(n_out, n_in, rng)[0]),
                             rng.standard_normal((140, n_in)).astype(np.float32), n_out)


@VNNI
@pytest.mark.parametrize("xbits", [8, 16])
def test_the_vnni_kernel_gives_the_avx2_kernels_outputs_bit_for_bit(xbits: int) -> None:
    """vpdpbusd adds each row's 4 products into its int32 lane: the int32 block sums of vpmaddubsw, the int16
    additions and vpmaddwd, so the same floats after them (every shape, tile tail and span; extreme codes and an
    all-zero block among the activations), with the wide and pair tiles and without them (``wide_tokens=0``)."""
    rng = np.random.default_rng(5)
    for n_out, n_in in SHAPES:
        weights = _arrays(_weights(n_out, n_in, rng)[0])
        runs = [_q4_1(n_out, n_in, xbits=xbits, vnni=False),
                _q4_1(n_out, n_in, xbits=xbits, vnni=True),
                _q4_1(n_out, n_in, xbits=xbits, vnni=True, wide_tokens=0)]
        for n in TOKENS:
            x = (rng.standard_normal((n, n_in)) * rng.uniform(0.01, 100, (n, 1))).astype(np.float32)
            x[0, :32] = 0.0
            outs = []
            for run in runs:
                y = tvm.runtime.tensor(np.zeros((n, n_out), np.float32))
                run(tvm.runtime.tensor(x), *weights, y)
                outs.append(y.numpy().view(np.uint32))
            for out in outs[1:]:
                np.testing.assert_array_equal(out, outs[0], err_msg=f"{n_out}x{n_in}, {n} tokens, {xbits}-bit")


def test_the_avx2_kernel_built_without_avx512_gives_this_cpus_outputs() -> None:
    """A CPU with AVX2 but no AVX-512 (``mcpu=haswell``: no AVX512-VNNI, so no wide or pair tiles) runs the AVX2
    tile: built for that target it gives, bit for bit, the kernel built for this CPU (here, where it has AVX512-VNNI,
    the VNNI tiles), at every tile tail, a wide tile's count and a second span."""
    haswell = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
    assert not has_vnni(build_features(haswell)) and has_int8_dot(build_features(haswell))
    rng = np.random.default_rng(6)
    n_out, n_in = 37, 96
    weights = _arrays(_weights(n_out, n_in, rng)[0])
    avx2 = compiled_for_cpu(quant_matmul_kernel(Q4_1, n_out, n_in), haswell)
    here = _q4_1(n_out, n_in, vnni=has_vnni(build_features(TARGET)))
    x = rng.standard_normal((140, n_in)).astype(np.float32)
    for n in (1, 2, 3, 8, 9, 17, 140):
        outs = []
        for run in (avx2, here):
            y = tvm.runtime.tensor(np.full((n, n_out), np.nan, np.float32))
            run(tvm.runtime.tensor(x[:n]), *weights, y)
            outs.append(y.numpy().view(np.uint32))
        np.testing.assert_array_equal(outs[0], outs[1], err_msg=f"{n} tokens")


@pytest.mark.parametrize("vnni", TILES)
def test_float16_inputs_and_outputs_are_the_float32_sums_rounded_once(vnni: bool) -> None:
    x_dtype = y_dtype = "float16"
    rng = np.random.default_rng(3)
    n_out, n_in = 37, 96
    f32, mixed = (_q4_1(n_out, n_in, *types, vnni=vnni)
                  for types in (("float32", "float32"), (x_dtype, y_dtype)))
    weights = _arrays(_weights(n_out, n_in, rng)[0])
    for n in (1, 6, 9):
        x = rng.standard_normal((n, n_in)).astype(x_dtype)
        want = tvm.runtime.tensor(np.zeros((n, n_out), np.float32))
        f32(tvm.runtime.tensor(x.astype(np.float32)), *weights, want)
        got = tvm.runtime.tensor(np.full((n, n_out), np.nan, y_dtype))
        mixed(tvm.runtime.tensor(x), *weights, got)
        np.testing.assert_array_equal(got.numpy(), want.numpy().astype(y_dtype), err_msg=f"{n} tokens")


@pytest.mark.parametrize("factory", [functools.partial(quant_matmul_kernel, Q4_1), packed_q8_0_kernel])
def test_bad_shapes_and_types_are_refused(factory) -> None:
    with pytest.raises(ValueError, match="in_features a positive multiple of 32, got (48|\\[8, 48\\])"):
        factory(8, 48)
    with pytest.raises(ValueError, match="y_dtype must be float32 or float16, got 'bfloat16'"):
        factory(8, 64, "float32", "bfloat16")
    with pytest.raises(ValueError, match=r"activation bits must be one of \(8, 16\), got 4"):
        factory(8, 64, xbits=4)


def test_the_reference_rounds_the_layer_inputs_as_the_kernels_do() -> None:
    """``NumpyLlama(activation_bits=...)``: 16-bit codes move the tiny model's logits (4e-4) a hundredth as much as
    8-bit ones (0.13); other bits are refused, as by ``compile_model``."""
    from logitproc.compile.model_compile import compile_model
    from logitproc.compile.tiny_model import make_tiny_model
    from logitproc.serve.numpy_llama import NumpyLlama

    tiny = make_tiny_model()
    prompt = list(range(3, 40))
    exact = NumpyLlama(tiny).prefill(prompt)
    moved = {bits: np.abs(NumpyLlama(tiny, activation_bits=bits).prefill(prompt) - exact).max() for bits in (8, 16)}
    assert moved[16] < moved[8] / 100 and moved[8] < 0.2 * np.abs(exact).max(), moved
    with pytest.raises(ValueError, match="activation_bits 4 is not supported"):
        NumpyLlama(tiny, activation_bits=4)
    with pytest.raises(ValueError, match="activation_bits 4 is not supported"):
        compile_model(tiny, activation_bits=4)


def _q8_0(n_out: int, n_in: int, rng: np.random.Generator):
    """GGUF Q8_0 arrays (the extreme codes -128 and 127 in the first rows) and the dense float64 matrix."""
    codes = rng.integers(-128, 128, (n_out, n_in)).astype(np.int8)
    codes[0, :] = -128
    codes[min(1, n_out - 1), :32] = 127
    scales = rng.uniform(0.001, 0.02, (n_out, n_in // 32)).astype(np.float16)
    return codes, scales, codes * np.repeat(scales.astype(np.float64), 32, axis=1)


def _unpack_q8_0(packed: dict[str, np.ndarray], n_out: int, n_in: int) -> np.ndarray:
    """The dense float64 matrix a packed Q8_0 layout holds, read as ``pack_q8_0``'s doc describes it."""
    blocks = n_in // 32
    # [g // 2, b, v, g % 2, r, j]: the pairs of row groups interleave runs of 32 bytes -> [g, r, b, v, j]
    codes = packed["codes"].reshape(-1, blocks, 8, 2, 8, 4).transpose(0, 3, 4, 1, 2, 5).reshape(-1, n_in)
    scales = packed["scales"].reshape(-1, blocks, 2, 8).transpose(0, 2, 3, 1).reshape(-1, blocks)
    w = (codes.astype(np.float64) - 128) * np.repeat(scales.astype(np.float64), 32, axis=1)
    assert not w[n_out:].any()  # the padding rows: zero weights
    return w[:n_out]


def test_the_packed_q8_0_layout_holds_the_gguf_weights() -> None:
    """Rows in pairs of 8-row groups, interleaved (one group, part of one, a pair and a half, two pairs)."""
    rng = np.random.default_rng(11)
    for n_out, n_in in [(8, 64), (5, 32), (37, 96), (32, 32)]:
        codes, scales, dense = _q8_0(n_out, n_in, rng)
        packed = pack_q8_0(codes, scales)
        assert [(k, a.shape, str(a.dtype)) for k, a in packed.items()] == packed_q8_0_shapes(n_out, n_in)
        np.testing.assert_array_equal(_unpack_q8_0(packed, n_out, n_in), dense)


@VNNI
@pytest.mark.parametrize("xbits", [8, 16])
def test_packed_q8_0_matches_numpy_on_the_rounded_activations(xbits: int) -> None:
    rng = np.random.default_rng(7)
    for n_out, n_in in [(49152, 576), *SHAPES[1:]]:
        codes, scales, dense = _q8_0(n_out, n_in, rng)
        weights = [tvm.runtime.tensor(a) for a in pack_q8_0(codes, scales).values()]
        run = _build(packed_q8_0_kernel, n_out, n_in, xbits=xbits)
        for n in TOKENS if n_out < 1000 else (1, 6, 131):
            x = (rng.standard_normal((n, n_in)) * rng.uniform(0.01, 100, (n, 1))).astype(np.float32)
            x[0, :32] = 0.0
            y = tvm.runtime.tensor(np.zeros((n, n_out), np.float32))
            run(tvm.runtime.tensor(x), *weights, y)
            xq, xd = quantise_activations(x, xbits)
            rounded = (xq.reshape(n, -1, 32).astype(np.float64) * xd[:, :, None]).reshape(n, n_in)
            ref = rounded @ dense.T
            err = np.abs(y.numpy() - ref).max() / max(np.abs(ref).max(), 1e-30)
            assert err < 1e-6, (n_out, n_in, n, err)


@VNNI
@pytest.mark.parametrize("n_out", [37, 29])
def test_packed_q8_0_rows_do_not_depend_on_the_other_tokens(n_out: int) -> None:
    """37 rows: two pairs of whole row groups (the pair tiles) and 5 rows; 29: one pair, a whole group alone."""
    rng = np.random.default_rng(8)
    n_in = 96
    codes, scales, _ = _q8_0(n_out, n_in, rng)
    weights = [tvm.runtime.tensor(a) for a in pack_q8_0(codes, scales).values()]
    run = _build(packed_q8_0_kernel, n_out, n_in)
    _assert_rows_independent(run, weights, rng.standard_normal((140, n_in)).astype(np.float32), n_out)


@VNNI
def test_the_packed_q8_0_lookup_gives_the_gguf_layouts_rows() -> None:
    rng = np.random.default_rng(9)
    for n_out, n_in in [(1003, 64), (5, 32)]:
        codes, scales, _ = _q8_0(n_out, n_in, rng)
        ids = tvm.runtime.tensor(np.array([0, 1, n_out - 1, n_out // 2, 4 % n_out, 0], np.int32))
        outs = []
        for kernel, arrays in ((packed_q8_0_embed_kernel(n_out, n_in), pack_q8_0(codes, scales).values()),
                               (embed_kernel(n_out, n_in, "q8_0"), (codes, scales))):
            out = tvm.runtime.tensor(np.zeros((6, n_in), np.float32))
            compiled_for_cpu(kernel, TARGET)(ids, *[tvm.runtime.tensor(a) for a in arrays], out)
            outs.append(out.numpy())
        np.testing.assert_array_equal(outs[0], outs[1])


@VNNI
@pytest.mark.parametrize("xbits", [8, 16])
@pytest.mark.parametrize("n_out", [40, 29])
def test_calls_of_a_few_packed_q8_0_tokens_on_pair_tiles_give_the_narrow_tiles_outputs(n_out: int, xbits: int) -> None:
    """Calls of 1 to 7 tokens run one pair tile of all their tokens on each pair of whole row groups (``few_pairs``,
    the default), prefetching some blocks ahead (``prefetch``: by default more than these rows' blocks, so past a
    pair's end into the next pair's and clamped at the last pair; 1; none): bit for bit the kernel without them (the
    narrow tiles on each group), 8- and 16-bit codes; 40 rows: two pairs and a group alone; 29: one pair, a whole
    group alone and part of one. 8 to 17 tokens (tiles of 8, the rest in one pair tile, the first pass over a pair
    prefetching): the same outputs at every distance, and a token's row the same at every token count."""
    rng = np.random.default_rng(10)
    n_in = 96
    codes, scales, _ = _q8_0(n_out, n_in, rng)
    weights = [tvm.runtime.tensor(a) for a in pack_q8_0(codes, scales).values()]
    x = (rng.standard_normal((17, n_in)) * rng.uniform(0.01, 100, (17, 1))).astype(np.float32)
    x[0, :32] = 0.0
    kinds = {"pairs": {}, "pairs, prefetch 1": {"prefetch": 1}, "pairs, no prefetch": {"prefetch": 0},
             "narrow": {"few_pairs": False}}
    outs = {}
    for kind, options in kinds.items():
        run = _build(packed_q8_0_kernel, n_out, n_in, xbits=xbits, **options)
        for n in range(1, 18):
            y = tvm.runtime.tensor(np.full((n, n_out), np.nan, np.float32))
            run(tvm.runtime.tensor(x[:n]), *weights, y)
            outs[kind, n] = y.numpy()
    assert_tiles_agree(outs, list(kinds), range(1, 18), f"{xbits}-bit")
