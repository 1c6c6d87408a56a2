"""Several CPU processes joined by torch.distributed (gloo), kept for a test session.

Starting processes that import torch costs seconds each, so the tests share one pool per group
size and send it functions. A hang is a failure, not a stuck run: when a task is not answered by
every rank before its deadline, the pool's processes (only those started here) are terminated and
the test fails saying which ranks did not answer; the next test gets a fresh pool.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp


def _serve(rank, world, init_file, tasks, results, backend="gloo"):
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    results.put((rank, "ready", None))
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args = item
        try:
            out = ("ok", fn(rank, world, *args))
        except BaseException:  # assertion errors included: the parent reports them
            out = ("error", traceback.format_exc())
        results.put((rank, *out))
    # no destroy_process_group: every rank leaves at once, and its exit closes the group


class RankPool:
    """``world`` processes in one group; :meth:`run` calls ``fn(rank, world, *args)`` on each."""

    def __init__(self, world: int, start_timeout: float = 120.0, backend: str = "gloo") -> None:
        self.world = world
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._tmp.name, "init")
        self._tasks = [ctx.Queue() for _ in range(world)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_serve,
                                   args=(r, world, init_file, self._tasks[r], self._results,
                                         backend),
                                   daemon=True)
                       for r in range(world)]
        for p in self._procs:
            p.start()
        got = self._collect(start_timeout, "start")
        errors = [v for status, v in got.values() if status == "error"]
        if errors:
            self.close()
            raise RuntimeError("\n".join(errors))

    def _collect(self, timeout: float, what: str) -> dict[int, tuple[str, object]]:
        deadline = time.monotonic() + timeout
        got: dict[int, tuple[str, object]] = {}
        while len(got) < self.world:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, value = self._results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if not any(p.is_alive() for p in self._procs):
                    break
                continue
            got[rank] = (status, value)
        if len(got) < self.world:
            missing = sorted(set(range(self.world)) - set(got))
            errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(got.items()) if s == "error"]
            self.close()
            raise AssertionError(
                f"ranks {missing} of {self.world} did not answer the {what} within {timeout} s "
                "(a hang; the pool was terminated)" + ("\n" + "\n".join(errors) if errors else "")
            )
        return got

    def run(self, fn, *args, timeout: float = 30.0) -> list:
        """The return values of ``fn`` on every rank, in rank order (errors raise)."""
        for q in self._tasks:
            q.put((fn, args))
        got = self._collect(timeout, f"task {getattr(fn, '__name__', fn)}")
        errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(got.items()) if s == "error"]
        if errors:
            raise AssertionError("\n".join(errors))
        return [got[r][1] for r in range(self.world)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 10
        for p in self._procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
        self._tmp.cleanup()
