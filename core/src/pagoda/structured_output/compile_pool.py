"""Grammar compiles tried first in worker processes, under a wall-clock and an address-space budget.

A compile is native code that cannot be interrupted from Python: in a thread of the
engine core, a schema that passes the size bounds but compiles slowly ran to its end
whatever ``compile_timeout`` said, and its memory was the engine's (a 10,000-property
schema grew the core to 15 GB and had it OOM-killed). In a process it can be killed:

- when it runs past ``compile_timeout`` seconds (the 400 names that limit);
- when it needs more than ``compile_memory_bytes`` of address space beyond the
  worker's own (``RLIMIT_AS``: the allocation fails, or the worker dies; the 400 names it);
- when no request waits for it any more (every client that asked for it went away).

Only a compile the worker finished runs again in the engine core (in this pool's
thread), which keeps the grammar: sending the worker's back costs more than compiling
it twice (xgrammar's JSON form of a 400-property grammar is 99 MB, 22 s to write).
The worker runs at a lower CPU priority (nice 10), so the engine's steps come first.

A backend takes part by returning a picklable state from ``compile_worker_state``
(xgrammar: its serialised tokenizer info); the worker builds a compiler from it once
(``worker_compiler``) and runs ``worker_compile`` per constraint. Workers are new
interpreters (not forked: the core has threads and a model), started on the first
compile and kept for the next; a killed one is replaced on demand.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from pagoda.structured_output.backend import CompiledGrammar, StructuredOutputBackend, StructuredOutputError
from pagoda.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _worker_main(conn: Connection) -> None:
    """A worker: builds the backend's compiler from its state once, then answers one compile per message."""
    if sys.platform == "linux":
        # an engine core that dies (SIGKILL included) takes its worker along, mid-compile too (the signal follows
        # the thread that started the worker: a CompilePool thread, which lives as long as the pool)
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    backend_path, state, memory_bytes = conn.recv()
    module, _, name = backend_path.rpartition(".")
    cls: type[StructuredOutputBackend] = getattr(importlib.import_module(module), name)
    os.nice(10)
    compiler = cls.worker_compiler(state)
    if memory_bytes:
        # counted from here: the interpreter, the backend's libraries and its compiler are not the grammar's
        limit = _address_space_bytes() + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    conn.send(("ready", None))
    while True:
        try:
            params = conn.recv()
        except EOFError:
            return
        try:
            cls.worker_compile(compiler, params)
            conn.send(("ok", None))
        except MemoryError:
            conn.send(("memory", None))
        except StructuredOutputError as exc:
            conn.send(("error", str(exc)))
        except Exception as exc:  # noqa: BLE001 - a native failure to allocate comes back as a RuntimeError
            text = f"{type(exc).__name__}: {exc}"
            conn.send(("memory" if "bad_alloc" in text else "error", text))


class _Worker:
    """One worker process (``python -m pagoda.structured_output.compile_pool``), spoken to over a socket pair.

    Not multiprocessing's spawn: that re-imports the parent's main module (the CLI, the server) in the child.
    """

    def __init__(self, backend_path: str, state: Any, memory_bytes: int) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-m", "pagoda.structured_output.compile_pool",
                                      str(theirs.fileno())], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send((backend_path, state, memory_bytes))
        self.ready = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait(5)
        self.conn.close()


class CompilePool:
    """Compiles for one backend in up to ``workers`` processes; ``submit`` returns a Future of the grammar."""

    def __init__(self, backend: StructuredOutputBackend, state: Any, workers: int,
                 timeout: float, memory_bytes: int) -> None:
        self.backend = backend
        self._path = f"{type(backend).__module__}.{type(backend).__qualname__}"
        self._state = state
        self.timeout = timeout
        self.memory_bytes = memory_bytes
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._abandoned: set[int] = set()  # ids of futures no request waits for
        # one thread per compile in flight: it only waits on its worker's pipe
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="pagoda-grammar")
        self._closed = False

    def submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        future: Future[CompiledGrammar] = Future()
        self._threads.submit(self._run, future, params)
        return future

    def abandon(self, future: Future[CompiledGrammar]) -> None:
        """No request waits for ``future`` any more: a queued compile never starts, a running one is killed."""
        if not future.cancel():
            with self._lock:
                self._abandoned.add(id(future))

    def _take_worker(self) -> _Worker:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.alive():
                    return worker
                worker.kill()
        return _Worker(self._path, self._state, self.memory_bytes)

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(worker)
                return
        worker.kill()

    def _run(self, future: Future[CompiledGrammar], params: StructuredOutputsParams) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            grammar = self._compile(future, params)
        except BaseException as exc:  # noqa: BLE001 - every outcome lands on the future
            future.set_exception(exc)
        else:
            future.set_result(grammar)
        finally:
            with self._lock:
                self._abandoned.discard(id(future))

    def _compile(self, future: Future[CompiledGrammar], params: StructuredOutputsParams) -> CompiledGrammar:
        worker = self._take_worker()
        try:
            if not worker.ready:
                # spawning and importing the backend is not the grammar's time
                while not worker.conn.poll(_POLL_S):
                    if not worker.alive():
                        raise StructuredOutputError(f"the grammar compile worker failed to start "
                                                    f"(exit code {worker.proc.returncode})")
                    if self._gone(future):
                        raise StructuredOutputError("the constraint's requests went away before it compiled")
                try:
                    worker.conn.recv()
                except (EOFError, OSError):
                    raise StructuredOutputError(f"the grammar compile worker failed to start "
                                                f"(exit code {worker.proc.poll()})") from None
                worker.ready = True
            worker.conn.send(params)
            deadline = time.monotonic() + self.timeout if self.timeout else None
            while True:
                try:
                    has_answer = worker.conn.poll(_POLL_S)
                except (EOFError, OSError):
                    has_answer = True
                if has_answer:
                    break
                if self._gone(future):
                    raise StructuredOutputError("the constraint's requests went away before it compiled")
                if deadline is not None and time.monotonic() > deadline:
                    raise StructuredOutputError(
                        f"the structured output constraint did not compile within {self.timeout:g} s, this "
                        "server's limit (structured_outputs_config compile_timeout)")
                if not worker.alive():
                    break
            try:
                kind, payload = worker.conn.recv()
            except (EOFError, OSError):
                kind, payload = "memory", f"exit code {worker.proc.returncode}"
        except BaseException:
            worker.kill()
            raise
        if kind == "memory":
            worker.kill()  # a failed allocation may leave native state half built: a fresh worker next
            logger.warning("grammar compile over its memory budget (%s)", payload)
            raise StructuredOutputError(
                f"the structured output constraint needed more than {self.memory_bytes} bytes to compile, this "
                "server's limit (structured_outputs_config compile_memory_bytes)")
        self._give_back(worker)
        if kind == "error":
            raise StructuredOutputError(payload)
        # proven to end within the budget: now the engine core's own compile, whose result it keeps
        return self.backend.compile(params)

    def _gone(self, future: Future[CompiledGrammar]) -> bool:
        with self._lock:
            return id(future) in self._abandoned or self._closed

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()
        self._threads.shutdown(wait=False, cancel_futures=True)


if __name__ == "__main__":
    _worker_main(Connection(int(sys.argv[1])))
