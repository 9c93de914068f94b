"""How many of TVM's CPU threads a step's kernels use: one core fewer while a grammar compiles beside the steps.

TVM's CPU thread pool has one thread per core and splits each parallel kernel evenly over them, so a kernel ends
when its slowest thread does. A grammar compile on the grammar thread (``engine_core.py``) takes one of those cores
for up to a second: the pool thread that shares it runs at a fraction of its speed and the stepping thread waits
for it at every kernel, so the step beside the compile took 0.5-0.9 s where the others took 50-60 ms (traced with
py-spy: the stepping thread spinning in TVM's wait, not waiting for the GIL; docs/benchmarks.md, "Mixed load").
While a compile runs, the steps therefore use the pool minus one thread (at least one), and the whole pool again
once no compile is left: a step beside a compile takes up to twice a plain one instead of ten times.

Every kernel splits its work over outputs, never a reduction, so its results are bit for bit the same with any
number of threads (tests/test_step_threads.py); the switch itself (``runtime.config_threadpool``) costs ~30 us.
TVM keeps one pool per calling thread, so the size is set, and remembered, per thread: the one that steps.
"""

from __future__ import annotations

import threading

#: TVM's ``ThreadGroup::kBig``: the pool's threads over the (big) cores, as TVM makes a pool by default.
_AFFINITY_BIG = 1


class StepThreads:
    """The stepping thread's pool size: whole, or one fewer while something else takes a core."""

    def __init__(self) -> None:
        import tvm  # with the engine's kernels, not at import

        self._configure = tvm.get_global_func("runtime.config_threadpool")
        self._num_threads = tvm.get_global_func("runtime.NumThreads")
        self._sizes = _PoolSizes()

    def use(self, beside_other_work: bool) -> int:
        """Size the calling thread's pool for its next kernels: one thread fewer (at least one) when
        ``beside_other_work``, else the whole pool it was made with; returns the size now."""
        sizes = self._sizes
        if sizes.whole == 0:
            sizes.whole = sizes.now = int(self._num_threads())  # makes this thread's pool if it has none yet
        wanted = max(1, sizes.whole - 1) if beside_other_work else sizes.whole
        if wanted != sizes.now:
            self._configure(_AFFINITY_BIG, wanted)
            sizes.now = wanted
        return wanted


class _PoolSizes(threading.local):
    """The calling thread's pool: the size it was made with (0: not seen yet) and its size now."""

    def __init__(self) -> None:
        self.whole = 0
        self.now = 0
