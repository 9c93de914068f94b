"""The packed kernels of the GGUF block types Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS
(``compile/quant_formats.py``, ``compile/quant_matvec.py``): unpacked and repacked blocks dequantise to gguf-py's
``dequantize`` bit for bit, exact widenings keep every weight, the matmul equals float64 numpy on the activations
rounded as ``quantise_activations`` rounds them (within 1e-5 of the output's scale) on rows not a multiple of 8, a
single row, 1 to 9 and 131 tokens, with 16-bit and 8-bit activation codes; a token's row is bitwise the same
whatever the other tokens; the VNNI tile gives the AVX2 tile's outputs bit for bit, and so does the wide VNNI
tile, and so do the pair tiles that keep one accumulator a token (Q5_K, Q6_K; up to 140 tokens); the lookup
is the dequantised rows exactly; bad shapes and types are refused. The blocks are random bytes
(every code, sub-scale and min pattern) with finite float16 scales."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from kernel_harness import assert_tiles_agree, built_for_cpu
from logitproc.compile.integer_matvec import has_int8_dot
from logitproc.compile.packed_matvec import has_vnni, round_activations
from logitproc.compile.quant_formats import (
    LAYOUTS,
    common_type,
    dequantize_packed,
    dequantize_unpacked,
    pack,
    unpack_gguf,
    unpack_packed,
    widen,
)
from logitproc.compile.quant_matvec import WIDE_TILE, quant_embed_kernel, quant_matmul_kernel, wide_tile
from logitproc.runtime.targets import build_features, resolve_target

TARGET = resolve_target("cpu").tvm_target()
FEATURES = build_features(TARGET)
needs_avx2 = pytest.mark.skipif(not has_int8_dot(FEATURES), reason="this CPU has no AVX2")
#: the AVX2 tile (slow where the VNNI tile runs: test_vnni_tile_gives_the_avx2_tiles_outputs_bit_for_bit covers it)
TILES = [pytest.param(False, marks=[pytest.mark.slow] if has_vnni(FEATURES) else []),
         pytest.param(True, marks=pytest.mark.skipif(not has_vnni(FEATURES), reason="no AVX512-VNNI"))]
TOKENS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 131)  # tiles of 3 or 4, a pair, one; a second span of 128


def random_blocks(ggml: str, rows: int, in_features: int, rng: np.random.Generator) -> np.ndarray:
    """GGUF blocks ``[rows, bytes]`` of random bytes with finite float16 scales (and mins) of a realistic size."""
    layout = LAYOUTS[ggml]
    blocks = in_features // layout.block_weights
    raw = rng.integers(0, 256, (rows, blocks, layout.block_bytes)).astype(np.uint8)

    def f16(at: int, low: float, high: float) -> None:
        raw[..., at: at + 2] = rng.uniform(low, high, (rows, blocks, 1)).astype(np.float16).view(np.uint8)

    if ggml in ("Q4_0", "Q5_0"):
        f16(0, -0.02, 0.02)
    elif ggml == "Q5_1":
        f16(0, 0.001, 0.02)
        f16(2, -0.2, 0.0)
    elif ggml in ("Q4_K", "Q5_K"):
        f16(0, 0.0001, 0.002)
        f16(2, 0.0001, 0.003)
    elif ggml == "Q6_K":
        f16(208, -0.002, 0.002)
    else:  # IQ4_NL, IQ4_XS
        f16(0, -0.002, 0.002)
    return raw.reshape(rows, -1)


def _gguf(ggml: str, raw: np.ndarray) -> np.ndarray:
    return np.asarray(dequantize(raw, GGMLQuantizationType[ggml]), np.float32).reshape(raw.shape[0], -1)


def _build(factory, *args, **kwargs):
    return built_for_cpu(factory, *args, **kwargs)


def _in_features(ggml: str) -> int:
    return 512 if LAYOUTS[ggml].superblock else 96  # two super-blocks; three blocks


@pytest.mark.parametrize("ggml", list(LAYOUTS))
def test_unpacked_and_packed_blocks_dequantise_as_gguf_py_bit_for_bit(ggml: str) -> None:
    rng = np.random.default_rng(0)
    layout = LAYOUTS[ggml]
    for rows, in_features in ((37, _in_features(ggml)), (1, layout.block_weights), (8, 2 * layout.block_weights)):
        raw = random_blocks(ggml, rows, in_features, rng)
        expected = _gguf(ggml, raw).view(np.uint32)
        parts = unpack_gguf(layout, raw)
        np.testing.assert_array_equal(dequantize_unpacked(layout, parts).view(np.uint32), expected)
        packed = pack(layout, parts)
        assert [(k, a.shape, str(a.dtype)) for k, a in packed.items()] == layout.shapes(rows, in_features)
        np.testing.assert_array_equal(dequantize_packed(layout, packed, rows).view(np.uint32), expected)
        for key, array in unpack_packed(layout, packed, rows).items():
            np.testing.assert_array_equal(array, parts[key], err_msg=f"{ggml} {key}")


def test_exact_widenings_keep_every_weight_and_other_mixes_are_not_exact() -> None:
    rng = np.random.default_rng(1)
    for source, target in (("Q4_0", "Q5_0"), ("Q4_0", "Q8_0"), ("Q5_0", "Q8_0"), ("Q4_K", "Q5_K")):
        raw = random_blocks(source, 9, 256, rng)
        np.testing.assert_array_equal(_gguf(target, widen(source, raw, target)), _gguf(source, raw))
    q4_1 = np.concatenate([rng.uniform(0.01, 0.02, (3, 2, 1)).astype(np.float16).view(np.uint8),
                           rng.uniform(-0.1, 0.0, (3, 2, 1)).astype(np.float16).view(np.uint8),
                           rng.integers(0, 256, (3, 2, 16)).astype(np.uint8)], axis=2).reshape(3, -1)
    np.testing.assert_array_equal(_gguf("Q5_1", widen("Q4_1", q4_1, "Q5_1")), _gguf("Q4_1", q4_1))
    assert common_type({"Q5_0", "Q8_0"}) == ("Q8_0", True) and common_type({"Q4_0", "Q5_0"}) == ("Q5_0", True)
    assert common_type({"Q4_K"}) == ("Q4_K", True) and common_type({"Q4_K", "Q5_K"}) == ("Q5_K", True)
    assert not common_type({"Q4_K", "Q6_K"})[1] and not common_type({"Q5_1", "Q8_0"})[1]
    with pytest.raises(ValueError, match="Q6_K blocks cannot be stored as Q5_K"):
        widen("Q6_K", random_blocks("Q6_K", 1, 256, rng), "Q5_K")


def _check_kernel(ggml: str, n_out: int, vnni: bool, xbits: int, rng: np.random.Generator,
                  wide_tokens: int = WIDE_TILE, tokens: tuple[int, ...] = TOKENS) -> dict[int, np.ndarray]:
    layout = LAYOUTS[ggml]
    in_features = _in_features(ggml)
    raw = random_blocks(ggml, n_out, in_features, rng)
    packed = pack(layout, unpack_gguf(layout, raw))
    weights = _gguf(ggml, raw).astype(np.float64)
    run = _build(quant_matmul_kernel, layout, n_out, in_features, xbits=xbits, vnni=vnni, wide_tokens=wide_tokens)
    dev = tvm.cpu()
    arrays = [tvm.runtime.tensor(a, dev) for a in packed.values()]
    x = rng.standard_normal((max(tokens), in_features)).astype(np.float32)
    x[1, :32] = 0.0  # an all-zero block
    x[2, 32:64] = 0.75  # a constant one
    rows = {}
    for n in tokens:
        y = tvm.runtime.tensor(np.full((n, n_out), np.nan, np.float32), dev)
        run(tvm.runtime.tensor(x[:n], dev), *arrays, y)
        expected = round_activations(x[:n], xbits).astype(np.float64) @ weights.T
        np.testing.assert_allclose(y.numpy(), expected, rtol=0, atol=1e-5 * np.abs(expected).max(),
                                   err_msg=f"{ggml} {n_out} rows, {n} tokens")
        rows[n] = y.numpy()
    for n, y in rows.items():  # batch invariance: the first n tokens' rows as in the widest call
        np.testing.assert_array_equal(y, rows[max(tokens)][:n], err_msg=f"{ggml}: {n} tokens")
    return rows


@needs_avx2
@pytest.mark.parametrize("vnni", TILES)
@pytest.mark.parametrize("ggml", list(LAYOUTS))
def test_matmul_matches_numpy_and_is_batch_invariant(ggml: str, vnni: bool) -> None:
    _check_kernel(ggml, 37, vnni, 16, np.random.default_rng(2))


@needs_avx2
@pytest.mark.parametrize("ggml", ["Q5_0", "Q6_K"])
def test_one_row_and_8_bit_activation_codes(ggml: str) -> None:
    _check_kernel(ggml, 1, False, 8, np.random.default_rng(3))


@needs_avx2
@pytest.mark.skipif(not has_vnni(FEATURES), reason="no AVX512-VNNI")
@pytest.mark.parametrize("ggml", ["Q4_K", "Q6_K", "IQ4_XS"])
def test_vnni_tile_gives_the_avx2_tiles_outputs_bit_for_bit(ggml: str) -> None:
    avx2 = _check_kernel(ggml, 21, False, 16, np.random.default_rng(4))
    vnni = _check_kernel(ggml, 21, True, 16, np.random.default_rng(4))
    for n in TOKENS:
        np.testing.assert_array_equal(avx2[n], vnni[n])


@needs_avx2
@pytest.mark.skipif(not has_vnni(FEATURES), reason="no AVX512-VNNI")
@pytest.mark.parametrize("ggml", ["Q4_0", "Q6_K"])
def test_wide_tile_with_8_bit_codes_and_against_the_kernel_without_it(ggml: str) -> None:
    """The VNNI kernel's wide tiles (8 tokens, Q6_K 4; with 16-bit codes every type's batch invariance above already
    compares them with the narrow tiles bit for bit) with 8-bit codes, and against the kernel without them on the
    same tokens (of 5 here, Q6_K 2, so that 1-4 tokens run the narrow tiles only and 13 both). 29 rows: a pair of
    whole row groups (``_pair_tile``), a third whole group alone (``_wide_tile``) and 5 rows."""
    assert wide_tile(True) and not wide_tile(False)
    _check_kernel(ggml, 29, True, 8, np.random.default_rng(6))
    tokens = (1, 4, 5, 13, 131)
    narrow = _check_kernel(ggml, 29, True, 16, np.random.default_rng(7), wide_tokens=0, tokens=tokens)
    wide = _check_kernel(ggml, 29, True, 16, np.random.default_rng(7), wide_tokens=5, tokens=tokens)
    for n in tokens:
        np.testing.assert_array_equal(narrow[n], wide[n], err_msg=f"{ggml}: {n} tokens")


@needs_avx2
@pytest.mark.skipif(not has_vnni(FEATURES), reason="no AVX512-VNNI")
@pytest.mark.parametrize("n_out", [29, 40])
def test_q6_k_pair_tiles_with_the_sub_blocks_in_turn_give_the_same_outputs(n_out: int) -> None:
    """Q6_K's pair tiles of 8 tokens taking a block's two sub-blocks one after the other (``serial_pairs``, the
    default) against pair tiles of 4 taking them side by side: bit for bit, at token counts with a leftover tile
    of 4 (4, 12, 13), without (8, 9, 131) and below a tile (3). 29 rows: a pair, a group alone and 5 rows; 40: two
    pairs and a group."""
    tokens = (3, 4, 8, 9, 12, 13, 131)
    layout, rng = LAYOUTS["Q6_K"], np.random.default_rng(8)
    raw = random_blocks("Q6_K", n_out, 512, rng)
    arrays = [tvm.runtime.tensor(a) for a in pack(layout, unpack_gguf(layout, raw)).values()]
    x = tvm.runtime.tensor(rng.standard_normal((max(tokens), 512)).astype(np.float32))
    outs = {}
    for serial in (True, False):
        run = _build(quant_matmul_kernel, layout, n_out, 512, vnni=True, serial_pairs=serial)
        for n in tokens:
            y = tvm.runtime.tensor(np.full((n, n_out), np.nan, np.float32))
            run(tvm.runtime.tensor(x.numpy()[:n]), *arrays, y)
            outs[serial, n] = y.numpy()
    for n in tokens:
        np.testing.assert_array_equal(outs[True, n].view(np.uint32), outs[False, n].view(np.uint32), err_msg=f"{n}")
        np.testing.assert_array_equal(outs[True, n], outs[True, max(tokens)][:n], err_msg=f"{n} tokens")


@needs_avx2
@pytest.mark.skipif(not has_vnni(FEATURES), reason="no AVX512-VNNI")
@pytest.mark.parametrize("n_out", [8, 16, 24])
@pytest.mark.parametrize("ggml", ["Q5_K", "Q6_K"])
def test_pair_tiles_with_one_accumulator_a_token_give_the_narrow_tiles_outputs(ggml: str, n_out: int) -> None:
    """The pair tiles that keep one accumulator a token (the high plane's sum shifted onto the low plane's: Q6_K's
    serial sub-blocks, Q5_K's whole blocks) against the kernel without wide tiles (``wide_tokens`` 0: the
    narrow tiles only), bit for bit, and against numpy, batch invariant, up to 140 tokens (a second span of 128;
    leftover tiles of 4, 2 and 1): one row group alone (8 rows: no pair), exactly one pair (16) and a pair and a
    group (24)."""
    tokens = (1, 3, 4, 8, 9, 12, 13, 16, 17, 140)
    narrow = _check_kernel(ggml, n_out, True, 16, np.random.default_rng(9), wide_tokens=0, tokens=tokens)
    wide = _check_kernel(ggml, n_out, True, 16, np.random.default_rng(9), tokens=tokens)
    for n in tokens:
        np.testing.assert_array_equal(narrow[n].view(np.uint32), wide[n].view(np.uint32), err_msg=f"{ggml}: {n}")


@needs_avx2
@pytest.mark.skipif(not has_vnni(FEATURES), reason="no AVX512-VNNI")
@pytest.mark.parametrize("ggml", list(LAYOUTS))
def test_calls_of_a_few_tokens_on_pair_tiles_give_the_narrow_tiles_outputs(ggml: str) -> None:
    """Calls of 1 to 7 tokens run pair tiles of 3, 2 and 1 tokens on the pairs of whole row groups (``few_pairs``,
    the default), prefetching some blocks ahead (``prefetch``: by default more than these rows' blocks, so past a
    pair's end into the next pair's and clamped at the last pair; 3; none): bit for bit the kernel without them
    (one token there: the narrow tile on both groups of a pair, ``_tile_both``), for every type, 8- and 16-bit
    codes; 40 rows: two pairs and a group alone."""
    layout, rng = LAYOUTS[ggml], np.random.default_rng(10)
    in_features = _in_features(ggml)
    arrays = [tvm.runtime.tensor(a) for a in pack(layout, unpack_gguf(
        layout, random_blocks(ggml, 40, in_features, rng))).values()]
    x = rng.standard_normal((7, in_features)).astype(np.float32)
    kinds = {"pairs": {}, "pairs, prefetch 3": {"prefetch": 3}, "pairs, no prefetch": {"prefetch": 0},
             "narrow": {"few_pairs": False}}
    for xbits in (16, 8):
        outs = {}
        for kind, options in kinds.items():
            run = _build(quant_matmul_kernel, layout, 40, in_features, xbits=xbits, vnni=True, **options)
            for n in range(1, 8):
                y = tvm.runtime.tensor(np.full((n, 40), np.nan, np.float32))
                run(tvm.runtime.tensor(x[:n]), *arrays, y)
                outs[kind, n] = y.numpy()
        assert_tiles_agree(outs, list(kinds), range(1, 8), f"{ggml} {xbits}-bit")


@pytest.mark.parametrize("ggml", list(LAYOUTS))
def test_lookup_gives_the_dequantised_rows_exactly(ggml: str) -> None:
    rng = np.random.default_rng(5)
    layout = LAYOUTS[ggml]
    vocab, hidden = 21, _in_features(ggml)
    raw = random_blocks(ggml, vocab, hidden, rng)
    packed = pack(layout, unpack_gguf(layout, raw))
    ids = np.array([0, 20, 7, 8, 7], np.int32)
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.full((len(ids), hidden), np.nan, np.float32), dev)
    _build(quant_embed_kernel, layout, vocab, hidden)(
        tvm.runtime.tensor(ids, dev), *[tvm.runtime.tensor(a, dev) for a in packed.values()], out)
    np.testing.assert_array_equal(out.numpy().view(np.uint32), _gguf(ggml, raw)[ids].view(np.uint32))


def test_bad_shapes_and_types_are_refused() -> None:
    with pytest.raises(ValueError, match="Q4_K weights need in_features a positive multiple of 256"):
        quant_matmul_kernel(LAYOUTS["Q4_K"], 8, 576)
    with pytest.raises(ValueError, match="Q5_0 weights need in_features a positive multiple of 32"):
        quant_matmul_kernel(LAYOUTS["Q5_0"], 8, 40)
    with pytest.raises(ValueError, match="x_dtype must be float32 or float16"):
        quant_matmul_kernel(LAYOUTS["Q6_K"], 8, 256, "int8")
    with pytest.raises(ValueError, match="activation bits must be one of"):
        quant_matmul_kernel(LAYOUTS["Q6_K"], 8, 256, xbits=4)
    with pytest.raises(ValueError, match="wide_tokens must be 0 to 128, got 129"):
        quant_matmul_kernel(LAYOUTS["Q4_0"], 8, 256, wide_tokens=129)
    with pytest.raises(ValueError, match="prefetch must be 0 or more blocks, got -1"):
        quant_matmul_kernel(LAYOUTS["Q4_0"], 8, 256, prefetch=-1)
    with pytest.raises(ValueError, match="whole blocks of 210 bytes"):
        unpack_gguf(LAYOUTS["Q6_K"], np.zeros((2, 200), np.uint8))
