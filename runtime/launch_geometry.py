"""How a GPU library's functions launch their kernels, as data: arguments, grid, block and shared memory per kernel.

A TIR PrimFunc compiled for a GPU becomes a host function (checks its arguments, then launches one or more device
kernels) and the device kernels. A launcher without TVM's runtime (the CUDA driver path, ``cuda_device.py``) plays the
host function's part, so the export records what the host function would do (``describe_functions``): for each
function its parameters, the workspaces its host code allocates (device memory for values passed between its
kernels), and for each kernel it launches, in order, the entry name, the kernel's arguments (the pointer of a buffer
parameter or a workspace, or a scalar expression), the grid and block extents and the dynamic shared memory, each as
an expression of the function's shape variables. Expressions are JSON (``encode_expr``): an int or float literal, a
variable's name, or ``[op, operand, ...]``; ``evaluate`` computes one for the shapes of the arrays passed.

``lower_split`` lowers PrimFuncs for a GPU target the way ``tvm.compile`` does and keeps the host and device IR this
module reads (it needs TVM's compiler, so it runs at export, or on Vulkan at load; the rest of this module needs no
TVM at all).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: A launch expression: a literal, a variable name, or [op, operand...] (see ``evaluate``).
Expr = int | float | str | list

#: Launch-parameter tags of TVM's kernel launches (``tirx.kernel_launch_params``) this module understands.
GRID_TAGS = ("blockIdx.x", "blockIdx.y", "blockIdx.z")
BLOCK_TAGS = ("threadIdx.x", "threadIdx.y", "threadIdx.z")
DYNAMIC_SHARED_TAG = "tirx.use_dyn_shared_memory"


def _truncdiv(a: int, b: int) -> int:
    """C-style integer division (rounds toward zero), TIR's ``Div`` on integers."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


_BINARY = {
    "Add": lambda a, b: a + b,
    "Sub": lambda a, b: a - b,
    "Mul": lambda a, b: a * b,
    "FloorDiv": lambda a, b: a // b,
    "FloorMod": lambda a, b: a % b,
    "Div": lambda a, b: _truncdiv(a, b) if isinstance(a, int) and isinstance(b, int) else a / b,
    "Mod": lambda a, b: a - b * _truncdiv(a, b),
    "Min": min,
    "Max": max,
    "EQ": lambda a, b: int(a == b),
    "NE": lambda a, b: int(a != b),
    "LT": lambda a, b: int(a < b),
    "LE": lambda a, b: int(a <= b),
    "GT": lambda a, b: int(a > b),
    "GE": lambda a, b: int(a >= b),
    "And": lambda a, b: int(bool(a) and bool(b)),
    "Or": lambda a, b: int(bool(a) or bool(b)),
    "RShift": lambda a, b: a >> b,
    "LShift": lambda a, b: a << b,
    "BitwiseAnd": lambda a, b: a & b,
    "BitwiseOr": lambda a, b: a | b,
    "BitwiseXor": lambda a, b: a ^ b,
}
#: TIR intrinsic calls an extent may hold, by the name ``encode_expr`` gives them.
_CALLS = {
    "tirx.shift_right": "RShift",
    "tirx.shift_left": "LShift",
    "tirx.bitwise_and": "BitwiseAnd",
    "tirx.bitwise_or": "BitwiseOr",
}


def encode_expr(expr: Any) -> Expr:
    """A TIR integer expression (a launch extent, a shape) as JSON; NotImplementedError for a node it cannot hold."""
    kind = type(expr).__name__
    if kind in ("IntImm", "FloatImm"):
        return expr.value
    if kind in ("Var", "SizeVar"):
        return str(expr.name)
    if kind in _BINARY:
        return [kind, encode_expr(expr.a), encode_expr(expr.b)]
    if kind == "Cast":
        return ["Cast", str(expr.dtype), encode_expr(expr.value)]
    if kind == "Not":
        return ["Not", encode_expr(expr.a)]
    if kind == "Select":
        return ["Select", encode_expr(expr.condition), encode_expr(expr.true_value), encode_expr(expr.false_value)]
    if kind == "Call" and str(expr.op.name) in _CALLS:
        a, b = expr.args
        return [_CALLS[str(expr.op.name)], encode_expr(a), encode_expr(b)]
    raise NotImplementedError(f"cannot describe launch expression node {kind}: {expr}")


