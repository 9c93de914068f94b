"""The public API on the caller's own arrays: numpy and torch CPU logits processed in place without a copy, and
the arrays the kernels cannot address (strided, transposed, read-only, misaligned) staged once, correctly."""

from __future__ import annotations

import numpy as np
import pytest
from logitproc import GenerationConfig, LogitProcessor, RequestState, Sampler
from logitproc.runtime import logits_io
from pipeline_reference import process_row

V = 1003  # not a multiple of 32: rows of a C-contiguous array start at every multiple of 4 bytes
CONFIGS = [
    GenerationConfig(temperature=0.8, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3,
                     repetition_penalty=1.2, logit_bias={3: 5.0, 17: -2.0}, seed=1),
    GenerationConfig(temperature=0.0, repetition_penalty=1.5, logit_bias={9: 1.5}),
    GenerationConfig(temperature=1.2, top_k=20, frequency_penalty=0.7, seed=2),
]
PROMPT, OUTPUT = (5, 6, 7, 5), (9, 9, 11)


def make_states() -> list[RequestState]:
    states = []
    for cfg in CONFIGS:
        state = RequestState(PROMPT, cfg)
        for t in OUTPUT:
            state.append_token(t)
        states.append(state)
    return states


def expected_logits(logits: np.ndarray) -> np.ndarray:
    return np.stack([process_row(row, cfg, PROMPT, OUTPUT)[0] for row, cfg in zip(logits, CONFIGS, strict=True)])


def fresh_logits(seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((len(CONFIGS), V)) * 3).astype(np.float32)


def at_offset(values: np.ndarray, byte_offset: int) -> np.ndarray:
    """A C-contiguous float32 copy of ``values`` whose data starts ``byte_offset`` bytes past a 64-byte boundary."""
    raw = logits_io.empty_aligned((values.nbytes + 128,), "uint8")
    array = raw[byte_offset:byte_offset + values.nbytes].view(np.float32).reshape(values.shape)
    array[...] = values
    return array


@pytest.fixture(scope="module")
def runtime(lib):
    return LogitProcessor(lib, V, 8), Sampler(lib, V, 8)


@pytest.fixture()
def copies(monkeypatch):
    """Counts the runtime's copies of host arrays (calls of the real ``logits_io.copy_host``)."""
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    real = logits_io.copy_host

    def counting(dst: np.ndarray, src: np.ndarray) -> None:
        calls.append((dst.shape, src.shape))
        real(dst, src)

    monkeypatch.setattr(logits_io, "copy_host", counting)
    return calls


@pytest.mark.parametrize("byte_offset", [0, 4, 16, 36])
def test_numpy_logits_processed_in_place_without_a_copy(runtime, copies, byte_offset):
    proc, sampler = runtime
    base = fresh_logits()
    logits = at_offset(base, byte_offset)
    assert logits.ctypes.data % 64 == byte_offset
    address = logits.ctypes.data
    proc.inplace_update_logits(logits, make_states())
    np.testing.assert_allclose(logits, expected_logits(base), rtol=1e-6, atol=1e-6)
    probs = proc.compute_probs_from_logits(logits, make_states())
    result = sampler.sample_from_logits(logits, make_states())
    assert copies == []
    assert logits.ctypes.data == address
    assert np.isclose(probs.sum(axis=1), 1.0, atol=1e-4).all()
    assert result.token_ids[1] == int(np.argmax(expected_logits(base)[1]))


