"""Where one decode step (a verify forward of n tokens, or a long prefill) of a CompiledModel goes: each packed
function the VM calls (kernels, KV-cache builtins, VM builtins), timed with the VM's instrument, as calls per step
and milliseconds per step (median call x calls; for a prefill, the sum over its chunks).

Used by ``scripts/bench_model.py --profile``, ``--profile-prefill``, ``--profile-verify`` and ``--profile-batch``.
"""

from __future__ import annotations

import collections
import time

import numpy as np
import tvm
from logitproc.serve.compiled_model import PREFILL_CHUNK
from tvm import relax


def _shape(values: list[int]) -> tvm.runtime.ShapeTuple:
    return tvm.runtime.ShapeTuple(values)


def _instrument(vm) -> dict[str, list[float]]:
    """Time every packed function ``vm`` calls from now on: name -> seconds of each call."""
    times: dict[str, list[float]] = collections.defaultdict(list)
    stack: list[float] = []

    def instrument(func, name, before, ret, *args) -> None:
        if before:
            stack.append(time.perf_counter())
        else:
            times[str(name)].append(time.perf_counter() - stack.pop())

    vm.set_instrument(instrument)
    return times


def profile_decode(model, prompt: list[int], steps: int = 8, verify: int = 0,
                   batch: int = 1) -> tuple[float, list[tuple[str, int, float]]]:
    """(ms of a plain decode step, [(function, calls per step, ms per step)] sorted by time) for ``batch``
    sequences after ``prompt`` each, on a VM of its own over the model's library and weights. ``verify``: profile
    instead a verify forward of that many tokens of one sequence (speculative decoding's check of 1 + K tokens),
    rolled back after each."""
    vm = relax.VirtualMachine(model.kernel_library.runtime_module, model.device)
    kv = vm["create_paged_kv_cache"](_shape([batch]), _shape([batch * (len(prompt) + 64 + steps * 2)]),
                                     _shape([len(prompt)]), _shape([16]), _shape([0]))
    get = tvm.get_global_func
    begin, end = get("vm.builtin.kv_state_begin_forward"), get("vm.builtin.kv_state_end_forward")
    for seq in range(batch):
        get("vm.builtin.kv_state_add_sequence")(kv, seq)
        begin(kv, _shape([seq]), _shape([len(prompt)]))
        vm["prefill"](tvm.runtime.tensor(np.array(prompt, np.int32)),
                      tvm.runtime.tensor(np.array([len(prompt) - 1], np.int32)), kv, model._params)
        end(kv)
    ids = tvm.runtime.tensor(np.array([prompt[-1]] * max(verify, batch), np.int32))
    popn = get("vm.builtin.kv_state_popn")

    def step() -> None:
        if verify:
            begin(kv, _shape([0]), _shape([verify]))
        else:
            begin(kv, _shape(list(range(batch))), _shape([1] * batch))
        if verify:
            vm["verify"](ids, kv, model._params)
        else:
            vm["decode"](ids, kv, model._params)
        end(kv)
        if verify:
            popn(kv, 0, verify)

    step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    plain_ms = (time.perf_counter() - started) / steps * 1e3

    times = _instrument(vm)
    for _ in range(steps):
        step()
    rows = [(name, len(ts) // steps, float(np.median(ts)) * len(ts) / steps * 1e3) for name, ts in times.items()]
    return plain_ms, sorted(rows, key=lambda row: -row[2])


def profile_prefill(model, prompt: list[int], chunk: int = PREFILL_CHUNK) -> tuple[float, list[tuple[str, int, float]]]:
    """(ms of the whole prefill, [(function, calls, ms in all)] sorted by time) of ``prompt`` from empty in passes of
    ``chunk`` tokens (as ``CompiledModel.prefill`` splits it), timed with the VM's instrument."""
    vm = relax.VirtualMachine(model.kernel_library.runtime_module, model.device)
    get = tvm.get_global_func
    begin, end = get("vm.builtin.kv_state_begin_forward"), get("vm.builtin.kv_state_end_forward")
    times = _instrument(vm)
    kv = vm["create_paged_kv_cache"](_shape([1]), _shape([len(prompt) + 64]), _shape([chunk]), _shape([16]),
                                     _shape([0]))
    get("vm.builtin.kv_state_add_sequence")(kv, 0)
    started = time.perf_counter()
    for at in range(0, len(prompt), chunk):
        part = prompt[at: at + chunk]
        begin(kv, _shape([0]), _shape([len(part)]))
        vm["prefill"](tvm.runtime.tensor(np.array(part, np.int32)),
                      tvm.runtime.tensor(np.array([len(part) - 1], np.int32)), kv, model._params)
        end(kv)
    total_ms = (time.perf_counter() - started) * 1e3
    rows = [(name, len(ts), float(np.sum(ts)) * 1e3) for name, ts in times.items()]
    return total_ms, sorted(rows, key=lambda row: -row[2])


def print_prefill_profile(model, prompt: list[int]) -> None:
    total_ms, rows = profile_prefill(model, prompt)
    print(f"\nprefill of {len(prompt)} tokens: {total_ms:.0f} ms with the instrument; by packed function:\n\n"
          "| function | calls | ms | share |\n|---|---|---|---|")
    for name, calls, ms in rows[:15]:
        print(f"| {name} | {calls} | {ms:.1f} | {ms / total_ms:.0%} |")


def print_profile(model, prompt: list[int], verify: int = 0, batch: int = 1) -> None:
    plain_ms, rows = profile_decode(model, prompt, verify=verify, batch=batch)
    what = f"verify of {verify} tokens" if verify else f"decode step of {batch} sequences"
    print(f"\none {what} after {len(prompt)} tokens: {plain_ms:.2f} ms plain; by packed function "
          "(VM instrument, median call x calls per step):\n\n| function | calls | ms per step |\n|---|---|---|")
    for name, calls, ms in rows:
        print(f"| {name} | {calls} | {ms:.3f} |")
    print(f"| sum | | {sum(row[2] for row in rows):.2f} |")
