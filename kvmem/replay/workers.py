"""Replays run side by side in worker processes: a sweep's, a policy comparison's and a capacity search's.

`ReplayPool(trace, jobs, engine)` hands each worker the trace once (a pickle, when it starts) and replays
configurations in batches (`run`), as many at once as there are workers; with one job it replays in this process,
with a progress bar per replay. Workers are started with "spawn" (a forked child of a process that loaded torch
and OpenBLAS may deadlock in their thread pools). Ctrl-C reaches every process of the group, and only this one
answers it, by killing the workers at once (no traceback of theirs) and raising KeyboardInterrupt, as SIGTERM
does (`kill_workers`): a worker ignores SIGINT, and is started with it blocked (`sigint_blocked`: a blocked signal
stays blocked across exec, so one that comes while the worker starts up waits, and is then ignored). A worker
that outlives this process (one a Ctrl-C caught while the pool was still starting it, before this process knew of
it) exits as soon as it sees this process gone (`init_worker`), instead of waiting for work forever.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed

_worker_trace = None


def _set_worker_trace(trace) -> None:
    global _worker_trace
    init_worker()
    _worker_trace = trace


def init_worker() -> None:
    """In a worker's initializer: SIGINT ignored from now on, and unblocked (see `sigint_blocked`); the worker exits
    when the process that started it is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_when_gone, args=(parent.sentinel,), daemon=True).start()


def _exit_when_gone(parent_sentinel: int) -> None:
    multiprocessing.connection.wait([parent_sentinel])
    os._exit(1)


def _replay_in_worker(config, engine: str):
    from kvmem.replay.engine import replay

    return replay(_worker_trace, config, engine=engine)


def kill_workers() -> None:
    """Kills this process's worker processes, at once and silently, even one still starting up."""
    for child in multiprocessing.active_children():
        child.kill()


class ReplayPool:
    """Replays of one trace on `jobs` worker processes (in this process when jobs is 1), opened as a context."""

    def __init__(self, trace, jobs: int, engine: str = "native") -> None:
        self.trace, self.jobs, self.engine = trace, jobs, engine
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> ReplayPool:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if self._pool is None:
            return
        if kind is not None:  # interrupted, terminated or failed: the replays still running are not wanted
            kill_workers()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def run(self, configs: Sequence, progress: bool = False) -> list:
        """The ReplayReport of each config, in order: in this process (a progress bar per replay) with one job or
        at most one config on the Python engine, else those on the workers (a bar over replays) while the native
        engine replays the rest here: a native replay takes about as long as a worker's start, which imports torch."""
        # The Python engine imports torch: only once the arguments are good.
        from kvmem.replay.engine import engine_for, replay

        pooled = [] if self.jobs == 1 else [i for i, c in enumerate(configs) if engine_for(self.engine, c) == "python"]
        if len(pooled) < 2:
            return [replay(self.trace, c, progress, self.engine) for c in configs]
        if self._pool is None:  # started at the first replays that need it, kept for the next
            self._pool = ProcessPoolExecutor(self.jobs, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_set_worker_trace, initargs=(self.trace,))
        with sigint_blocked():
            futures = {self._pool.submit(_replay_in_worker, configs[i], self.engine): i for i in pooled}
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(configs), unit="replay", file=sys.stderr, dynamic_ncols=True)
        reports = [None] * len(configs)
        for i in sorted(set(range(len(configs))) - set(pooled)):
            reports[i] = replay(self.trace, configs[i], engine=self.engine)
            if bar is not None:
                bar.update(1)
        for future in as_completed(futures):
            reports[futures[future]] = future.result()
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return reports


class sigint_blocked:
    """SIGINT blocked in this thread while a pool starts workers (they inherit it until their initializer calls
    `worker_ignores_sigint`); a Ctrl-C that comes meanwhile is delivered here once it is unblocked."""

    def __enter__(self) -> None:
        self._previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    def __exit__(self, *exc) -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, self._previous)


def replay_all(trace, configs: Sequence, jobs: int, progress: bool, engine: str = "native") -> list:
    """The ReplayReport of each config, in order, from `engine` (see kvmem.replay.engine), `jobs` at a time."""
    with ReplayPool(trace, min(jobs, len(configs)), engine) as pool:
        return pool.run(configs, progress)