def evaluate(expr: Expr, env: Mapping[str, int | float]) -> int | float:
    """The value of an encoded expression with variables looked up by name in ``env`` (KeyError naming a missing
    one)."""
    if isinstance(expr, bool):
        raise TypeError(f"a launch expression is never a bool: {expr!r}")
    if isinstance(expr, (int, float)):
        return expr
    if isinstance(expr, str):
        if expr not in env:
            raise KeyError(f"launch expression uses {expr!r}, which no argument defines")
        return env[expr]
    op, *operands = expr
    if op in _BINARY:
        a, b = (evaluate(x, env) for x in operands)
        return _BINARY[op](a, b)
    if op == "Cast":
        dtype, value = operands
        value = evaluate(value, env)
        return float(value) if dtype.startswith("float") else int(value)
    if op == "Not":
        return int(not evaluate(operands[0], env))
    if op == "Select":
        cond, true_value, false_value = operands
        return evaluate(true_value if evaluate(cond, env) else false_value, env)
    raise NotImplementedError(f"unknown launch expression operator {op!r}")


@dataclass(frozen=True)
class Param:
    """One parameter of a function: a buffer (``shape`` holds an expression per axis) or a scalar (``shape`` None)."""

    name: str
    dtype: str
    shape: tuple[Expr, ...] | None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": None if self.shape is None else list(self.shape)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Param:
        shape = data["shape"]
        return cls(str(data["name"]), str(data["dtype"]), None if shape is None else tuple(shape))


@dataclass(frozen=True)
class KernelArg:
    """One argument of a device kernel: the data pointer of the buffer parameter ``buffer``, or the value of the
    scalar expression ``value`` as ``dtype``."""

    dtype: str
    buffer: str | None = None
    value: Expr | None = None

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "buffer": self.buffer} if self.buffer is not None else \
            {"dtype": self.dtype, "value": self.value}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> KernelArg:
        return cls(str(data["dtype"]), data.get("buffer"), data.get("value"))


@dataclass(frozen=True)
class KernelLaunch:
    """One device kernel a function launches: its entry point, arguments, grid, block and dynamic shared bytes."""

    entry: str
    args: tuple[KernelArg, ...]
    grid: tuple[Expr, Expr, Expr]
    block: tuple[Expr, Expr, Expr]
    dynamic_shared_bytes: Expr = 0

    def dims(self, env: Mapping[str, int | float]) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
        """(grid, block, dynamic shared bytes) for the shape values in ``env``."""
        grid = tuple(int(evaluate(e, env)) for e in self.grid)
        block = tuple(int(evaluate(e, env)) for e in self.block)
        return grid, block, int(evaluate(self.dynamic_shared_bytes, env))  # type: ignore[return-value]

    def to_json(self) -> dict[str, Any]:
        return {"entry": self.entry, "args": [a.to_json() for a in self.args], "grid": list(self.grid),
                "block": list(self.block), "dynamic_shared_bytes": self.dynamic_shared_bytes}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> KernelLaunch:
        return cls(str(data["entry"]), tuple(KernelArg.from_json(a) for a in data["args"]),
                   tuple(data["grid"]), tuple(data["block"]), data.get("dynamic_shared_bytes", 0))


#: Bytes per element of the dtypes a workspace may have.
DTYPE_BYTES = {"float32": 4, "int32": 4, "uint32": 4, "float64": 8, "int64": 8, "float16": 2, "int8": 1, "uint8": 1}


@dataclass(frozen=True)
class Workspace:
    """Device memory the host function allocates for its kernels (a ``global`` buffer of the PrimFunc's body, not a
    parameter: e.g. the per-block partials of a row split over several blocks). Its contents do not outlive the
    call; every kernel writes what it later reads. ``size``: elements, as an expression of the shape variables."""

    name: str
    dtype: str
    size: Expr

    def nbytes(self, env: Mapping[str, int | float]) -> int:
        """Bytes for the shape values in ``env``."""
        return int(evaluate(self.size, env)) * DTYPE_BYTES[self.dtype]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "size": self.size}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Workspace:
        dtype = str(data["dtype"])
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"workspace {data['name']}: dtype {dtype} is not one of {sorted(DTYPE_BYTES)}")
        return cls(str(data["name"]), dtype, data["size"])


