# fmt: off
"""What a slot of the paged KV cache holds for each ``kv_dtype``, and the attention kernels' loads from it.

TVM's paged KV cache stores, per token and for its keys and for its values, ``heads`` rows of ``d`` elements of one
type, the type of q, k, v and the attention's output too. ``float32`` and ``float16`` caches hold the model's
``h_kv`` heads as they are. ``q8_0`` (llama.cpp's ``-ctk q8_0 -ctv q8_0``) holds each head's ``d`` values as int8 in
blocks of 32 along the head, each block with a float16 scale (``x ~= q * scale``, ``scale = max|x| / 127``,
``q = round(x / scale)``, half away from zero), packed into rows of float16 elements: per token the byte stream

    bytes [hk d, (hk + 1) d)                            the int8 values of head hk     (hk < h_kv)
    float16 element h_kv d / 2 + hk d / 32 + b          the scale of block b of head hk

of ``heads = ceil(17 h_kv / 32)`` rows (``2 d`` bytes each: SmolLM2's 3 KV heads of 64 take 2 rows, 256 bytes where
float16 takes 384 and llama.cpp's blocks 204); q and the output are float16 as in a float16 cache. A head's values
lie in row ``hk // 2`` at byte ``(hk % 2) d``, so 8 consecutive values are one 8-byte load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Element types of the KV cache: float32 (the default), float16 (llama.cpp's default), q8_0 (8-bit blocks).
KV_DTYPES = ("float16", "float32", "q8_0")
#: Values per q8_0 block (llama.cpp's QK8_0).
Q8_BLOCK = 32
LANES = 8

#: ``at(row, offset)``: the index of element ``offset`` of storage row ``row`` of one token (in a page, or in k/v).
Index = Callable[[Any, Any], list[Any]]


@dataclass(frozen=True)
class KVLayout:
    """The KV cache's layout for ``h_kv`` heads of size ``d`` in ``kv_dtype`` (see the module doc)."""

    kv_dtype: str
    h_kv: int
    d: int

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} is not supported ({', '.join(KV_DTYPES)})")
        if self.quantized and self.d % Q8_BLOCK:
            raise ValueError(f"kv_dtype 'q8_0' needs a head size that is a multiple of {Q8_BLOCK}, got {self.d}")

    @property
    def quantized(self) -> bool:
        return self.kv_dtype == "q8_0"

    @property
    def dtype(self) -> str:
        """The cache's element type: its pages, q, k, v and the attention's output."""
        return "float16" if self.quantized else self.kv_dtype

    @property
    def heads(self) -> int:
        """Storage rows of ``d`` elements per token, for its keys and again for its values."""
        if not self.quantized:
            return self.h_kv
        row_bytes = 2 * self.d
        return -(-(self.h_kv * self.d + 2 * self.h_kv * (self.d // Q8_BLOCK)) // row_bytes)

    @property
    def row_bytes(self) -> int:
        return self.d * (4 if self.dtype == "float32" else 2)

    def query_heads(self, h_q: int) -> int:
        """Heads of the cache's q and output: the model's ``h_q`` query heads, then ``heads`` rows carrying each
        token's stored key and ``heads`` its stored value (``rope_kernel`` writes them; the exact mode of the paged
        prefill kernel reads the new tokens there)."""
        return h_q + 2 * self.heads

    def bytes_per_token(self) -> int:
        """Bytes of cache per token and layer (keys and values)."""
        return 2 * self.heads * self.row_bytes

    def scale_at(self, hk: Any, j: Any) -> tuple[Any, Any]:
        """(row, element) of the float16 scale of head ``hk``'s value ``j``."""
        e = self.h_kv * self.d // 2 + hk * (self.d // Q8_BLOCK) + j // Q8_BLOCK
        return e // self.d, e % self.d

    def lanes(self, buf: Any, buf8: Any, at: Index, hk: Any, j0: Any) -> Any:
        """float32x8: head ``hk``'s values ``j0 .. j0 + 7`` (``j0`` a multiple of 8) of the token at ``at`` in
        ``buf`` (``buf8``: the same memory as int8, for q8_0)."""
        from tvm.script import tirx as T  # here: the CLI reads KV_DTYPES without importing TVM

        if not self.quantized:
            return T.Cast(f"float32x{LANES}", buf.vload(at(hk, j0), f"{self.dtype}x{LANES}"))
        row, e = self.scale_at(hk, j0)
        values = buf8.vload(at(hk // 2, hk % 2 * self.d + j0), f"int8x{LANES}")
        return T.Cast(f"float32x{LANES}", values) * T.broadcast(T.Cast("float32", buf[tuple(at(row, e))]), LANES)

    def raw(self, buf: Any, buf8: Any, at: Index, hk: Any, j0: Any) -> Any:
        """float32x8: ``lanes`` without the q8_0 scale (the int8 values widened; floats as they are)."""
        from tvm.script import tirx as T

        if not self.quantized:
            return self.lanes(buf, buf8, at, hk, j0)
        return T.Cast(f"float32x{LANES}", buf8.vload(at(hk // 2, hk % 2 * self.d + j0), f"int8x{LANES}"))

    def scale(self, buf: Any, at: Index, hk: Any, j: Any) -> Any:
        """float32: the q8_0 scale of head ``hk``'s value ``j`` (1 for float caches)."""
        from tvm.script import tirx as T

        if not self.quantized:
            return T.float32(1)
        row, e = self.scale_at(hk, j)
        return T.Cast("float32", buf[tuple(at(row, e))])

    def value(self, buf: Any, buf8: Any, at: Index, hk: Any, j: Any) -> Any:
        """float32: head ``hk``'s value ``j`` of the token at ``at``."""
        from tvm.script import tirx as T

        if not self.quantized:
            return T.Cast("float32", buf[tuple(at(hk, j))])
        row, e = self.scale_at(hk, j)
        return (T.Cast("float32", buf8[tuple(at(hk // 2, hk % 2 * self.d + j))])
                * T.Cast("float32", buf[tuple(at(row, e))]))
