"""Run TVM's WGSL kernels on Vulkan (or any WebGPU backend) through ``wgpu`` (wgpu-native), without tvmjs.

TVM 0.27's wheel has no Vulkan runtime and no SPIR-V code generator; its ``webgpu`` target emits WGSL, and only the
JavaScript runtime (``web/src/webgpu.ts``) knows how to launch it. This module plays that host role in Python:

1. ``WGSLKernels.from_prim_funcs`` lowers the PrimFuncs for the webgpu target exactly as ``tvm.compile`` does (same
   pipeline, with ``tirx.disable_cse_tir`` so that no hidden ``cse_v*`` parameters appear), keeps the device
   PrimFuncs TVM split off (their launch extents as expressions in the kernel's scalar parameters, and the launch
   order the host function would use), generates the WGSL, and builds one compute pipeline per kernel.
2. A launch binds each symbolic shape variable of the PrimFunc to the shapes of the arrays passed (and scalar
   parameters to their values), evaluates every kernel's grid, fills the ``PODArgs`` uniform, binds the storage
   buffers by name (see ``wgsl_layout``; a buffer the host code allocates is a workspace the function keeps), folds
   grids wider than 65535 blocks into z, and submits the kernels in order on the device's queue, so a later launch
   sees the writes of an earlier one.

Usage::

    device = create_device()                       # an adapter with raised limits
    kernels = WGSLKernels.from_prim_funcs(device, {"apply_bitmask_inplace": prim_func})
    logits = GPUArray.from_numpy(device, logits_np)
    kernels("apply_bitmask_inplace", logits, row_ids_np, bitmask_np)   # numpy arguments are uploaded
    result = logits.numpy()

On a machine without a GPU, Mesa's lavapipe (a CPU Vulkan driver) serves: ``use_lavapipe_if_unset()`` points
``VK_ICD_FILENAMES`` at it before the first adapter request.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tvm

from .launch_geometry import (
    DTYPE_BYTES,
    Param,
    Workspace,
    allocations,
    bind_shapes,
    element_count,
    encode_expr,
    evaluate,
    function_params,
    kernel_calls,
    lower_split,
    thread_extents,
)
from .wgsl_layout import ShaderLayout, fold_grid, parse_shader, split_shaders

try:  # optional dependency: the module imports without wgpu, and says so when a device is needed
    import wgpu
except ImportError:  # pragma: no cover - depends on the environment
    wgpu = None

#: Mesa's lavapipe ICD on Debian/Ubuntu x86-64.
LAVAPIPE_ICD = "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json"

#: Device limits raised to what the adapter allows (the WebGPU defaults are 128 MiB bindings, 256 threads).
RAISED_LIMITS = (
    "max-storage-buffer-binding-size",
    "max-buffer-size",
    "max-compute-invocations-per-workgroup",
    "max-compute-workgroup-size-x",
    "max-compute-workgroup-size-y",
    "max-compute-workgroup-size-z",
    "max-compute-workgroup-storage-size",
    "max-compute-workgroups-per-dimension",
    "max-storage-buffers-per-shader-stage",
)

#: WGSL element type of the storage array each numpy dtype is bound as.
_WGSL_ELEMENT = {np.dtype("float32"): "f32", np.dtype("int32"): "i32", np.dtype("uint32"): "u32"}

ArrayArg = Any  # GPUArray | np.ndarray | a Python scalar, per parameter

#: A 4-byte buffer per device, read back to wait for the queue (see sync_queue).
_FENCES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _require_wgpu() -> Any:
    if wgpu is None:
        raise ImportError("the wgpu package is needed to run WGSL kernels: pip install 'logitproc[vulkan]'")
    return wgpu


def use_lavapipe_if_unset(icd: str = LAVAPIPE_ICD) -> bool:
    """Select lavapipe through ``VK_ICD_FILENAMES`` unless that is already set; True if lavapipe is now selected.

    Must run before wgpu creates its instance (the first adapter request).
    """
    if "VK_ICD_FILENAMES" not in os.environ and os.path.exists(icd):
        os.environ["VK_ICD_FILENAMES"] = icd
    return os.environ.get("VK_ICD_FILENAMES") == icd


#: Preference among adapters of the requested backend: real GPUs before software ones.
_ADAPTER_RANK = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3}


def request_adapter(backend: str | None = "Vulkan") -> Any | None:
    """The best wgpu adapter of ``backend`` (``info["backend_type"]``; None = any), or ``None`` when there is none.

    Without a Vulkan driver wgpu falls back to other backends (OpenGL on llvmpipe, for one); they are not what this
    module targets, so by default only Vulkan adapters are considered.
    """
    _require_wgpu()
    if backend == "Vulkan":
        adapters = vulkan_adapters()
    else:
        adapters = [a for a in wgpu.gpu.enumerate_adapters_sync()
                    if backend is None or a.info["backend_type"] == backend]
        adapters.sort(key=lambda a: _ADAPTER_RANK.get(a.info["adapter_type"], 4))
    return adapters[0] if adapters else None


_INSTANCE_CONFIGURED = False


def _vulkan_only_instance() -> None:
    """Create wgpu's instance with the Vulkan backend alone (once, before any adapter request): the other backends
    are never used here, and probing OpenGL prints errors on machines without a display."""
    global _INSTANCE_CONFIGURED
    if _INSTANCE_CONFIGURED:
        return
    _INSTANCE_CONFIGURED = True
    try:
        from wgpu.backends.wgpu_native.extras import set_instance_extras

        set_instance_extras(backends=["Vulkan"])
    except (ImportError, RuntimeError):  # an instance exists already, or another wgpu backend: keep its defaults
        pass


def vulkan_adapters() -> list[Any]:
    """Every Vulkan adapter, real GPUs first; empty when wgpu is not installed."""
    if wgpu is None:
        return []
    _vulkan_only_instance()
    adapters = [a for a in wgpu.gpu.enumerate_adapters_sync() if a.info["backend_type"] == "Vulkan"]
    return sorted(adapters, key=lambda a: _ADAPTER_RANK.get(a.info["adapter_type"], 4))


def create_device(adapter: Any | None = None) -> Any:
    """A wgpu device whose buffer, workgroup and invocation limits are raised to what the adapter allows."""
    adapter = adapter if adapter is not None else request_adapter()
    if adapter is None:
        raise RuntimeError("no Vulkan adapter: install a Vulkan driver (mesa-vulkan-drivers gives lavapipe)")
    required = {name: adapter.limits[name] for name in RAISED_LIMITS if name in adapter.limits}
    return adapter.request_device_sync(required_limits=required)


def sync_queue(device: Any) -> None:
    """Wait until everything submitted to ``device``'s queue has finished.

    Reads back 4 bytes, which the queue orders after all earlier work: ``queue.on_submitted_work_done_sync`` fails
    in wgpu 0.32.0 (a callback signature mismatch with its wgpu-native).
    """
    fence = _FENCES.get(device)
    if fence is None:
        bu = _require_wgpu().BufferUsage
        fence = _FENCES[device] = device.create_buffer(size=4, usage=bu.COPY_SRC | bu.COPY_DST)
    device.queue.read_buffer(fence, 0, 4)


def _storage_usage() -> int:
    bu = _require_wgpu().BufferUsage
    return bu.STORAGE | bu.COPY_SRC | bu.COPY_DST


class GPUArray:
    """A wgpu storage buffer with the shape and dtype a kernel parameter needs (C-contiguous, no offset)."""

    def __init__(self, device: Any, buffer: Any, shape: Sequence[int], dtype: np.dtype | str) -> None:
        self.device = device
        self.buffer = buffer
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        if self.nbytes > buffer.size:
            raise ValueError(f"buffer of {buffer.size} bytes is too small for {self.shape} {self.dtype}")

    @property
    def nbytes(self) -> int:
        """Bytes of the array's data (the buffer may be padded to a multiple of 4)."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @staticmethod
    def _buffer_size(device: Any, nbytes: int) -> int:
        size = max(4, (nbytes + 3) // 4 * 4)
        limit = device.limits["max-storage-buffer-binding-size"]
        if size > limit:
            raise ValueError(f"{nbytes} bytes exceed the device's max storage buffer binding size ({limit})")
        return size

    @classmethod
    def empty(cls, device: Any, shape: Sequence[int], dtype: np.dtype | str) -> GPUArray:
        """An uninitialised (zero-filled by WebGPU) array on ``device``."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        buffer = device.create_buffer(size=cls._buffer_size(device, nbytes), usage=_storage_usage())
        return cls(device, buffer, shape, dtype)

    @classmethod
    def from_numpy(cls, device: Any, array: np.ndarray) -> GPUArray:
        """Upload ``array`` (copied, made C-contiguous) to a new buffer on ``device``."""
        out = cls.empty(device, array.shape, array.dtype)
        out.write(array)
        return out

    def write(self, array: np.ndarray) -> None:
        """Overwrite the contents from a numpy array of the same shape and dtype (ordered on the queue)."""
        array = np.asarray(array)
        if array.shape != self.shape or array.dtype != self.dtype:
            raise ValueError(f"expected {self.shape} {self.dtype}, got {array.shape} {array.dtype}")
        data = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        if data.size % 4:
            data = np.concatenate([data, np.zeros(4 - data.size % 4, np.uint8)])
        if data.size:
            self.device.queue.write_buffer(self.buffer, 0, data)

    def numpy(self) -> np.ndarray:
        """Download the contents (waits for every kernel submitted before)."""
        if self.nbytes == 0:
            return np.empty(self.shape, self.dtype)
        size = (self.nbytes + 3) // 4 * 4
        raw = np.frombuffer(self.device.queue.read_buffer(self.buffer, 0, size), dtype=np.uint8)
        return raw[: self.nbytes].view(self.dtype).reshape(self.shape).copy()

    def __repr__(self) -> str:
        return f"GPUArray(shape={self.shape}, dtype={self.dtype})"


# ----------------------------------------------------------------------------------------------------------------
# Reading TVM's lowered IR


def evaluate_index_expr(expr: Any, env: Mapping[str, int | float]) -> int | float:
    """Value of an integer TIR expression (a launch extent) with variables looked up by name in ``env``."""
    return evaluate(encode_expr(expr), env)


# ----------------------------------------------------------------------------------------------------------------
# Kernels


class WGSLKernel:
    """One WGSL shader (one device kernel TVM split from a PrimFunc) with its compute pipeline."""

    def __init__(self, device: Any, name: str, code: str, extents: Mapping[str, Any]) -> None:
        gpu = _require_wgpu()
        self.device = device
        self.name = name
        self.code = code
        self.layout: ShaderLayout = parse_shader(code)
        if self.layout.entry_point != name:
            raise ValueError(f"shader {name!r} has entry point {self.layout.entry_point!r}")
        self.extents = dict(extents)
        if "blockIdx.z" in self.extents:
            raise NotImplementedError(f"{name}: blockIdx.z is reserved for folding wide grids (as in TVM's runtime)")
        for axis, size in zip("xyz", self.layout.workgroup_size, strict=True):
            extent = self.extents.get(f"threadIdx.{axis}")
            value = 1 if extent is None else extent.value if type(extent).__name__ == "IntImm" else None
            if value != size:
                raise ValueError(f"{name}: threadIdx.{axis} extent {extent} does not match @workgroup_size {size}")
        threads = int(np.prod(self.layout.workgroup_size))
        limit = device.limits["max-compute-invocations-per-workgroup"]
        if threads > limit:
            raise ValueError(f"{name}: {threads} threads per workgroup exceed the device limit {limit}")

        entries = [
            {"binding": b.binding, "visibility": gpu.ShaderStage.COMPUTE,
             "buffer": {"type": gpu.BufferBindingType.read_only_storage if b.read_only
                        else gpu.BufferBindingType.storage}}
            for b in self.layout.storage
        ]
        if self.layout.pod_binding is not None:
            entries.append({"binding": self.layout.pod_binding, "visibility": gpu.ShaderStage.COMPUTE,
                            "buffer": {"type": gpu.BufferBindingType.uniform}})
        self.bind_group_layout = device.create_bind_group_layout(entries=entries)
        module = device.create_shader_module(code=code, label=name)
        self.pipeline = device.create_compute_pipeline(
            layout=device.create_pipeline_layout(bind_group_layouts=[self.bind_group_layout]),
            compute={"module": module, "entry_point": name},
            label=name,
        )
        self.uniform = None
        if self.layout.pod_binding is not None:
            self.uniform = device.create_buffer(size=self.layout.pod_size,
                                                usage=gpu.BufferUsage.UNIFORM | gpu.BufferUsage.COPY_DST)

    def grid(self, env: Mapping[str, int | float]) -> tuple[int, int]:
        """Blocks along x and y for the scalar values in ``env``."""
        bx = self.extents.get("blockIdx.x")
        by = self.extents.get("blockIdx.y")
        return (int(evaluate_index_expr(bx, env)) if bx is not None else 1,
                int(evaluate_index_expr(by, env)) if by is not None else 1)

    def encode(self, encoder: Any, buffers: Mapping[str, GPUArray], env: Mapping[str, int | float]) -> None:
        """Record this kernel's dispatch into ``encoder`` (its uniform is written on the queue right away)."""
        blocks_x, blocks_y = self.grid(env)
        if blocks_x <= 0 or blocks_y <= 0:
            return
        limit = self.device.limits["max-compute-workgroups-per-dimension"]
        dims = fold_grid(blocks_x, blocks_y, limit)
        if dims[2] > 1 and self.layout.grid_guard is None:
            raise ValueError(f"{self.name}: {blocks_x} blocks need grid folding but the shader has no guard")
        entries = []
        for b in self.layout.storage:
            arr = buffers[b.buffer_name]
            expected = _WGSL_ELEMENT.get(arr.dtype)
            if expected is not None and expected != b.element_type:
                raise TypeError(f"{self.name}: {b.buffer_name} is {arr.dtype}, shader reads array<{b.element_type}>")
            entries.append({"binding": b.binding, "resource": {"buffer": arr.buffer, "offset": 0,
                                                               "size": arr.buffer.size}})
        if self.uniform is not None:
            self.device.queue.write_buffer(self.uniform, 0, self.layout.pack_pod(env, blocks_x))
            entries.append({"binding": self.layout.pod_binding,
                            "resource": {"buffer": self.uniform, "offset": 0, "size": self.uniform.size}})
        bind_group = self.device.create_bind_group(layout=self.bind_group_layout, entries=entries)
        compute = encoder.begin_compute_pass()
        compute.set_pipeline(self.pipeline)
        compute.set_bind_group(0, bind_group)
        compute.dispatch_workgroups(*dims)
        compute.end()


class WGSLFunction:
    """A PrimFunc on the device: its parameters and the kernels its host code launches, in order."""

    def __init__(self, device: Any, name: str, params: Sequence[Param], kernels: list[WGSLKernel],
                 workspaces: Sequence[Workspace] = ()) -> None:
        self.device = device
        self.name = name
        self.params = params
        self.kernels = kernels
        self.workspaces = tuple(workspaces)
        self.written = {b.buffer_name for k in kernels for b in k.layout.storage if not b.read_only}
        self._held: dict[str, GPUArray] = {}  # each workspace's buffer, grown when a call needs more

    def _workspace(self, workspace: Workspace, env: Mapping[str, int | float]) -> GPUArray:
        """The buffer of ``workspace`` for the shapes in ``env`` (its dtype, as many elements as it needs)."""
        count = workspace.nbytes(env) // DTYPE_BYTES[workspace.dtype]
        held = self._held.get(workspace.name)
        if held is None or held.shape[0] < count:
            held = self._held[workspace.name] = GPUArray.empty(self.device, (max(count, 1),), workspace.dtype)
        return held

    def _bind(self, args: Sequence[ArrayArg]) -> tuple[dict[str, GPUArray], dict[str, int | float],
                                                          list[tuple[str, np.ndarray, GPUArray]]]:
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments "
                            f"({', '.join(p.name for p in self.params)}), got {len(args)}")
        buffers: dict[str, GPUArray] = {}
        uploaded: list[tuple[str, np.ndarray, GPUArray]] = []
        shapes: list[tuple[int, ...] | None] = []
        scalars: list[int | float | None] = []
        for p, arg in zip(self.params, args, strict=True):
            dtype = np.dtype(p.dtype)
            if p.shape is None:
                if isinstance(arg, (GPUArray, np.ndarray)) and np.ndim(arg) != 0:
                    raise TypeError(f"{self.name}: {p.name} is a scalar {p.dtype}")
                shapes.append(None)
                scalars.append(float(arg) if dtype.kind == "f" else int(arg))
                continue
            if isinstance(arg, np.ndarray):
                if arg.dtype != dtype:
                    raise TypeError(f"{self.name}: {p.name} must be {p.dtype}, got {arg.dtype}")
                gpu_arr = GPUArray.from_numpy(self.device, arg)
                uploaded.append((p.name, arg, gpu_arr))
                arg = gpu_arr
            if not isinstance(arg, GPUArray):
                raise TypeError(f"{self.name}: {p.name} must be a GPUArray or numpy array, got {type(arg).__name__}")
            if arg.dtype != dtype:
                raise TypeError(f"{self.name}: {p.name} must be {p.dtype}, got {arg.dtype}")
            buffers[p.name] = arg
            shapes.append(arg.shape)
            scalars.append(None)
        return buffers, bind_shapes(self.name, self.params, shapes, scalars), uploaded

    def __call__(self, *args: ArrayArg) -> None:
        """Launch every kernel in order on the device's queue. numpy arrays are uploaded, and those the kernels
        write are downloaded back into the same numpy arrays (which waits for completion)."""
        buffers, env, uploaded = self._bind(args)
        for workspace in self.workspaces:
            buffers[workspace.name] = self._workspace(workspace, env)
        encoder = self.device.create_command_encoder()
        for kernel in self.kernels:
            kernel.encode(encoder, buffers, env)
        self.device.queue.submit([encoder.finish()])
        for name, host, gpu_arr in uploaded:
            if name in self.written:
                host[...] = gpu_arr.numpy()