@dataclass(frozen=True)
class FunctionLaunches:
    """A function of the library as its host code runs it: its parameters, the workspaces it allocates and the
    kernels it launches in order (a kernel argument names a parameter or a workspace)."""

    name: str
    params: tuple[Param, ...]
    kernels: tuple[KernelLaunch, ...]
    workspaces: tuple[Workspace, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"params": [p.to_json() for p in self.params], "kernels": [k.to_json() for k in self.kernels],
                "workspaces": [w.to_json() for w in self.workspaces]}

    @classmethod
    def from_json(cls, name: str, data: Mapping[str, Any]) -> FunctionLaunches:
        return cls(name, tuple(Param.from_json(p) for p in data["params"]),
                   tuple(KernelLaunch.from_json(k) for k in data["kernels"]),
                   tuple(Workspace.from_json(w) for w in data.get("workspaces", [])))

    def bind(self, shapes: Sequence[tuple[int, ...] | None], scalars: Sequence[int | float | None]
             ) -> dict[str, int | float]:
        """The shape variables' values for arguments of these ``shapes`` (see ``bind_shapes``)."""
        return bind_shapes(self.name, self.params, shapes, scalars)


def bind_shapes(name: str, params: Sequence[Param], shapes: Sequence[tuple[int, ...] | None],
                scalars: Sequence[int | float | None]) -> dict[str, int | float]:
    """The value of every shape variable (and scalar parameter) of function ``name`` for arguments of these
    ``shapes`` (None for a scalar) and ``scalars`` (the scalar arguments' values, None for a buffer); TypeError or
    ValueError naming the parameter and axis when they do not fit the parameters."""
    if len(shapes) != len(params):
        raise TypeError(f"{name} takes {len(params)} arguments ({', '.join(p.name for p in params)}), "
                        f"got {len(shapes)}")
    env: dict[str, int | float] = {}
    checks: list[tuple[str, Expr, int]] = []
    for param, shape, scalar in zip(params, shapes, scalars, strict=True):
        if param.shape is None:
            if scalar is None:
                raise TypeError(f"{name}: {param.name} is a scalar {param.dtype}")
            env[param.name] = scalar
            continue
        if shape is None or len(shape) != len(param.shape):
            raise TypeError(f"{name}: {param.name} must be a {len(param.shape)}-d {param.dtype} array, "
                            f"got shape {shape}")
        for axis, (dim, size) in enumerate(zip(param.shape, shape, strict=True)):
            where = f"{param.name}.shape[{axis}]"
            if isinstance(dim, int):
                if dim != size:
                    raise ValueError(f"{name}: {where} must be {dim}, got {size}")
            elif isinstance(dim, str):
                if dim in env and env[dim] != size:
                    raise ValueError(f"{name}: {where} = {size} but {dim} = {env[dim]} from another argument")
                env[dim] = size
            else:
                checks.append((where, dim, size))
    for where, expr, size in checks:
        if evaluate(expr, env) != size:
            raise ValueError(f"{name}: {where} must be {evaluate(expr, env)}, got {size}")
    return env


# ----------------------------------------------------------------------------------------------------------------
# Reading TVM's lowered IR (at export; duck-typed over node type names, so this module imports no TVM)


def _children(stmt: Any) -> list[Any]:
    kids = list(getattr(stmt, "seq", None) or [])
    for name in ("body", "then_case", "else_case"):
        child = getattr(stmt, name, None)
        if child is not None:
            kids.append(child)
    return kids


def thread_extents(stmt: Any, out: dict[str, Any] | None = None) -> dict[str, Any]:
    """thread tag -> extent expression (TIR) of every ``thread_extent`` attribute under ``stmt``."""
    out = {} if out is None else out
    if type(stmt).__name__ == "AttrStmt" and stmt.attr_key == "thread_extent":
        tag = str(stmt.node.thread_tag)
        if tag in out and str(out[tag]) != str(stmt.value):
            raise NotImplementedError(f"{tag} is launched with two extents: {out[tag]} and {stmt.value}")
        out[tag] = stmt.value
    for child in _children(stmt):
        thread_extents(child, out)
    return out


def kernel_calls(stmt: Any, kernel_names: set[str], out: list[Any] | None = None, nested: bool = False) -> list[Any]:
    """The host function's kernel-launch calls (TIR ``Call`` nodes whose first argument names a kernel), in order;
    a launch under a host loop or branch is refused (the launcher runs a straight sequence)."""
    out = [] if out is None else out
    kind = type(stmt).__name__
    if kind == "Evaluate":
        call = stmt.value
        args = getattr(call, "args", None) or []
        if args and type(args[0]).__name__ == "StringImm" and str(args[0].value) in kernel_names:
            if nested:
                raise NotImplementedError(f"kernel {args[0].value} is launched inside a host loop or branch")
            out.append(call)
    for child in _children(stmt):
        kernel_calls(child, kernel_names, out, nested or kind in ("For", "While", "IfThenElse"))
    return out


