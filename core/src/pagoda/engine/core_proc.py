"""The engine core in its own process (vLLM V1's ``EngineCoreProc``).

``run_engine_core`` is the target of a spawned process: it builds an
``EngineCore`` from the engine config it is sent and runs schedule -> execute ->
update, taking commands from one ZMQ socket and pushing each step's
``EngineCoreOutputs`` to another. Tokenization, detokenization and everything
HTTP stay in the API process (``pagoda.engine.mp_client.MPClient``).

Wire format: every message is one pickled tuple ``(kind, payload)`` (protocol
5). Commands in: first ``("config", (EngineConfig, Platform))`` (the process is
spawned before its config exists and imports meanwhile: ``pagoda.engine.core_process``),
then ``("add", EngineCoreRequest)``, ``("abort", [ids])``, ``("shutdown",
None)``. Messages out: ``("ready", supported_tasks)`` once the model is
loaded, ``("startup_failed", traceback text)``, ``("outputs",
EngineCoreOutputs)`` after every step, ``("dead", traceback text)`` if the
loop itself breaks. A step's outputs are token ids and small dataclasses:
pickling them costs tens of microseconds beside a step of tens of
milliseconds (docs/benchmarks.md, session 7), so msgspec buys nothing here.

The process also watches a pipe from its parent: when the parent dies (even
by SIGKILL) the pipe reads EOF and the core exits, so no engine process is
ever orphaned.
"""

from __future__ import annotations

import gc
import logging
import pickle
import traceback
from multiprocessing.connection import Connection
from typing import Any

from pagoda.config import EngineConfig
from pagoda.engine.core_process import UnlessCachedGGUF
from pagoda.platforms import Platform

logger = logging.getLogger(__name__)

# How long the idle core waits on its sockets before re-checking (ms).
_IDLE_POLL_MS = 500


def dumps(kind: str, payload: Any) -> bytes:
    return pickle.dumps((kind, payload), protocol=5)


def loads(frame: bytes) -> tuple[str, Any]:
    kind, payload = pickle.loads(frame)
    return kind, payload