def lower_to_webgpu(prim_funcs: Mapping[str, tvm.tirx.PrimFunc], target: tvm.target.Target | None = None
                    ) -> tuple[tvm.IRModule, tvm.IRModule, str]:
    """Lower PrimFuncs for the webgpu target the way ``tvm.compile`` does; return (host IR, device IR, WGSL source).

    ``launch_geometry.lower_split`` keeps the IR that ``tvm.compile`` discards (the device PrimFuncs carry each
    kernel's parameters and launch extents, the host PrimFuncs the launch order); the WGSL is generated from it.
    """
    from tvm.tirx.build import codegen_build

    if target is None:
        from .targets import resolve_target

        target = resolve_target("vulkan").tvm_target()
    if target.kind.name != "webgpu":
        raise ValueError(f"expected a webgpu target, got {target.kind.name}")
    host_mod, device_mod, device_target = lower_split(prim_funcs, target)
    with tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}):
        source = str(codegen_build(device_mod, device_target).inspect_source(""))
    return host_mod, device_mod, source


class WGSLKernels:
    """PrimFuncs compiled to WGSL and ready to launch by name on a wgpu device."""

    def __init__(self, device: Any, functions: dict[str, WGSLFunction], source: str) -> None:
        self.device = device
        self.functions = functions
        #: The whole WGSL module TVM generated (every kernel under its ``// Function:`` header).
        self.source = source

    @classmethod
    def from_prim_funcs(cls, device: Any, prim_funcs: Mapping[str, tvm.tirx.PrimFunc],
                        target: tvm.target.Target | None = None) -> WGSLKernels:
        """Compile ``prim_funcs`` (name -> PrimFunc) for webgpu and build a compute pipeline per kernel."""
        host_mod, device_mod, source = lower_to_webgpu(prim_funcs, target)
        shaders = split_shaders(source)
        device_funcs = {str(gv.name_hint): f for gv, f in device_mod.functions.items()}
        if set(device_funcs) != set(shaders):
            raise ValueError(f"kernels in the IR {sorted(device_funcs)} differ from the WGSL {sorted(shaders)}")
        host_funcs = {str(gv.name_hint): f for gv, f in host_mod.functions.items()}
        functions = {}
        for name, func in prim_funcs.items():
            order = [str(call.args[0].value) for call in kernel_calls(host_funcs[name].body, set(device_funcs))]
            params = function_params(func)
            buffer_params = {p.name for p in params if p.shape is not None}
            allocated = {n: Workspace(n, d, element_count(e)) for _, n, d, e in allocations(host_funcs[name].body)
                         if d in DTYPE_BYTES}
            used: dict[str, Workspace] = {}
            kernels = []
            for kname in order:
                dev_func = device_funcs[kname]
                launch_tags = [str(t) for t in dev_func.attrs.get("tirx.kernel_launch_params", [])]
                unknown = [t for t in launch_tags if not t.startswith(("blockIdx.", "threadIdx."))]
                if unknown:
                    raise NotImplementedError(f"{kname}: launch parameters {unknown} are not supported")
                kernel = WGSLKernel(device, kname, shaders[kname], thread_extents(dev_func.body))
                for b in kernel.layout.storage:
                    if b.buffer_name in buffer_params:
                        continue
                    if b.buffer_name not in allocated:
                        raise NotImplementedError(f"{kname}: storage {b.name} is neither a buffer parameter of {name} "
                                                  "nor a workspace its host code allocates")
                    used[b.buffer_name] = allocated[b.buffer_name]
                kernels.append(kernel)
            functions[name] = WGSLFunction(device, name, params, kernels, tuple(used.values()))
        return cls(device, functions, source)

    def __call__(self, name: str, *args: ArrayArg) -> None:
        """Launch PrimFunc ``name`` with arguments in its parameter order (see ``WGSLFunction.__call__``)."""
        self.functions[name](*args)

    def __getitem__(self, name: str) -> WGSLFunction:
        return self.functions[name]

    def shader(self, kernel_name: str) -> str:
        """The WGSL of one kernel (e.g. ``apply_bitmask_inplace_kernel``)."""
        for func in self.functions.values():
            for k in func.kernels:
                if k.name == kernel_name:
                    return k.code
        raise KeyError(kernel_name)

    def sync(self) -> None:
        """Wait until every submitted kernel has finished."""
        sync_queue(self.device)
