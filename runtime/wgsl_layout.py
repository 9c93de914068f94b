"""What TVM's WGSL code generator emits, read back from the shader text: bindings, POD arguments, grid packing.

TVM 0.27's ``webgpu`` target emits, per device kernel, a block like this (measured, see ``tests/test_wgsl.py``)::

    // Function: apply_bitmask_inplace_kernel
    //----------------------------------------
    @group(0) @binding(0) var<storage, read> bitmask_ptr : array<i32>;
    @group(0) @binding(1) var<storage, read_write> logits_ptr : array<f32>;
    @group(0) @binding(2) var<storage, read> row_ids_ptr : array<i32>;

    struct PODArgs {
      num_rows: i32,
      num_words: i32,
      vocab: i32,
      packGridDimX: u32
    }
    @group(0) @binding(3) var<uniform> podArgs : PODArgs;

    @compute @workgroup_size(256, 1, 1)
    fn apply_bitmask_inplace_kernel(...) {
      if (blockIdx.z * gridDim.x + blockIdx.x > podArgs.packGridDimX) { return; }
      let v__1 : i32 = i32(blockIdx.z * gridDim.x + blockIdx.x);
      ...

- Storage buffers are the kernel's buffer parameters sorted by NAME (not the PrimFunc's parameter order), each
  named ``<buffer>_ptr``; buffers the kernel only reads are ``var<storage, read>``.
- ``PODArgs`` holds the kernel's scalar parameters (symbolic shape variables such as ``vocab`` and scalar
  PrimFunc parameters), also sorted by name, then ``packGridDimX``; it sits at the binding after the last buffer.
- The x block index is rebuilt as ``blockIdx.z * gridDim.x + blockIdx.x``: a host may fold a grid wider than the
  per-dimension limit (65535) into z, and the guard drops the padding blocks.

Every field is a 4-byte scalar (i32, u32 or f32), so field k sits at byte offset 4k; the uniform buffer this module
packs is rounded up to 16 bytes. The module has no wgpu dependency.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass

#: Name of the trailing PODArgs field that carries the true number of blocks along x.
PACK_GRID_FIELD = "packGridDimX"

#: struct.pack format of each WGSL scalar type a PODArgs field may have.
_POD_FORMATS = {"i32": "<i", "u32": "<I", "f32": "<f"}

_HEADER = re.compile(r"^// Function: (?P<name>[A-Za-z_][A-Za-z0-9_]*)\n//-+\n", re.MULTILINE)
_STORAGE = re.compile(
    r"@group\((?P<group>\d+)\)\s*@binding\((?P<binding>\d+)\)\s*var<storage,\s*(?P<access>read|read_write)>\s*"
    r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)\s*:\s*array<(?P<elem>[^>]+)>\s*;"
)
_UNIFORM = re.compile(
    r"@group\((?P<group>\d+)\)\s*@binding\((?P<binding>\d+)\)\s*var<uniform>\s*"
    r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)\s*:\s*(?P<type>[A-Za-z_][A-Za-z0-9_]*)\s*;"
)
_STRUCT = re.compile(r"struct\s+(?P<name>[A-Za-z_][A-Za-z0-9_]*)\s*\{(?P<body>[^}]*)\}")
_FIELD = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)\s*:\s*(?P<type>[A-Za-z0-9_<>]+)")
_WORKGROUP = re.compile(r"@compute\s+@workgroup_size\((?P<dims>[^)]*)\)\s*fn\s+(?P<entry>[A-Za-z_][A-Za-z0-9_]*)\s*\(")
_GRID_GUARD = re.compile(
    r"if\s*\(\s*blockIdx\.z\s*\*\s*gridDim\.x\s*\+\s*blockIdx\.x\s*(?P<op>>=?)\s*podArgs\.packGridDimX\s*\)\s*"
    r"\{\s*return;\s*\}"
)


@dataclass(frozen=True)
class StorageBinding:
    """One ``var<storage>`` array of a shader."""

    binding: int
    #: WGSL variable name, ``<buffer name>_ptr``.
    name: str
    #: True for ``var<storage, read>`` (the kernel never writes it).
    read_only: bool
    #: WGSL element type (``f32``, ``i32``, ``u32``, ...).
    element_type: str

    @property
    def buffer_name(self) -> str:
        """The PrimFunc buffer parameter this binding holds (the name without the ``_ptr`` suffix)."""
        return self.name[: -len("_ptr")] if self.name.endswith("_ptr") else self.name


@dataclass(frozen=True)
class PodField:
    """One scalar field of the ``PODArgs`` uniform struct."""

    name: str
    #: ``i32``, ``u32`` or ``f32``.
    wgsl_type: str
    #: Byte offset in the uniform buffer.
    offset: int


@dataclass(frozen=True)
class ShaderLayout:
    """Everything a host needs to launch one TVM WGSL kernel, read from its source."""

    #: Entry point (``fn`` name), e.g. ``apply_bitmask_inplace_kernel``.
    entry_point: str
    #: Storage bindings in binding order.
    storage: tuple[StorageBinding, ...]
    #: Binding index of the ``PODArgs`` uniform (``None`` if the shader declares none).
    pod_binding: int | None
    #: ``PODArgs`` fields in declaration order, ``packGridDimX`` last.
    pod_fields: tuple[PodField, ...]
    #: ``@workgroup_size(x, y, z)``.
    workgroup_size: tuple[int, int, int]
    #: Comparison in the grid-packing guard: ``">"`` (TVM 0.27: a block whose index equals packGridDimX still runs),
    #: ``">="``, or ``None`` where the shader has no guard (it cannot be launched with a folded grid).
    grid_guard: str | None

    @property
    def pod_size(self) -> int:
        """Size in bytes of the uniform buffer: 4 bytes per field, rounded up to 16 (at least 16)."""
        raw = 4 * len(self.pod_fields)
        return max(16, (raw + 15) // 16 * 16)

    @property
    def scalar_names(self) -> tuple[str, ...]:
        """PODArgs fields the host fills from the kernel's arguments (every field but packGridDimX)."""
        return tuple(f.name for f in self.pod_fields if f.name != PACK_GRID_FIELD)

    def pack_grid_value(self, blocks_x: int) -> int:
        """The packGridDimX value that lets exactly ``blocks_x`` blocks along x pass the shader's guard.

        TVM's own web runtime (``web/src/webgpu.ts``) stores the block count itself; with the ``>`` guard TVM 0.27
        emits, that lets one padding block (index == block count) run when the grid is folded with padding. Storing
        ``blocks_x - 1`` for a ``>`` guard keeps exactly the blocks TIR asked for.
        """
        if self.grid_guard == ">":
            return max(blocks_x - 1, 0)
        return blocks_x

    def pack_pod(self, values: Mapping[str, int | float], blocks_x: int) -> bytes:
        """The uniform buffer contents: each field from ``values`` (packGridDimX from ``blocks_x``), zero padded."""
        out = bytearray(self.pod_size)
        for field in self.pod_fields:
            if field.name == PACK_GRID_FIELD:
                value: int | float = self.pack_grid_value(blocks_x)
            else:
                if field.name not in values:
                    raise KeyError(f"{self.entry_point}: no value for PODArgs field {field.name!r}")
                value = values[field.name]
            fmt = _POD_FORMATS[field.wgsl_type]
            if field.wgsl_type == "f32":
                value = float(value)
            else:
                value = int(value)
                lo, hi = (-(2**31), 2**31 - 1) if field.wgsl_type == "i32" else (0, 2**32 - 1)
                if not lo <= value <= hi:
                    raise OverflowError(f"{self.entry_point}: {field.name}={value} does not fit {field.wgsl_type}")
            struct.pack_into(fmt, out, field.offset, value)
        return bytes(out)


