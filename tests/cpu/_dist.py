"""Run test functions on N CPU ranks (gloo), one process per rank.

One-off (fresh processes for this call)::

    from _dist import run_distributed

    def _body(rank, world_size, tmp):            # module level: pickled by name
        ...                                      # the default process group is up
        return {"loss": 1.0}                     # anything torch.save can write

    def test_something(tmp_path):
        results = run_distributed(_body, 2, str(tmp_path))   # [rank0's, rank1's]

Reusing the ranks across tests (starting N processes that import torch costs
seconds each on a small CI machine)::

    @pytest.fixture(scope="module")
    def ranks2():
        with DistPool(2, setup=reset_compile_state) as pool:
            yield pool

    def test_a(ranks2):
        ranks2.run(_body, str(tmp_path))

and across test modules: tests/cpu/conftest.py's session-scoped ``shared_ranks2`` and
``shared_ranks4`` (``setup=reset_compile_state``, 600 s), which a module takes with its
own per-call timeout::

    @pytest.fixture(scope="module")
    def ranks2(shared_ranks2):
        return shared_ranks2.view(timeout=300)

What it does for you:

* starts ``world_size`` fresh processes (``torch.multiprocessing``), forked from a
  fork server that only imported torch, Dynamo, Inductor and graphcomp (no forked
  compile or process-group state; ``spawn`` for a pool whose ``env`` changes what
  those imports read, see ``rank_context``), each with ``torch.set_num_threads(threads)``
  so N ranks do not oversubscribe the machine;
* rendezvous on a free TCP port of 127.0.0.1 (retried on a port clash), then
  ``init_process_group("gloo")`` with a collective timeout, so a rank mismatch
  fails instead of hanging forever;
* returns every rank's return value, in rank order;
* re-raises a failure as ``RankError`` carrying every failing rank's traceback;
* kills the ranks and raises ``TimeoutError`` when a call exceeds ``timeout``
  seconds (a deadlock in collectives, say);
* after a failure or a timeout a pool's processes are killed (their state is
  unknown) and the next ``run`` starts fresh ones;
* ``setup`` (a module-level function, optional) runs on every rank before every
  task, e.g. to reset compile caches between tests sharing a pool;
* on close: a barrier (rank 0 hosts the rendezvous store, so no rank may leave
  while another still talks to it), then ``destroy_process_group``.

Environment for the children: ``env`` (a mapping) is applied in each rank before
torch is imported; Inductor compiles each rank's C++ kernels on 2 threads
(``TORCHINDUCTOR_COMPILE_THREADS=2``) unless ``env`` says otherwise. Without Triton (the
CPU build) that is a thread pool running g++, not a pool of worker processes; two ranks
compiling the same kernels wait on Inductor's per-kernel file lock, so with one thread
each the second core idled while the first ran g++ (test_inductor_order.py, cold
Inductor cache, this 2-core machine: 126 s at 1 thread, 95 s at 2).
"""

from __future__ import annotations

import datetime
import io
import os
import pickle
import queue
import socket
import time
import traceback
import weakref
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["DistPool", "PoolView", "RankError", "free_port", "rank_context", "reset_compile_state", "run_distributed",
           "stop_fork_server"]

_DEFAULT_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "2", "OMP_NUM_THREADS": "1"}
_GRACE_S = 5.0  # after one rank fails, how long to wait for the others' reports


def reset_compile_state() -> None:
    """A shared pool's ``setup``: Dynamo's caches and graphcomp's session reset on every
    rank before every task, so each task compiles as in fresh processes."""
    import torch
    import graphcomp

    torch._dynamo.reset()
    graphcomp.reset()