def test_numpys_own_allocation_and_a_slice_of_rows_are_used_in_place(runtime, copies):
    proc, _ = runtime
    whole = np.concatenate([fresh_logits(1), fresh_logits(2)])  # numpy's allocator: 16-byte aligned in general
    expected = whole.copy()
    part = whole[3:]  # starts 3 * 1003 * 4 bytes in: 4-byte aligned only
    proc.inplace_update_logits(part, make_states())
    np.testing.assert_allclose(whole[3:], expected_logits(expected[3:]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(whole[:3], expected[:3])  # the rows before the slice are untouched
    assert copies == []


def test_torch_cpu_tensor_processed_in_place_without_a_copy(runtime, copies):
    torch = pytest.importorskip("torch")
    proc, sampler = runtime
    base = fresh_logits()
    logits = torch.from_numpy(base.copy())
    pointer = logits.data_ptr()
    proc.inplace_update_logits(logits, make_states())
    np.testing.assert_allclose(logits.numpy(), expected_logits(base), rtol=1e-6, atol=1e-6)
    probs = proc.compute_probs_from_logits(logits, make_states())
    assert isinstance(probs, np.ndarray) and np.isclose(probs.sum(axis=1), 1.0, atol=1e-4).all()
    from_torch = sampler.sample_from_logits(logits, make_states())
    from_numpy = sampler.sample_from_logits(logits.numpy().copy(), make_states())
    np.testing.assert_array_equal(from_torch.token_ids, from_numpy.token_ids)  # same seeds, same tokens
    assert logits.data_ptr() == pointer
    assert copies == []


def test_torch_tensor_needing_gradients_is_refused(runtime):
    torch = pytest.importorskip("torch")
    proc, _ = runtime
    logits = torch.zeros((len(CONFIGS), V), requires_grad=True)
    with pytest.raises(TypeError, match="detach"):
        proc.inplace_update_logits(logits, make_states())


@pytest.mark.parametrize("layout", ["every_other_row", "transposed", "column_slice", "float32_at_odd_byte"])
def test_arrays_the_kernels_cannot_address_are_staged_once_and_written_back(runtime, copies, layout):
    proc, sampler = runtime
    base = fresh_logits()
    if layout == "every_other_row":
        holder = np.zeros((2 * len(CONFIGS), V), np.float32)
        holder[::2] = base
        logits = holder[::2]
    elif layout == "transposed":
        holder = np.ascontiguousarray(base.T)
        logits = holder.T
    elif layout == "column_slice":
        holder = np.zeros((len(CONFIGS), V + 5), np.float32)
        holder[:, 2:V + 2] = base
        logits = holder[:, 2:V + 2]
    else:  # float32 data 2 bytes past a boundary: no float32 kernel may address it
        logits = at_offset(base, 2)
        holder = logits
    assert not logits.flags.c_contiguous or logits.ctypes.data % 4
    proc.inplace_update_logits(logits, make_states())
    np.testing.assert_allclose(logits, expected_logits(base), rtol=1e-6, atol=1e-6)
    assert len(copies) == 2  # in, then back into the caller's array
    if layout == "every_other_row":
        np.testing.assert_array_equal(holder[1::2], 0.0)  # the rows between are untouched
    if layout == "column_slice":
        np.testing.assert_array_equal(holder[:, :2], 0.0)
        np.testing.assert_array_equal(holder[:, V + 2:], 0.0)
    copies.clear()
    result = sampler.sample_from_logits(logits, make_states())  # reads only: one copy in, none back
    assert len(copies) == 1
    assert result.token_ids[1] == int(np.argmax(expected_logits(base)[1]))


def test_torch_non_contiguous_tensor_is_staged_and_written_back(runtime, copies):
    torch = pytest.importorskip("torch")
    proc, _ = runtime
    base = fresh_logits()
    logits = torch.from_numpy(np.ascontiguousarray(base.T)).t()
    assert not logits.is_contiguous()
    proc.inplace_update_logits(logits, make_states())
    np.testing.assert_allclose(logits.numpy(), expected_logits(base), rtol=1e-6, atol=1e-6)
    assert len(copies) == 2


def test_read_only_logits_are_refused_in_place_and_read_with_one_copy(runtime, copies):
    proc, sampler = runtime
    base = fresh_logits()
    logits = base.copy()
    logits.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        proc.inplace_update_logits(logits, make_states())
    np.testing.assert_array_equal(logits, base)
    result = sampler.sample_from_logits(logits, make_states())  # nothing written: a read-only array is fine
    probs = proc.compute_probs_from_logits(logits, make_states())
    assert len(copies) == 2  # one copy in for each call, none back
    assert result.token_ids[1] == int(np.argmax(base[1]))
    assert np.isclose(probs.sum(axis=1), 1.0, atol=1e-4).all()


def test_staged_probs_through_the_sampler(runtime, copies):
    proc, sampler = runtime
    states = make_states()
    probs = proc.compute_probs_from_logits(fresh_logits(), states).copy()
    strided = np.zeros((len(CONFIGS), 2 * V), np.float32)
    strided[:, ::2] = probs
    kept = sampler.renormalize(strided[:, ::2], states)
    np.testing.assert_allclose(kept, sampler.renormalize(probs, states), rtol=1e-6, atol=1e-7)
    assert len(copies) == 1  # the strided probabilities staged once (renormalize writes its own buffer)


def test_other_objects_are_refused_with_the_accepted_types(runtime):
    proc, _ = runtime
    with pytest.raises(TypeError, match="__dlpack__"):
        proc.inplace_update_logits([[0.0] * V] * len(CONFIGS), make_states())
    with pytest.raises(TypeError, match="float32"):
        proc.inplace_update_logits(fresh_logits().astype(np.float64), make_states())


@pytest.mark.gpu
def test_cuda_torch_tensor_is_used_on_the_device_without_a_host_copy(copies):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    from logitproc.compile import build_kernels

    lib = build_kernels("cuda")
    proc = LogitProcessor(lib, V, 8, device="cuda")
    base = fresh_logits()
    logits = torch.from_numpy(base.copy()).cuda()
    proc.inplace_update_logits(logits, make_states())
    np.testing.assert_allclose(logits.cpu().numpy(), expected_logits(base), rtol=1e-5, atol=1e-5)
    assert copies == []


def test_one_call_with_the_processor_equals_the_two_calls(runtime, copies):
    from logitproc.runtime.token_rules import AllowedTokens

    proc, sampler = runtime
    allowed = [3, 17, 40, 41, 900]

    def states() -> list[RequestState]:
        made = make_states()
        made[0] = RequestState(PROMPT, CONFIGS[0], mask_sources=[AllowedTokens(allowed, V)])
        for t in OUTPUT:
            made[0].append_token(t)
        return made

    two = fresh_logits(4)
    proc.inplace_update_logits(two, states())
    expected = sampler.sample_from_logits(two, states())
    one = fresh_logits(4)
    got = sampler.sample_from_logits(one, states(), processor=proc)
    np.testing.assert_array_equal(got.token_ids, expected.token_ids)
    assert got.token_ids[0] in allowed
    # bias and penalties are written into the caller's logits; the masks were read by the sampling kernel instead
    unmasked = [t for t in range(V) if t not in allowed]
    np.testing.assert_allclose(one[1:], two[1:], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(one[0, allowed], two[0, allowed], rtol=1e-6, atol=1e-6)
    assert np.isfinite(one[0, unmasked]).all() and np.isneginf(two[0, unmasked]).all()
    assert copies == []
