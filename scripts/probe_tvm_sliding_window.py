"""Shows what TVM's per-sequence sliding window does to a compiled model's paged KV cache (docs/model.md, "Pages
outside the window are not reclaimed"): it frees pages, but the query positions it reports restart inside the
window (StreamingLLM's positions, not a sliding-window model's absolute ones).

Run: ``python scripts/probe_tvm_sliding_window.py`` (compiles the tiny random model on first use). It creates the
cache twice from the tiny model's ``create_paged_kv_cache`` (page 16, 256 tokens), once without and once with
``support_sliding_window`` and a window of 32 for the sequence, appends 40, 1, 1 and 30 tokens, and prints the query
positions, the free pages and the sequence length the cache reports after each append (bookkeeping only: the model
is not run).
"""

from __future__ import annotations

from typing import Any

PAGE = 16
WINDOW = 32
APPENDS = (40, 1, 1, 30)


def probe(vm: Any, sliding: bool) -> list[str]:
    """One line per append of ``APPENDS`` to a cache of the model's VM ``vm``: the query positions, free pages and
    length the cache reports."""
    import tvm

    def shape(value: int) -> Any:
        return tvm.runtime.ShapeTuple([value])

    get = tvm.get_global_func
    kv = vm["create_paged_kv_cache"](shape(1), shape(256 + PAGE), shape(64), shape(PAGE), shape(int(sliding)))
    get("vm.builtin.kv_state_add_sequence")(kv, 0)
    if sliding:
        get("vm.builtin.attention_kv_cache_enable_sliding_window_for_seq")(kv, 0, WINDOW, 0)
    lines = []
    for n in APPENDS:
        get("vm.builtin.kv_state_begin_forward")(kv, shape(0), shape(n))
        positions = get("vm.builtin.attention_kv_cache_get_query_positions")(kv).numpy()
        free = get("vm.builtin.attention_kv_cache_get_num_available_pages")(kv)
        length = get("vm.builtin.attention_kv_cache_get_total_sequence_length")(kv)
        get("vm.builtin.kv_state_end_forward")(kv)
        lines.append(f"{'window ' + str(WINDOW) if sliding else 'no window'}: append {n:2d} -> query positions "
                     f"{positions[0]}..{positions[-1]}, free pages {free}, sequence length {length}")
    return lines


def main() -> None:
    import tvm
    from logitproc.compile.kernel_library import KernelLibrary
    from logitproc.compile.model_compile import compile_model
    from logitproc.compile.tiny_model import make_tiny_model
    from tvm import relax

    directory = compile_model(make_tiny_model(seed=0, context=4096))
    vm = relax.VirtualMachine(KernelLibrary.load(directory).runtime_module, tvm.cpu())
    for sliding in (False, True):
        print("\n".join(probe(vm, sliding)))


if __name__ == "__main__":
    main()
