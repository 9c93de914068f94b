"""Logits and log-probabilities from hidden states: a standalone utility, not a model attribute.

The model returns hidden states; the caller picks what it needs from them:

- ``compute_logits(hidden, lm_head)``: the full logits, for sampling (decode: ``[B, 1, H] -> [B, 1, V]``);
- ``compute_logprobs(hidden, lm_head, target_ids, chunk_size)``: only the log-probabilities of given target tokens,
  for training losses and prompt logprobs, ``chunk_size`` rows at a time so that the full ``[B*T, V]`` logits never
  exist in memory;
- ``logits_to_logprobs(logits, target_ids)``: the same log-probabilities from logits already computed (decode
  logprobs of the sampled tokens).

Conventions (all three functions):

- numpy in, numpy out, float32. ``hidden``, ``lm_head`` and ``logits`` must be float32 arrays: float64 (or float16)
  inputs are *rejected* with a TypeError rather than cast silently, because a cast of ``lm_head`` copies the whole
  ``[V, H]`` matrix on every call and a float64 matmul is twice the work for a float32 result; cast once on the caller's
  side (``x.astype(np.float32)``).
- ``lm_head`` is the output embedding ``[V, H]``, one row per token: ``logits = hidden @ lm_head.T``.
- ``target_ids`` may have any integer dtype (bool and floating dtypes are a TypeError); every id must lie in
  ``[0, V)``, else a ValueError names the first one outside.
- The log-softmax and the gather run in the compiled kernel ``log_softmax_gather`` of a CPU kernel library passed as
  ``library`` (``logitproc.compile.build_kernels("cpu")``: building is the caller's explicit call). It computes
  ``(logits[t] - max) - log(sum(exp(logits - max)))``, so logits offset by 1e4 keep full float32 precision; a target
  whose logit is -inf, or a row of only -inf, gives -inf.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import tvm

from . import kernel_abi
from .kernel_library import KernelLibrary

__all__ = ["compute_logits", "compute_logprobs", "logits_to_logprobs"]

# TVM's from_dlpack (zero copy) only accepts data aligned to 64 bytes; buffers of this module are allocated so.
_ALIGNMENT = 64
# The kernel's shapes are int32 variables: one call covers fewer than 2**31 logits (rows * V).
_MAX_KERNEL_ELEMENTS = 2**31 - 1
# logits_to_logprobs copies logits it cannot read in place through a buffer of at most this many bytes.
_COPY_BLOCK_BYTES = 64 << 20


def _gather_kernel(library: KernelLibrary) -> Callable[..., None]:
    """``log_softmax_gather(logits [n, V] f32, target_ids [n] i32, logprob [n] f32, logsumexp [n] f32)``."""
    if not isinstance(library, KernelLibrary):
        raise TypeError(f"library must be a KernelLibrary (logitproc.compile.build_kernels('cpu')), "
                        f"got {type(library).__name__}")
    if library.target.kind != "cpu":
        raise ValueError(f"library must be built for the cpu (numpy arrays are read in place), got "
                         f"{library.target.kind}")
    return library[kernel_abi.LOG_SOFTMAX]


# ---------------------------------------------------------------------------------------------------------------------
# Validation


def _check_float32(name: str, array: Any) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        got = f"a numpy scalar of dtype {array.dtype}" if isinstance(array, np.generic) else type(array).__name__
        raise TypeError(f"{name} must be a numpy.ndarray of float32, got {got}")
    if array.dtype != np.float32:
        hint = " (cast it once with .astype(np.float32))" if array.dtype.kind == "f" else ""
        raise TypeError(f"{name} must have dtype float32, got {array.dtype}{hint}")
    return array


def _check_lm_head(lm_head: Any, hidden_size: int) -> np.ndarray:
    lm_head = _check_float32("lm_head", lm_head)
    if lm_head.ndim != 2:
        raise ValueError(f"lm_head must have shape [V, H] (rank 2), got shape {lm_head.shape}")
    if lm_head.shape[1] != hidden_size:
        raise ValueError(
            f"lm_head has shape {lm_head.shape}: its hidden size {lm_head.shape[1]} does not match the hidden size "
            f"{hidden_size} of hidden (the last axis); expected lm_head of shape [V, {hidden_size}]"
        )
    return lm_head


def _check_targets(target_ids: Any, leading_shape: tuple[int, ...], vocab: int, against: str) -> np.ndarray:
    """``target_ids`` as int32 of ``leading_shape``, each in ``[0, vocab)``."""
    ids = np.asarray(target_ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"target_ids must have an integer dtype, got {ids.dtype} ({type(target_ids).__name__})")
    if ids.shape != leading_shape:
        raise ValueError(
            f"target_ids has shape {ids.shape}, expected {leading_shape} (the leading shape of {against})"
        )
    bad = (ids < 0) | (ids >= vocab)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        where = f"target_ids[{', '.join(map(str, first))}]" if first else "target_ids"
        raise ValueError(
            f"{where} = {int(ids[first])} is outside the vocabulary [0, {vocab}) "
            f"({int(bad.sum())} of {ids.size} target ids are out of range)"
        )
    return ids.astype(np.int32, copy=False)


# ---------------------------------------------------------------------------------------------------------------------
# Kernel plumbing


def _aligned_empty(shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
    """An uninitialised C-contiguous numpy array whose data starts on a 64-byte boundary (zero-copy into TVM)."""
    itemsize = np.dtype(dtype).itemsize
    nbytes = math.prod(shape) * itemsize
    raw = np.empty(nbytes + _ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % _ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _zero_copy_ok(array: np.ndarray) -> bool:
    return array.flags.c_contiguous and array.flags.writeable and array.ctypes.data % _ALIGNMENT == 0


def _max_kernel_rows(vocab: int) -> int:
    """The most rows of ``vocab`` logits one kernel call can take."""
    return max(1, _MAX_KERNEL_ELEMENTS // max(vocab, 1))


def _as_tvm(array: np.ndarray) -> tvm.runtime.Tensor:
    """A TVM tensor sharing ``array``'s memory (which must be C-contiguous, writeable and 64-byte aligned)."""
    return tvm.runtime.from_dlpack(array)