def _declared_buffers(stmt: Any, out: list[tuple[Any, str]]) -> list[tuple[Any, str]]:
    """(data pointer, buffer name) of every buffer the host function declares (it names them after the PrimFunc's
    parameters)."""
    if type(stmt).__name__ == "DeclBuffer":
        out.append((stmt.buffer.data, str(stmt.buffer.name)))
    for child in _children(stmt):
        _declared_buffers(child, out)
    return out


def allocations(stmt: Any, out: list[tuple[Any, str, str, tuple[Any, ...]]] | None = None
                ) -> list[tuple[Any, str, str, tuple[Any, ...]]]:
    """(data pointer, name, dtype, extents) of every buffer the host function allocates itself (TIR ``AllocBuffer``
    or ``Allocate``): the workspaces it passes to its kernels."""
    out = [] if out is None else out
    kind = type(stmt).__name__
    if kind == "AllocBuffer":
        buf = stmt.buffer
        out.append((buf.data, str(buf.name), str(buf.dtype), tuple(buf.shape)))
    elif kind == "Allocate":
        out.append((stmt.buffer_var, str(stmt.buffer_var.name), str(stmt.dtype), tuple(stmt.extents)))
    for child in _children(stmt):
        allocations(child, out)
    return out


def element_count(extents: Sequence[Any]) -> Expr:
    """The element count of a buffer of these extents, encoded."""
    size: Expr = 1
    for extent in extents:
        size = encode_expr(extent) if size == 1 else ["Mul", size, encode_expr(extent)]
    return size


def _buffer_of(value: Any, declared: list[tuple[Any, str]]) -> str | None:
    """The name of the declared buffer whose data pointer is ``value`` (structurally the same expression), or None."""
    from tvm_ffi import structural_equal

    return next((name for data, name in declared if structural_equal(data, value)), None)


def function_params(func: Any) -> tuple[Param, ...]:
    """The parameters of a PrimFunc (as written, before lowering)."""
    params = []
    for p in func.params:
        if type(p.ty).__name__ == "BufferType":
            params.append(Param(str(p.name), str(p.dtype), tuple(encode_expr(s) for s in p.shape)))
        else:
            params.append(Param(str(p.name), str(p.ty), None))
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        raise ValueError(f"{func}: parameter names are not unique: {names}")
    return tuple(params)


def describe_functions(prim_funcs: Mapping[str, Any], host_mod: Any, device_mod: Any) -> dict[str, FunctionLaunches]:
    """Each PrimFunc of ``prim_funcs`` as its lowered host function launches it (``host_mod`` and ``device_mod``
    from ``lower_split``)."""
    device_funcs = {str(gv.name_hint): f for gv, f in device_mod.functions.items()}
    host_funcs = {str(gv.name_hint): f for gv, f in host_mod.functions.items()}
    described = {}
    for name, func in prim_funcs.items():
        params = function_params(func)
        buffer_params = {p.name for p in params if p.shape is not None}
        host = host_funcs[name]
        declared = _declared_buffers(host.body, [])
        allocated = allocations(host.body)
        workspaces: dict[str, Workspace] = {}
        kernels = []
        for call in kernel_calls(host.body, set(device_funcs)):
            entry = str(call.args[0].value)
            dev_func = device_funcs[entry]
            tags = [str(t) for t in dev_func.attrs.get("tirx.kernel_launch_params", [])]
            unknown = [t for t in tags if t not in GRID_TAGS + BLOCK_TAGS + (DYNAMIC_SHARED_TAG,)]
            if unknown:
                raise NotImplementedError(f"{entry}: launch parameters {unknown} are not supported")
            n_args = len(dev_func.params)
            values = list(call.args[1:])
            if len(values) != n_args + len(tags):
                raise ValueError(f"{entry}: the host passes {len(values)} values for {n_args} arguments and "
                                 f"{len(tags)} launch parameters")
            args = []
            for param, value in zip(dev_func.params, values[:n_args], strict=True):
                if type(param.ty).__name__ == "PointerType":
                    buffer = _buffer_of(value, declared)
                    if buffer not in buffer_params:
                        buffer = _workspace_of(name, entry, param, value, allocated, buffer_params, workspaces,
                                               _view_of(value, host.body))
                    args.append(KernelArg("handle", buffer=buffer))
                else:
                    args.append(KernelArg(str(param.ty), value=encode_expr(value)))
            launch = dict(zip(tags, (encode_expr(v) for v in values[n_args:]), strict=True))
            kernels.append(KernelLaunch(
                entry, tuple(args),
                tuple(launch.get(t, 1) for t in GRID_TAGS),  # type: ignore[arg-type]
                tuple(launch.get(t, 1) for t in BLOCK_TAGS),  # type: ignore[arg-type]
                launch.get(DYNAMIC_SHARED_TAG, 0)))
        described[name] = FunctionLaunches(name, params, tuple(kernels), tuple(workspaces.values()))
    return described


