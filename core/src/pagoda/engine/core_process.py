"""A spawned engine-core process, before and after it has its config; the standby core of `pagoda serve`.

``CoreProcess`` spawns ``pagoda.engine.core_proc.run_engine_core`` with no
config: the process connects its two ZMQ sockets, imports what every engine core
needs (torch, the engine, the model runner) and then waits for
``("config", (EngineConfig, Platform))`` on its command socket. ``MPClient``
sends it as soon as the config is resolved.

Spawned before the config exists, the engine core's imports overlap the API
process's own imports and config resolution instead of following them: `pagoda
serve` starts one first thing (``start_standby_core``), and the ``MPClient`` of
replica 0 takes it (``take_standby_core``) instead of spawning its own. An engine
that runs its core in a thread (or a tensor-parallel one) discards it
(``discard_standby_core``); the standby also exits by itself when the API process
dies (it watches the same parent pipe as a serving core).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


def _cleanup(proc: multiprocessing.process.BaseProcess, ctx: Any, sockdir: str) -> None:
    # the finalizer's body: it must not reference the CoreProcess, or that is never collected
    if proc.is_alive():
        proc.kill()
        proc.join(2.0)
    ctx.destroy(linger=0)
    shutil.rmtree(sockdir, ignore_errors=True)


class CoreProcess:
    """One spawned engine-core process and the API process's ends of its sockets and parent pipe."""

    def __init__(self, replica_rank: int = 0, log_level: int | None = None,
                 config_imports: bool | UnlessCachedGGUF = True) -> None:
        import zmq

        from pagoda.engine.core_proc import run_engine_core

        self.replica_rank = replica_rank
        self.sockdir = tempfile.mkdtemp(prefix="pagoda-core-")
        in_addr = f"ipc://{os.path.join(self.sockdir, 'in')}"
        out_addr = f"ipc://{os.path.join(self.sockdir, 'out')}"
        self.ctx = zmq.Context(io_threads=1)
        self.inp = self.ctx.socket(zmq.PUSH)
        self.out = self.ctx.socket(zmq.PULL)
        self.inp.bind(in_addr)
        self.out.bind(out_addr)
        mp = multiprocessing.get_context("spawn")
        # the core only reads its end; it sees EOF when every copy of ours is closed (we exited)
        child_end, self.parent_end = mp.Pipe(duplex=False)
        level = logging.getLogger("pagoda").getEffectiveLevel() if log_level is None else log_level
        # not a daemon: a core may start worker processes of its own (the mp executor)
        self.proc = mp.Process(target=run_engine_core, args=(in_addr, out_addr, child_end, replica_rank, level,
                                                                 config_imports),
                               name=f"pagoda-engine-core-{replica_rank}", daemon=False)
        self.proc.start()
        child_end.close()
        self.spawned_at = time.perf_counter()
        self.config_sent = False
        self._finalizer = weakref.finalize(self, _cleanup, self.proc, self.ctx, self.sockdir)

    def send_config(self, config: Any, platform: Any, timeout_s: float) -> None:
        """Hand the process its engine config; waits (at most ``timeout_s``) until it has connected."""
        import zmq

        from pagoda.engine.core_proc import dumps

        if self.config_sent:
            raise RuntimeError("the engine core process already has its config")
        frame = dumps("config", (config, platform))
        # a PUSH socket with no peer yet blocks on send: wait for the peer, or for the process's death
        poller = zmq.Poller()
        poller.register(self.inp, zmq.POLLOUT)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        events = dict(poller.poll(int(timeout_s * 1000)))
        if self.inp not in events:
            from pagoda.engine.mp_client import EngineCoreStartupError

            if self.proc.sentinel in events:
                self.proc.join(1.0)
                raise EngineCoreStartupError(
                    f"the engine core process exited with code {self.proc.exitcode} before it took its config"
                    f"{self._failure()}")
            raise EngineCoreStartupError(f"the engine core process did not connect in {timeout_s:.0f} s")
        self.inp.send(frame, copy=False)
        self.config_sent = True

    def _failure(self) -> str:
        """The traceback a process that failed before its config sent, if it sent one."""
        import zmq

        from pagoda.engine.core_proc import loads

        try:
            kind, payload = loads(self.out.recv(zmq.NOBLOCK))
        except zmq.Again:
            return ""
        return f":\n{payload}" if kind == "startup_failed" else ""

    def close(self) -> None:
        """Kill the process if it still runs; free the sockets and their folder (idempotent)."""
        self._finalizer()


_standby: CoreProcess | None = None
# a many-model server spawns spares from its event loop while a load's thread takes one
_standby_lock = threading.Lock()


def start_standby_core(config_imports: bool | UnlessCachedGGUF = True) -> CoreProcess:
    """Spawn replica 0's engine-core process now, before the config exists (one at a time: the next engine
    to start takes it; a many-model server keeps one spare this way, ``ModelPool``).
    ``config_imports``: whether it should import transformers' config classes ahead (``run_engine_core``)."""
    global _standby
    with _standby_lock:
        if _standby is not None:
            return _standby
        _standby = CoreProcess(0, config_imports=config_imports)
        # before multiprocessing's own exit hook (atexit runs last-registered first), which joins every
        # non-daemon child: a standby nobody took (the start failed before the config) would be waited for
        atexit.unregister(discard_standby_core)  # (registered once, and last)
        atexit.register(discard_standby_core)
        logger.info("engine core 0 spawned as process %d ahead of the config (it imports while this process "
                    "resolves the config)", _standby.proc.pid)
    return _standby


def take_standby_core(replica_rank: int) -> CoreProcess | None:
    """The standby core for ``replica_rank`` (0 only), if one was started; it is then the caller's."""
    global _standby
    with _standby_lock:
        core = _standby
        if replica_rank != 0 or core is None:
            return None
        _standby = None
    # a standby that died meanwhile is taken all the same: sending it the config reports why it died
    return core


def discard_standby_core() -> None:
    """Stop a standby core nobody will take (the engine runs its core in a thread, or failed before)."""
    global _standby
    with _standby_lock:
        core, _standby = _standby, None
    if core is not None:
        core.close()


@dataclass(frozen=True)
class UnlessCachedGGUF:
    """A standby core's ``config_imports``: transformers' config classes unless this GGUF file's (None: the
    embedded default's) config is in pagoda's convert cache, which makes it plain values. The core looks
    once torch and the engine are in (``hf_config.gguf_config_is_plain_values``): on a machine's first start
    the file is read through transformers, so the core needs them after all."""

    model: str | None


def standby_config_imports(model: str | None, model_impl: str = "auto") -> bool | UnlessCachedGGUF:
    """What a standby core for ``model`` imports ahead, decided before the config is read (and before this
    process imports torch): ``True`` unless the model is the embedded default or a ``.gguf`` file. Only
    decides what is imported early; a wrong answer costs time, never correctness (unpickling the config
    imports what it holds)."""
    if model_impl == "transformers" or not (model is None or model.lower().endswith(".gguf")):
        return True
    return UnlessCachedGGUF(model)