def portable_error(exc: BaseException) -> BaseException:
    """An exception that survives pickling: the original if it round-trips, else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure means: send a plain copy
        return RuntimeError(f"{type(exc).__name__}: {exc}")


_TRANSFORMERS_CONFIG_IMPORTS = ("transformers.configuration_utils", "transformers.modeling_rope_utils",
                                "transformers.utils.type_validators")


def _standby_imports(config_imports: bool | UnlessCachedGGUF) -> bool:
    """What every engine core imports before it can build anything: done before its config arrives, so
    they overlap the API process's own imports and config resolution (``pagoda.engine.core_process``).
    ``config_imports``: the modules of transformers' config classes too (not when the API process expects
    a config of plain values, as a GGUF file's cached one: 3-4 s of imports it would not need). -> whether
    it imported them."""
    import importlib

    import torch  # noqa: F401 - the bulk of the time

    import pagoda.engine.core  # noqa: F401 - the scheduler, KV cache, worker and model runner

    # The config's model section holds transformers' config objects: unpickling it imports their modules,
    # and what those import (activations, hub kernels, torch.distributed.tensor: seconds; py-spy showed it
    # inside loads() when the config came, on the critical path). Module names of this transformers: one
    # another version lacks is skipped.
    if isinstance(config_imports, UnlessCachedGGUF):
        from pagoda.model_loader.hf_config import gguf_config_is_plain_values

        config_imports = not gguf_config_is_plain_values(config_imports.model)
    for name in _TRANSFORMERS_CONFIG_IMPORTS if config_imports else ():
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    return config_imports


def _wait_config(inp: Any, parent_alive: Connection) -> tuple[EngineConfig, Platform] | None:
    """Block until the API process sends ``("config", (config, platform))``; None: it stopped us or died."""
    import zmq

    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    poller.register(parent_alive.fileno(), zmq.POLLIN)
    while True:
        events = dict(poller.poll())
        if inp in events:
            kind, payload = loads(inp.recv())
            if kind == "config":
                config, platform = payload
                return config, platform
            if kind == "shutdown":
                return None
            raise RuntimeError(f"the engine core got {kind!r} before its config")
        if parent_alive.fileno() in events:
            # the parent never writes to this pipe: readable means it closed (the parent is gone)
            return None


def run_engine_core(
    input_address: str,
    output_address: str,
    parent_alive: Connection,
    replica_rank: int = 0,
    log_level: int = logging.WARNING,
    config_imports: bool | UnlessCachedGGUF = True,
) -> None:
    """Entry point of the engine-core process (spawned; every argument is pickled).

    The engine config is not an argument: it comes as the first command, so the process can be spawned
    (and import) before the API process has resolved it.
    """
    import time

    import zmq

    from pagoda.platforms import set_current_platform

    spawned = time.perf_counter()
    # the parent's logging level travels with the spawn; the prefix tells replicas apart
    logging.basicConfig(level=log_level,
                        format=f"%(levelname)s %(asctime)s [engine core {replica_rank}] %(name)s: %(message)s")
    ctx = zmq.Context(io_threads=1)
    inp = ctx.socket(zmq.PULL)
    out = ctx.socket(zmq.PUSH)
    inp.connect(input_address)
    out.connect(output_address)
    try:
        config_imported = _standby_imports(config_imports)
        imported = time.perf_counter()
        got = _wait_config(inp, parent_alive)
        if got is None:
            out.close(linger=0)
            inp.close(linger=0)
            ctx.term()
            return
        config, platform = got
        logger.info("engine core imports took %.2f s (torch, the engine%s); its config came %.2f s after them",
                    imported - spawned, ", transformers' config classes" if config_imported else "",
                    time.perf_counter() - imported)
        set_current_platform(platform)
        from pagoda.engine.core import EngineCore

        core = EngineCore(config, platform)
        tasks = core.get_supported_tasks()
        # What start-up built lives as long as this process: the block pool alone is an object per KV block
        # (524,288 for a tiny test model in a 4 GiB cache), linked both ways. Frozen out of the collector,
        # a full collection during serving no longer walks it, nor does the one at exit (a pool of that size:
        # 1.9-2.5 s -> 0.15 s to exit, 2 vCPUs under load). vLLM's engine core freezes its start-up heap too.
        # Only here, in a process of the engine's own: frozen objects are never freed, and an in-process
        # engine's may become garbage while its process goes on.
        gc.collect()
        gc.freeze()
    except BaseException:  # noqa: BLE001 - the parent reports it as the start-up error
        out.send(dumps("startup_failed", traceback.format_exc()))
        out.close(linger=2000)
        inp.close(linger=0)
        ctx.term()
        return
    out.send(dumps("ready", tasks))
    try:
        EngineCoreProc(core, inp, out, parent_alive).run()
    except BaseException:  # noqa: BLE001 - the loop broke: tell the parent, then exit
        logger.exception("engine core loop died")
        try:
            out.send(dumps("dead", traceback.format_exc()))
        except Exception:  # noqa: BLE001 - the socket may be the thing that broke
            pass
    finally:
        core.shutdown()  # the workers, when they run in processes (or actors) of their own
        out.close(linger=1000)
        inp.close(linger=0)
        ctx.term()


class EngineCoreProc:
    """The busy loop of the engine-core process: drain commands, step, push outputs."""

    def __init__(self, core: Any, inp: Any, out: Any, parent_alive: Connection) -> None:
        import zmq

        self.core = core
        self.inp = inp
        self.out = out
        self.parent_alive = parent_alive
        self.poller = zmq.Poller()
        self.poller.register(inp, zmq.POLLIN)
        self.poller.register(parent_alive.fileno(), zmq.POLLIN)
        self.stopping = False

    def _drain(self, timeout_ms: int) -> bool:
        """Apply every queued command; wait up to ``timeout_ms`` for the first one. -> whether any came."""
        import zmq

        events = dict(self.poller.poll(timeout_ms))
        if self.parent_alive.fileno() in events:
            # the parent never writes to this pipe: readable means it closed (the parent is gone)
            logger.warning("the API process is gone; the engine core exits")
            self.stopping = True
            return False
        if self.inp not in events:
            return False
        core = self.core
        while True:
            try:
                frame = self.inp.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return True
            kind, payload = loads(frame)
            if kind == "add":
                core.add_request(payload)
            elif kind == "abort":
                core.abort_requests(payload)
            elif kind == "utility":
                self._utility(*payload)
            elif kind == "shutdown":
                self.stopping = True
                return True
            else:
                raise RuntimeError(f"unknown engine-core command {kind!r}")

    def run(self) -> None:
        from pagoda.engine.core_client import step_and_hand_off
        from pagoda.engine.messages import EngineCoreOutputs

        core = self.core
        while not self.stopping:
            got = self._drain(0 if core.has_work() else _IDLE_POLL_MS)
            if self.stopping:
                break
            if not core.has_work():
                if got:
                    # an abort-only batch still changes the gauges
                    self._send_outputs(EngineCoreOutputs(scheduler_stats=core.make_stats()))
                continue
            step_and_hand_off(core, self._send_outputs, portable_error)

    def _utility(self, call_id: int, method: str, args: tuple[Any, ...]) -> None:
        """A front end's utility call (pagoda.engine.core_client.UTILITY_METHODS): (id, result, error) back."""
        from concurrent.futures import Future

        from pagoda.engine.core_client import UTILITY_METHODS, run_utility

        future: Future[Any] = Future()
        if method not in UTILITY_METHODS:
            future.set_exception(ValueError(f"{method!r} is not an engine-core utility"))
        else:
            run_utility(self.core, method, args, future)
        error = future.exception()
        self.out.send(dumps("utility", (call_id, None if error else future.result(),
                                        None if error is None else portable_error(error))))

    def _send_outputs(self, batch: Any) -> None:
        self.out.send(dumps("outputs", batch))