def _view_of(value: Any, stmt: Any) -> str | None:
    """The name of the buffer whose view (a declared buffer at offset 0 over its memory) has ``value`` as its data
    pointer, or None. TVM's storage rewrite lets workspaces whose kernels' lifetimes do not overlap share one
    allocation, each passed as such a view of it."""
    from tvm_ffi import structural_equal

    if type(stmt).__name__ == "DeclBuffer" and structural_equal(stmt.buffer.data, value):
        offset = stmt.buffer.elem_offset
        if type(offset).__name__ != "IntImm" or offset.value != 0:
            raise NotImplementedError(f"workspace view {stmt.buffer.name} at offset {offset}")
        return str(stmt.buffer.name)
    for child in _children(stmt):
        found = _view_of(value, child)
        if found is not None:
            return found
    return None


def _workspace_of(name: str, entry: str, param: Any, value: Any,
                  allocated: list[tuple[Any, str, str, tuple[Any, ...]]], buffer_params: set[str],
                  workspaces: dict[str, Workspace], view: str | None) -> str:
    """The workspace a kernel argument points to (recorded in ``workspaces``): the allocation whose data pointer it
    is, or the allocation that ``view`` (a view's buffer name, which is the allocation's) covers; NotImplementedError
    where it is neither a parameter nor a buffer the host function allocates."""
    from tvm_ffi import structural_equal

    found = next(((n, d, e) for data, n, d, e in allocated if structural_equal(data, value)), None)
    if found is None and view is not None:
        found = next(((n, d, e) for _, n, d, e in allocated if n == view), None)
    if found is None:
        raise NotImplementedError(f"{entry}: argument {param.name} is neither a buffer parameter of {name} nor a "
                                  "workspace its host code allocates")
    ws_name, dtype, extents = found
    if ws_name in buffer_params:
        raise ValueError(f"{name}: workspace {ws_name} has a parameter's name")
    if dtype not in DTYPE_BYTES:
        raise NotImplementedError(f"{name}: workspace {ws_name} of dtype {dtype} is not supported")
    workspaces.setdefault(ws_name, Workspace(ws_name, dtype, element_count(extents)))
    return ws_name


def lower_split(prim_funcs: Mapping[str, Any], target: Any) -> tuple[Any, Any, Any]:
    """Lower PrimFuncs for a GPU ``target`` as ``tvm.compile`` does; return (host IR, device IR, device target).

    Runs ``tvm.tirx.build``'s steps (bind target, the default TIR pipeline, host/device split, device finalisation)
    under ``tirx.disable_cse_tir`` (CSE would add hidden kernel parameters), keeping the IR that ``tvm.compile``
    discards. Needs TVM's compiler.
    """
    import tvm
    from tvm.tirx.build import split_host_device_mods

    if target.host is None:
        target = tvm.target.Target(target, host={"kind": "llvm"})
    with tvm.transform.PassContext(opt_level=3, config={"tirx.disable_cse_tir": True}):
        mod = tvm.tirx.transform.BindTarget(target)(tvm.IRModule(dict(prim_funcs)))
        pipeline, _finalize_host, finalize_device = tvm.tirx.get_default_tir_pipeline(target)
        mod = pipeline(mod)
        host_mod, device_mods = split_host_device_mods(mod)
        if len(device_mods) != 1:
            raise ValueError(f"expected one device target, got {list(device_mods)}")
        device_target, device_mod = next(iter(device_mods.items()))
        device_mod = finalize_device()(device_mod)
    return host_mod, device_mod, device_target