class _GatherBuffers:
    """Aligned buffers for ``rows`` rows of one kernel call: logits ``[rows, V]``, ids, logprob, logsumexp ``[rows]``.

    The TVM views of the full-size buffers are made once and reused for every full chunk.
    """

    def __init__(self, kernel: Callable[..., None], rows: int, vocab: int, logits: np.ndarray | None = None) -> None:
        self.kernel = kernel
        self.logits = _aligned_empty((rows, vocab), np.float32) if logits is None else logits
        self.ids = _aligned_empty((rows,), np.int32)
        self.logprob = _aligned_empty((rows,), np.float32)
        self.logsumexp = _aligned_empty((rows,), np.float32)
        self.rows = rows
        self._full = self._views(rows)

    def _views(self, n: int) -> tuple[tvm.runtime.Tensor, ...]:
        arrays = (self.logits[:n], self.ids[:n], self.logprob[:n], self.logsumexp[:n])
        return tuple(_as_tvm(a) for a in arrays)

    def run(self, n: int, ids: np.ndarray, out: np.ndarray) -> None:
        """Log-softmax-gather the first ``n`` rows of ``self.logits`` at ``ids``; write the logprobs to ``out``."""
        self.ids[:n] = ids
        self.kernel(*(self._full if n == self.rows else self._views(n)))
        out[...] = self.logprob[:n]


# ---------------------------------------------------------------------------------------------------------------------
# Public API


def compute_logits(hidden: np.ndarray, lm_head: np.ndarray) -> np.ndarray:
    """Logits from hidden states: ``logits[..., v] = sum_h hidden[..., h] * lm_head[v, h]``.

    Args:
        hidden: float32 ``[..., H]`` (e.g. ``[B, T, H]``, ``[B, 1, H]`` at decode, ``[N, H]`` or ``[H]``).
        lm_head: float32 ``[V, H]``, the output embedding (one row per token).

    Returns:
        float32 ``[..., V]`` = ``hidden @ lm_head.T``: the full logits, for sampling (C-contiguous and 64-byte aligned,
        so ``logits_to_logprobs`` reads them without a copy).

    Raises:
        TypeError: an input is not a float32 numpy array.
        ValueError: ``hidden`` has rank 0, ``lm_head`` is not rank 2, or their hidden sizes differ.
    """
    hidden = _check_float32("hidden", hidden)
    if hidden.ndim < 1:
        raise ValueError(f"hidden must have shape [..., H] (rank >= 1), got a scalar of shape {hidden.shape}")
    lm_head = _check_lm_head(lm_head, hidden.shape[-1])
    # 64-byte aligned, so that logits_to_logprobs reads these logits in place (numpy's own allocation often is not).
    logits = _aligned_empty((*hidden.shape[:-1], lm_head.shape[0]), np.float32)
    return np.matmul(hidden, lm_head.T, out=logits)