def _canonical(x: Any) -> Any:
    """``x`` with every dict as its sorted items (a key that ignores insertion order)."""
    if isinstance(x, dict):
        return tuple(sorted((repr(k), _canonical(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return type(x)(_canonical(v) for v in x)
    return x


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankError(RuntimeError):
    """One or more ranks raised: the message carries their tracebacks."""


def _is_addr_in_use(text: str) -> bool:
    s = text.lower()
    return "address already in use" in s or "eaddrinuse" in s


# What a rank imports before its first task, preloaded once in the fork server (see
# rank_context): torch, Dynamo, Inductor's compile entry point and graphcomp, 5.5 s of
# CPU per process on this machine, and transformers (2.5 s more; the Hugging Face
# tasks of the shared pools import it; skipped where it is not installed), all
# single-threaded (no thread is running when the server forks).
_PRELOAD = ("torch", "torch.distributed", "torch.multiprocessing", "torch._dynamo", "torch._inductor.compile_fx",
            "graphcomp", "transformers")
# environment variables the ranks read when they are used, not when torch or graphcomp
# is imported: a pool whose ``env`` sets only these (beyond the defaults) may fork
# from the server; any other setting (an Inductor or OpenMP variable, read at import)
# spawns its ranks
_CALL_TIME_ENV = frozenset({"GRAPHCOMP_DEBUG", "GRAPHCOMP_AGREE_TIMEOUT", "GRAPHCOMP_DUMP_DIR"})
_ENV_AT_IMPORT = dict(os.environ)  # (imported at collection: before any test's monkeypatch.setenv)


def rank_context(env: Mapping[str, str] | None = None) -> Any:
    """The multiprocessing context rank processes start from: ``forkserver`` with
    :data:`_PRELOAD` imported once in the server, which each rank forks from (a rank
    otherwise imports them itself: about 40 rank processes per suite at 5.5 s of CPU
    each), or ``spawn`` when ``env`` changes a variable read at import. The server
    starts with the environment this module saw at import plus :data:`_DEFAULT_ENV`
    (what ``_worker`` applies before importing torch), whatever a test has set since;
    it holds no threads and no process group, Dynamo cache or compiled graph: only
    imported modules."""
    import torch.multiprocessing as mp

    env = dict(_DEFAULT_ENV if env is None else env)
    if any(env.get(k) != v for k, v in _DEFAULT_ENV.items()) or set(env) - set(_DEFAULT_ENV) - _CALL_TIME_ENV:
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    want = {**_ENV_AT_IMPORT, **_DEFAULT_ENV}
    saved = {k: os.environ.get(k) for k in set(want) | set(os.environ)}
    try:
        for k in saved:
            if k not in want:
                del os.environ[k]
            elif os.environ.get(k) != want[k]:
                os.environ[k] = want[k]
        forkserver.set_forkserver_preload(list(_PRELOAD))
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            elif os.environ.get(k) != v:
                os.environ[k] = v
    return mp.get_context("forkserver")


def stop_fork_server(timeout: float = 30.0) -> None:
    """Close this process's end of the fork server's "alive" pipe and wait for the
    server to exit (tests/cpu/conftest.py calls it when pytest ends). The server
    reaps the ranks forked from it; waiting for it here hands their CPU time to this
    process's children (what ``time`` or ``/usr/bin/time -v`` on the suite counts),
    where an unwaited server would leave the ranks' CPU out of the count. Gives up
    after ``timeout`` seconds (a rank still alive keeps the server up)."""
    from multiprocessing import forkserver

    fs = forkserver._forkserver
    pid = fs._forkserver_pid
    if pid is None:
        return
    try:
        os.close(fs._forkserver_alive_fd)
    except OSError:
        pass
    fs._forkserver_pid = fs._forkserver_alive_fd = fs._forkserver_address = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        time.sleep(0.05)


def _freeze_survivors() -> None:
    """Before each task: collect, then move every object still alive (torch, Dynamo,
    Inductor, sympy, transformers: ~470k objects once a task has compiled) to the
    garbage collector's permanent generation, so the task's full collections no longer
    walk them. Only what an earlier task left alive after the pool's ``setup`` is
    frozen; what the task itself creates is collected as usual. A tiny sharded Llama's
    compile on 2 ranks, this machine: 0.40 s of garbage collection per rank -> 0.08 s
    (4.6 -> 4.3 s of CPU per compile)."""
    import gc

    gc.collect()
    gc.freeze()


def _worker(
    rank: int,
    world_size: int,
    port: int,
    tasks: Any,
    results: Any,
    env: dict[str, str],
    threads: int,
    coll_timeout: float,
    setup: Callable[[], None] | None,
) -> None:
    os.environ.update(env)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
        }
    )
    import faulthandler

    faulthandler.enable()  # a rank that aborts or segfaults prints its Python stack
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=coll_timeout)
        )
    except BaseException as e:
        results.put(("ready", rank, False, f"rank {rank}: init_process_group failed: {type(e).__name__}: {e}"))
        return
    results.put(("ready", rank, True, None))
    while True:
        msg = tasks.get()
        if msg is None:  # orderly close
            try:
                dist.barrier()
            finally:
                dist.destroy_process_group()
            # exit handlers (multiprocessing's among them), then exit without the
            # interpreter's teardown of everything the tasks compiled (seconds per rank
            # after a long session: the session pools' close at the end of an xdist
            # worker took 17-19 s of CI). Every result was read by the parent before it
            # sent None, so nothing is left to deliver.
            import atexit
            import sys

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        task_id = None
        try:
            task_id, fn, args = pickle.loads(msg)
            if setup is not None:
                setup()
            _freeze_survivors()
            out = fn(rank, world_size, *args)
            buf = io.BytesIO()
            torch.save(out, buf)
            results.put((task_id, rank, True, buf.getvalue()))
        except BaseException as e:
            tb = traceback.format_exc()
            results.put((task_id, rank, False, f"rank {rank}: {type(e).__name__}: {e}\n{tb}"))