def split_shaders(source: str) -> dict[str, str]:
    """Split the module source TVM prints into one shader per kernel, keyed by kernel name.

    TVM 0.27 writes each kernel under a ``// Function: NAME`` header and repeats the header inside the shader text;
    empty sections between repeated headers are dropped, and the text of a repeated name is kept once.
    """
    headers = list(_HEADER.finditer(source))
    shaders: dict[str, str] = {}
    for i, match in enumerate(headers):
        end = headers[i + 1].start() if i + 1 < len(headers) else len(source)
        body = source[match.end():end].strip()
        if not body:
            continue
        name = match.group("name")
        if name in shaders and shaders[name] != body:
            raise ValueError(f"two different shaders named {name!r} in the WGSL module")
        shaders[name] = body
    if not shaders and source.strip():
        raise ValueError("no '// Function: NAME' sections in the WGSL source")
    return shaders


def parse_shader(code: str) -> ShaderLayout:
    """Read the binding layout, PODArgs struct, workgroup size and grid guard of one TVM WGSL kernel."""
    storage = []
    for m in _STORAGE.finditer(code):
        if int(m.group("group")) != 0:
            raise ValueError(f"storage buffer {m.group('name')!r} is in group {m.group('group')}; expected group 0")
        storage.append(StorageBinding(int(m.group("binding")), m.group("name"), m.group("access") == "read",
                                      m.group("elem").strip()))
    storage.sort(key=lambda b: b.binding)

    uniforms = list(_UNIFORM.finditer(code))
    if len(uniforms) > 1:
        raise ValueError(f"expected at most one uniform binding, found {len(uniforms)}")
    pod_binding = None
    pod_fields: tuple[PodField, ...] = ()
    if uniforms:
        u = uniforms[0]
        pod_binding = int(u.group("binding"))
        structs = {m.group("name"): m.group("body") for m in _STRUCT.finditer(code)}
        if u.group("type") not in structs:
            raise ValueError(f"uniform type {u.group('type')!r} is not a struct of the shader")
        fields = []
        for k, f in enumerate(_FIELD.finditer(structs[u.group("type")])):
            if f.group("type") not in _POD_FORMATS:
                raise NotImplementedError(f"PODArgs field {f.group('name')!r} has type {f.group('type')!r}; "
                                          f"only {sorted(_POD_FORMATS)} are supported")
            fields.append(PodField(f.group("name"), f.group("type"), 4 * k))
        pod_fields = tuple(fields)

    bindings = [b.binding for b in storage] + ([pod_binding] if pod_binding is not None else [])
    if sorted(bindings) != list(range(len(bindings))):
        raise ValueError(f"bindings are not 0..{len(bindings) - 1}: {sorted(bindings)}")

    wg = list(_WORKGROUP.finditer(code))
    if len(wg) != 1:
        raise ValueError(f"expected one @compute entry point, found {len(wg)}")
    dims = [int(d.strip().rstrip("iu")) for d in wg[0].group("dims").split(",") if d.strip()]
    dims += [1] * (3 - len(dims))
    guard = _GRID_GUARD.search(code)
    return ShaderLayout(
        entry_point=wg[0].group("entry"),
        storage=tuple(storage),
        pod_binding=pod_binding,
        pod_fields=pod_fields,
        workgroup_size=(dims[0], dims[1], dims[2]),
        grid_guard=guard.group("op") if guard else None,
    )


def fold_grid(blocks_x: int, blocks_y: int, limit: int = 65535) -> tuple[int, int, int]:
    """Dispatch size (x, y, z) for ``blocks_x`` x ``blocks_y`` blocks when x may exceed ``limit`` per dimension.

    Same folding as TVM's web runtime: halve x (rounding up) and double z until x fits; the shader rebuilds the
    block index as ``z * gridDim.x + x`` and its guard drops the (at most z - 1) padding blocks.
    """
    x, z = blocks_x, 1
    while x > limit:
        x = (x + 1) // 2
        z *= 2
    if blocks_y > limit or z > limit:
        raise ValueError(f"grid {blocks_x} x {blocks_y} does not fit the per-dimension limit {limit}")
    return x, blocks_y, z