def compute_logprobs(
    hidden: np.ndarray, lm_head: np.ndarray, target_ids: np.ndarray, chunk_size: int = 1024, *,
    library: KernelLibrary,
) -> np.ndarray:
    """Log-probabilities of target tokens under the logits of ``hidden``, without materialising all the logits.

    For each row ``r`` of the ``N = B*T`` rows::

        logits_r = hidden[r] @ lm_head.T                                   # [V], only for one chunk of rows at a time
        logprobs[r] = logits_r[target_ids[r]] - log(sum(exp(logits_r)))    # log_softmax(logits_r)[target_ids[r]]

    Rows are processed ``chunk_size`` at a time: one ``[min(chunk_size, N), V]`` float32 buffer is allocated per call
    and reused for every chunk (the chunk's logits are written into it by the matmul, then reduced by the compiled
    kernel ``log_softmax_gather``), so the extra memory is about ``chunk_size * V * 4`` bytes instead of ``N * V * 4``.
    (A chunk is also capped below 2**31 logits, the kernel's int32 sizes.)

    Args:
        hidden: float32 ``[B, T, H]`` or ``[N, H]``.
        lm_head: float32 ``[V, H]``, the output embedding (one row per token).
        target_ids: integers of the leading shape of ``hidden`` (``[B, T]`` or ``[N]``), each in ``[0, V)``.
        chunk_size: rows per chunk, >= 1.
        library: a CPU kernel library (its ``log_softmax_gather`` kernel).

    Returns:
        float32 ``[B, T]`` or ``[N]``: ``log_softmax(hidden @ lm_head.T)`` at the target ids.

    Raises:
        TypeError: ``hidden`` or ``lm_head`` is not a float32 numpy array, ``target_ids`` is not integer, or
            ``chunk_size`` is not an int.
        ValueError: wrong ranks, mismatched hidden sizes or leading shapes, a target id outside ``[0, V)``, or
            ``chunk_size < 1``.
    """
    hidden = _check_float32("hidden", hidden)
    if hidden.ndim not in (2, 3):
        raise ValueError(f"hidden must have shape [B, T, H] or [N, H] (rank 3 or 2), got shape {hidden.shape}")
    lm_head = _check_lm_head(lm_head, hidden.shape[-1])
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int | np.integer):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__} {chunk_size!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    leading = hidden.shape[:-1]
    vocab = lm_head.shape[0]
    ids = _check_targets(target_ids, leading, vocab, "hidden").reshape(-1)
    kernel = _gather_kernel(library)

    rows = hidden.reshape(-1, hidden.shape[-1])  # a copy only for a non-contiguous [B, T, H] view: N*H, not N*V
    n_rows = rows.shape[0]
    out = np.empty(n_rows, np.float32)
    if n_rows == 0:
        return out.reshape(leading)
    if not (lm_head.flags.c_contiguous or lm_head.flags.f_contiguous):
        lm_head = np.ascontiguousarray(lm_head)  # once, rather than inside every chunk's matmul
    weight_t = lm_head.T  # [H, V], a view
    buffers = _GatherBuffers(kernel, min(int(chunk_size), n_rows, _max_kernel_rows(vocab)), vocab)
    for start in range(0, n_rows, buffers.rows):
        stop = min(start + buffers.rows, n_rows)
        n = stop - start
        np.matmul(rows[start:stop], weight_t, out=buffers.logits[:n])  # the chunk's logits, in place
        buffers.run(n, ids[start:stop], out[start:stop])
    return out.reshape(leading)


def logits_to_logprobs(logits: np.ndarray, target_ids: np.ndarray, *, library: KernelLibrary) -> np.ndarray:
    """Log-probabilities of target tokens under given logits.

    For each row ``r`` of ``logits`` viewed as ``[N, V]``::

        logprobs[r] = logits[r, target_ids[r]] - log(sum(exp(logits[r])))   # log_softmax(logits[r])[target_ids[r]]

    A target whose logit is -inf, or a row of only -inf, gives -inf. ``logits`` is read in place when it is
    C-contiguous, writeable and 64-byte aligned (it is never modified); otherwise it is copied, block by block of at
    most 64 MB, into one aligned buffer.

    Args:
        logits: float32 ``[..., V]`` (e.g. ``[B, 1, V]`` at decode, ``[N, V]``, or ``[V]``).
        target_ids: integers of shape ``logits.shape[:-1]``, each in ``[0, V)``.
        library: a CPU kernel library (its ``log_softmax_gather`` kernel).

    Returns:
        float32 of shape ``logits.shape[:-1]``.

    Raises:
        TypeError: ``logits`` is not a float32 numpy array or ``target_ids`` is not integer.
        ValueError: ``logits`` is a scalar, the shapes disagree, or a target id lies outside ``[0, V)``.
    """
    logits = _check_float32("logits", logits)
    if logits.ndim < 1:
        raise ValueError(f"logits must have shape [..., V] (rank >= 1), got a scalar of shape {logits.shape}")
    leading = logits.shape[:-1]
    vocab = logits.shape[-1]
    ids = _check_targets(target_ids, leading, vocab, "logits").reshape(-1)
    kernel = _gather_kernel(library)
    n_rows = ids.size
    out = np.empty(n_rows, np.float32)
    if n_rows == 0:
        return out.reshape(leading)
    rows = logits.reshape(n_rows, vocab)  # a view, unless logits is a non-contiguous view
    if _zero_copy_ok(rows) and n_rows <= _max_kernel_rows(vocab):
        _GatherBuffers(kernel, n_rows, vocab, logits=rows).run(n_rows, ids, out)
        return out.reshape(leading)
    # Copy block by block into one aligned buffer (bounded memory, and within the kernel's int32 sizes).
    block_rows = max(1, min(n_rows, _max_kernel_rows(vocab), _COPY_BLOCK_BYTES // (4 * vocab)))
    buffers = _GatherBuffers(kernel, block_rows, vocab)
    for start in range(0, n_rows, block_rows):
        stop = min(start + block_rows, n_rows)
        buffers.logits[: stop - start] = rows[start:stop]
        buffers.run(stop - start, ids[start:stop], out[start:stop])
    return out.reshape(leading)