def _kill_all(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


class DistPool:
    """``world_size`` gloo ranks kept alive across ``run`` calls."""

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 300.0,
        threads: int = 1,
        env: Mapping[str, str] | None = None,
        setup: Callable[[], None] | None = None,
        retries: int = 2,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self.threads = threads
        self.env = dict(_DEFAULT_ENV)
        self.env.update(env or {})
        self.setup = setup
        self.retries = retries
        self._once: dict[str, list[Any]] = {}  # run_once's results
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._task_id = 0
        self._finalizer: Any = None

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> "DistPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _start(self) -> None:
        last = ""
        for _attempt in range(self.retries + 1):
            ctx = rank_context(self.env)
            self._tasks = [ctx.SimpleQueue() for _ in range(self.world_size)]
            self._results = ctx.Queue()
            port = free_port()
            self._procs = [
                ctx.Process(
                    target=_worker,
                    args=(r, self.world_size, port, self._tasks[r], self._results, self.env, self.threads,
                          self.timeout, self.setup),
                    name=f"dist-rank{r}",
                )
                for r in range(self.world_size)
            ]
            for p in self._procs:
                p.start()
            self._finalizer = weakref.finalize(self, _kill_all, list(self._procs))
            msgs, err = self._collect("ready", self.timeout)
            if err is None and all(m[2] for m in msgs.values()):
                return
            self.kill()
            last = err or "\n".join(m[3] for m in msgs.values() if not m[2])
            if not _is_addr_in_use(last):
                break
        raise RankError(f"could not start {self.world_size} ranks:\n{last}")

    def kill(self) -> None:
        """Kill the ranks now (no barrier)."""
        _kill_all(self._procs)
        if self._finalizer is not None:
            self._finalizer.detach()
        self._procs, self._tasks, self._results = [], [], None

    def close(self) -> None:
        """Orderly shutdown: barrier, destroy_process_group, exit; kill stragglers."""
        if not self._procs:
            return
        if self.alive:
            for q in self._tasks:
                q.put(None)
            deadline = time.monotonic() + 30
            for p in self._procs:
                p.join(timeout=max(0.1, deadline - time.monotonic()))
        self.kill()

    # ------------------------------------------------------------------ run
    def _collect(self, task_id: Any, timeout: float) -> tuple[dict[int, tuple], str | None]:
        """Messages of ``task_id`` by rank; stops early (after a grace period) on
        a failure. Returns (messages, error text for a timeout or a dead rank)."""
        msgs: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        while len(msgs) < self.world_size:
            if any(not m[2] for m in msgs.values()):
                deadline = min(deadline, time.monotonic() + _GRACE_S)
            try:
                m = self._results.get(timeout=0.2)
            except queue.Empty:
                now = time.monotonic()
                dead = [i for i, p in enumerate(self._procs) if not p.is_alive() and i not in msgs]
                if dead:
                    codes = {i: self._procs[i].exitcode for i in dead}
                    return msgs, f"rank(s) {dead} died without a report (exit codes {codes})"
                if now > deadline:
                    if any(not m[2] for m in msgs.values()):
                        return msgs, None
                    missing = sorted(set(range(self.world_size)) - set(msgs))
                    return msgs, (
                        f"timed out after {timeout:.0f} s waiting for rank(s) {missing} "
                        "(a rank hung, e.g. mismatched collectives)"
                    )
                continue
            if m[0] == task_id:
                msgs[m[1]] = m
        return msgs, None

    def run_once(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """``run(fn, *args)`` once per pool for the same function and arguments (dicts
        compared by their items, in any order); later calls return the first results.
        For tasks that start from a fresh compile state with fixed seeds, read by
        several tests: each compile costs seconds of CI."""
        key = repr((fn.__module__, fn.__qualname__, _canonical(args)))
        if key not in self._once:
            self._once[key] = self.run(fn, *args, timeout=timeout)
        return self._once[key]

    def view(self, timeout: float) -> "PoolView":
        """This pool with another default per-call ``timeout`` (a test module's own limit
        on a pool it shares with other modules, see ``shared_ranks2`` in conftest.py)."""
        return PoolView(self, timeout)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; the results in rank order."""
        import torch

        if not self.alive:
            self.kill()
            self._start()
        self._task_id += 1
        payload = pickle.dumps((self._task_id, fn, args))
        for q in self._tasks:
            q.put(payload)
        t = self.timeout if timeout is None else timeout
        msgs, err = self._collect(self._task_id, t)
        failures = [m[3] for _, m in sorted(msgs.items()) if not m[2]]
        if err is not None or failures:
            self.kill()  # state unknown (ranks may sit in a collective): start over next time
            name = getattr(fn, "__name__", repr(fn))
            if err is not None and err.startswith("timed out") and not failures:
                raise TimeoutError(f"{name} on {self.world_size} ranks: {err}; ranks killed")
            raise RankError("\n".join(failures + ([err] if err else [])))
        return [torch.load(io.BytesIO(msgs[r][3]), weights_only=False) for r in range(self.world_size)]


class PoolView:
    """A ``DistPool`` seen with its own default per-call timeout: ``run`` and
    ``run_once`` go to the pool (same ranks, same ``run_once`` results)."""

    def __init__(self, pool: DistPool, timeout: float):
        self.pool = pool
        self.timeout = timeout

    @property
    def world_size(self) -> int:
        return self.pool.world_size

    @property
    def alive(self) -> bool:
        return self.pool.alive

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        return self.pool.run(fn, *args, timeout=self.timeout if timeout is None else timeout)

    def run_once(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        return self.pool.run_once(fn, *args, timeout=self.timeout if timeout is None else timeout)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    threads: int = 1,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh gloo CPU ranks
    and return the results (rank order). ``fn`` must be a module-level function
    and ``args`` picklable."""
    with DistPool(world_size, timeout=timeout, threads=threads, env=env) as pool:
        return pool.run(fn, *args)
