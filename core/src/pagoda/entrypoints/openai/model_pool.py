"""Many models behind one port: the pool that loads, routes and evicts them (pagoda beyond vLLM; issue 36).

Each served model is a ``ModelEntry``: its ``ModelSpec`` (engine arguments, names, LoRA modules, keep-alive),
its state, and while loaded the ``ServingContext`` of its own ``AsyncLLM`` (its own engine-core process).
A request names its model; ``acquire`` answers that model's context, loading it first when it is not
loaded (one load at a time; waiters share it, a bounded wait, a client that goes away leaves the queue).
While a request holds a model (from the route's lookup to the end of its response body, released by
``ModelLeaseMiddleware``) the model is never evicted. Before a load the pool makes room: the least
recently used idle models go until ``max_loaded_models`` and the memory budget (weights + KV cache, as
each engine reports it) allow the new one. A model that goes is parked: its engine sleeps (level 1 keeps
the weights, level 2 frees them too) in its live process, and the next request wakes it; past
``max_parked_models`` the least recently used parked engine shuts down for real. The awake engines share
the CPUs: each runs on its own slice (``rebalance``). A monitor parks models idle past their keep-alive,
and unloads one whose engine core died (it answers 503 meanwhile; the next request loads it again): one
model's death never stops the server. docs/server.md, "Many models on one port".
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Receive, Scope, Send

from pagoda.config import EngineArgs
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.serving_common import ServingContext, until_disconnected
from pagoda.worker.cpu_share import split_cpus

logger = logging.getLogger(__name__)

# "sleeping": parked, its engine asleep in its live process (sleep_level 1 or 2); "loading" covers a wake too
ModelState = Literal["unloaded", "loading", "loaded", "sleeping", "failed"]
# Why the pool must make room: too many awake models, or too many bytes held.
Pressure = Literal["count", "memory"]

# Seconds between the monitor's passes (keep-alive expiry, engine deaths).
MONITOR_INTERVAL = 0.5
# The scope key the lease middleware keeps a request's held models under.
LEASES_KEY = "pagoda.model_leases"

_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_keep_alive(value: Any) -> float | None:
    """Ollama's ``keep_alive``: seconds (a number) or a duration ("30s", "5m", "1h"); negative = for ever
    (None); 0 = unload once the request is done. ValueError for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be a number of seconds or a duration such as '5m', got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    else:
        raise ValueError(f"keep_alive must be a number of seconds or a duration such as '5m', got {value!r}")
    return None if seconds < 0 else seconds


class ModelSpec(BaseModel):
    """One model of a many-model server: what ``--models-config`` names per entry (or a positional MODEL)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    engine_args: EngineArgs
    served_model_names: list[str] = Field(min_length=1)
    lora_modules: list[str] = Field(default_factory=list)
    # seconds idle before the model unloads; None = the server's --model-idle-timeout
    keep_alive: float | None = None


def spec_for_model(model: str, base: EngineArgs) -> ModelSpec:
    """A positional MODEL of a many-model `pagoda serve`: the command line's engine options, served as given."""
    return ModelSpec(engine_args=base.model_copy(update={"model": model, "served_model_name": model}),
                     served_model_names=[model])


def spec_from_entry(entry: Any, base: EngineArgs, where: str) -> ModelSpec:
    """One ``--models-config`` entry: engine arguments (over the command line's), ``served_model_name`` (a
    name or a list), ``lora_modules`` (as --lora-modules) and ``keep_alive`` (seconds or "5m")."""
    from pydantic import ValidationError

    from pagoda.entrypoints.openai.serving_models import LoRAModulePath

    if not isinstance(entry, dict):
        raise ValueError(f"{where}: each model is a mapping of options, got {type(entry).__name__}")
    options = {str(k).replace("-", "_"): v for k, v in entry.items()}
    names = options.pop("served_model_name", None)
    lora_modules = options.pop("lora_modules", None) or []
    keep_alive = parse_keep_alive(options.pop("keep_alive")) if "keep_alive" in options else None
    if "model" not in options:
        raise ValueError(f"{where}: 'model' is missing (a directory, .gguf file or hub id)")
    if isinstance(names, str):
        names = [names]
    if names is not None and (not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names)):
        raise ValueError(f"{where}: served_model_name must be a name or a list of names")
    if not isinstance(lora_modules, list) or not all(isinstance(m, str) for m in lora_modules):
        raise ValueError(f"{where}: lora_modules must be a list of name=path (or JSON) strings")
    for module in lora_modules:
        LoRAModulePath.parse(module)
    names = names or [str(options["model"])]
    try:
        engine_args = EngineArgs.model_validate({**base.model_dump(), **options, "served_model_name": names[0]})
    except ValidationError as exc:
        raise ValueError(f"{where} ({names[0]}): {exc}") from None
    if lora_modules and not engine_args.enable_lora:
        raise ValueError(f"{where} ({names[0]}): lora_modules needs enable_lora: true")
    return ModelSpec(engine_args=engine_args, served_model_names=names, lora_modules=lora_modules,
                     keep_alive=keep_alive)


def specs_from_config(path: str, base: EngineArgs) -> list[ModelSpec]:
    """``--models-config FILE``: YAML ``models:`` (a list of entries, see ``spec_from_entry``)."""
    from pathlib import Path

    import yaml

    try:
        data = yaml.safe_load(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"--models-config: cannot read {path!r}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"--models-config: {path!r} is not valid YAML: {exc}") from exc
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, list) or not models:
        raise ValueError(f"--models-config: {path!r} needs a non-empty list under 'models:'")
    unknown = set(data) - {"models"}
    if unknown:
        raise ValueError(f"--models-config: unknown top-level key(s) {sorted(unknown)} (only 'models')")
    return [spec_from_entry(entry, base, f"--models-config {path} models[{i}]") for i, entry in enumerate(models)]


def served_name_index(specs: list[ModelSpec]) -> dict[str, int]:
    """Served name -> the index of its model; ValueError when two models claim one name."""
    index: dict[str, int] = {}
    for i, spec in enumerate(specs):
        for name in spec.served_model_names:
            if name in index:
                raise ValueError(f"two models are served as {name!r}: give each its own served_model_name")
            index[name] = i
    return index


@dataclass
class ModelEntry:
    spec: ModelSpec
    state: ModelState = "unloaded"
    ctx: ServingContext | None = None
    # why it failed to load, or why its engine died (shown in /v1/models)
    error: str | None = None
    load_task: asyncio.Task[None] | None = None
    leases: int = 0
    last_used: float = field(default_factory=time.monotonic)
    # the latest request's keep_alive (Ollama's rule: each request sets it); unset: the spec's or the pool's
    keep_alive: float | None = None
    keep_alive_set: bool = False
    memory_bytes: int | None = None
    # what a level-1 sleep keeps (the memory budget counts it while parked)
    weights_bytes: int | None = None
    load_seconds: float | None = None
    loads: int = 0
    # parked: the level its engine sleeps at (0 = awake or no engine)
    sleep_level: int = 0
    wake_seconds: float | None = None
    wakes: int = 0
    # what its engine core reported for its last CPU share (one dict per rank; pagoda.worker.cpu_share.CpuShare)
    cpu_share: list[dict[str, Any]] | None = None

    @property
    def name(self) -> str:
        return self.spec.served_model_names[0]

    @property
    def idle(self) -> bool:
        return self.state == "loaded" and self.leases == 0


class _LoadBusy(RuntimeError):
    """No model could be evicted to make room: every loaded one is serving."""


Loader = Callable[[ModelSpec], Awaitable[ServingContext]]


class ModelPool:
    def __init__(self, specs: list[ModelSpec], loader: Loader, *, max_loaded_models: int | None = None,
                 memory_budget_bytes: int | None = None, idle_timeout_s: float | None = None,
                 load_timeout_s: float = 600.0, max_parked_models: int = 0, cpus: list[int] | None = None,
                 spare_core: Callable[[list[ModelSpec]], None] | None = None) -> None:
        self.entries = [ModelEntry(spec) for spec in specs]
        self._by_name = {name: self.entries[i] for name, i in served_name_index(specs).items()}
        self._loader = loader
        self.max_loaded_models = max_loaded_models
        self.memory_budget_bytes = memory_budget_bytes
        self.idle_timeout_s = idle_timeout_s
        self.load_timeout_s = load_timeout_s
        self.max_parked_models = max_parked_models
        # the CPUs the awake engines divide between them: those this server may run on (taskset is honoured)
        self.cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
        # one load at a time: two at once would double the peak memory and split the CPU between them
        self._load_lock = asyncio.Lock()
        self._monitor: asyncio.Task[None] | None = None
        # spawns an engine-core process ahead of the next load, given the models that may need it
        self._spare_core = spare_core
        self._stopping = False

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    # -- routing -----------------------------------------------------------------------------
    def lookup(self, model: str | None) -> ModelEntry:
        """The entry ``model`` names: a served name or a loaded model's LoRA adapter; none = the first model."""
        if model is None:
            return self.entries[0]
        entry = self._by_name.get(model)
        if entry is not None:
            return entry
        for candidate in self.entries:
            if candidate.ctx is not None and model in candidate.ctx.models.lora_requests:
                return candidate
        raise APIError(f"The model `{model}` does not exist; this server serves {self.names}.", 404, "model",
                       code="model_not_found")

    async def acquire(self, raw_request: Request, data: Any) -> ServingContext:
        """The context of the model the request body names, loaded and held until the response ends."""
        model = data.get("model") if isinstance(data, dict) else None
        if model is not None and not isinstance(model, str):
            raise APIError(f"model must be a string, got {type(model).__name__}", 400, "model")
        keep_alive: float | None = None
        has_keep_alive = isinstance(data, dict) and "keep_alive" in data
        if has_keep_alive:
            try:
                keep_alive = parse_keep_alive(data.pop("keep_alive"))
            except ValueError as exc:
                raise APIError(str(exc), 400, "keep_alive") from None
        entry = self.lookup(model)
        self._hold(raw_request, entry)
        if has_keep_alive:
            entry.keep_alive, entry.keep_alive_set = keep_alive, True
        return await self._wait_loaded(entry, raw_request)

    def _hold(self, raw_request: Request, entry: ModelEntry) -> None:
        leases = raw_request.scope.get(LEASES_KEY)
        if leases is None:
            raise RuntimeError("ModelLeaseMiddleware is not installed: a model could be evicted mid-request")
        entry.leases += 1
        entry.last_used = time.monotonic()
        leases.append(entry)

    def release(self, entry: ModelEntry) -> None:
        entry.leases -= 1
        entry.last_used = time.monotonic()

    async def _wait_loaded(self, entry: ModelEntry, raw_request: Request | None) -> ServingContext:
        if entry.state == "failed":
            raise self._failed(entry)
        if entry.state != "loaded":
            task = self._start_load(entry)
            wait = asyncio.wait_for(asyncio.shield(task), self.load_timeout_s)
            try:
                if raw_request is None:
                    await wait
                else:
                    await until_disconnected(raw_request, wait)  # a client gone leaves the queue (499)
            except asyncio.TimeoutError:
                raise APIError(f"The model `{entry.name}` did not load within {self.load_timeout_s:g} s "
                               "(--model-load-timeout); it goes on loading", 503, "model",
                               code="model_loading") from None
            except _LoadBusy as exc:
                raise APIError(str(exc), 503, "model", code="model_busy") from None
            except APIError:
                raise
            except Exception:  # noqa: BLE001 - the load's own error, kept on the entry
                raise self._failed(entry) from None
        assert entry.ctx is not None
        return entry.ctx

    @staticmethod
    def _failed(entry: ModelEntry) -> APIError:
        return APIError(f"The model `{entry.name}` failed to load: {entry.error}", 503, "model",
                        code="model_load_failed")

    # -- loading and eviction ---------------------------------------------------------------------
    def _start_load(self, entry: ModelEntry) -> asyncio.Task[None]:
        if entry.load_task is None or entry.load_task.done():
            entry.state, entry.error = "loading", None
            entry.load_task = asyncio.create_task(self._load(entry))
            # a load nobody waits for any more (all gave up) must not log "exception never retrieved"
            entry.load_task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return entry.load_task

    async def _load(self, entry: ModelEntry) -> None:
        async with self._load_lock:
            if entry.state == "loaded":
                return
            try:
                await self._make_room(entry)
            except _LoadBusy as exc:
                entry.state, entry.error = ("sleeping" if entry.sleep_level else "unloaded"), str(exc)
                raise
            if entry.sleep_level and await self._wake(entry):
                await self._after_change(keep=entry)
                return
            started = time.perf_counter()
            logger.info("loading model %s (%s)", entry.name, entry.spec.engine_args.model or "the default model")
            try:
                ctx = await self._loader(entry.spec)
            except Exception as exc:
                entry.state, entry.error = "failed", f"{type(exc).__name__}: {exc}"
                logger.error("model %s failed to load: %s", entry.name, entry.error)
                raise
            entry.load_seconds = time.perf_counter() - started
            usage = await ctx.engine.get_memory_usage()
            entry.weights_bytes = usage["weights_bytes"]
            entry.memory_bytes = usage["weights_bytes"] + usage["kv_cache_bytes"]
            entry.ctx, entry.state, entry.loads = ctx, "loaded", entry.loads + 1
            entry.last_used = time.monotonic()
            logger.info("model %s loaded in %.1f s (weights + KV cache %.1f MiB)", entry.name, entry.load_seconds,
                        entry.memory_bytes / 2**20)
            await self._after_change(keep=entry)

    async def _wake(self, entry: ModelEntry) -> bool:
        """A parked model back awake in its own process; False (and it is unloaded) if its engine cannot wake."""
        assert entry.ctx is not None
        started = time.perf_counter()
        try:
            await entry.ctx.engine.wake_up()
        except Exception as exc:  # noqa: BLE001 - a dead or broken parked engine: load it afresh instead
            logger.warning("parked model %s did not wake (%s: %s); loading it again", entry.name,
                           type(exc).__name__, exc)
            await self.unload(entry, reason="it did not wake")
            entry.state = "loading"
            return False
        entry.wake_seconds = time.perf_counter() - started
        level, entry.sleep_level = entry.sleep_level, 0
        entry.state, entry.wakes, entry.last_used = "loaded", entry.wakes + 1, time.monotonic()
        logger.info("model %s woke in %.2f s (parked at sleep level %d)", entry.name, entry.wake_seconds, level)
        return True

    async def _after_change(self, keep: ModelEntry) -> None:
        # its size known now: others go while the budget is exceeded; then the CPUs are divided afresh
        await self._fit_budget(keep=keep)
        await self.rebalance()
        self._keep_spare()

    def _keep_spare(self) -> None:
        """An engine-core process spawned and importing (torch, the engine) before a model not in memory is
        asked for: its load then takes it instead of spawning one, ~2 s off a fresh load on 2 Zen 3 vCPUs.
        Spawned after each load or unload, and by the monitor while nothing is in flight (one spare at most).
        Measured (benchmarks.multimodel, 2 vCPUs): a reload 3.7 -> 1.3-1.7 s, a third model 4.2 -> 1.5-1.8 s;
        spawning it only when idle came too late for back-to-back requests (2.3 and 3.4 s)."""
        waiting = [e.spec for e in self.entries if e.state in ("unloaded", "failed")]
        if self._spare_core is not None and waiting and not self._stopping:
            self._spare_core(waiting)

    def _loaded(self) -> list[ModelEntry]:
        return [e for e in self.entries if e.state == "loaded"]

    def _parked(self) -> list[ModelEntry]:
        return [e for e in self.entries if e.state == "sleeping"]

    @staticmethod
    def held_bytes(entry: ModelEntry) -> int:
        """What the budget counts for ``entry``: weights + KV cache awake, the weights parked at level 1,
        nothing at level 2 or unloaded (a parked process's torch runtime is bounded by max_parked_models)."""
        if entry.state == "loaded":
            return entry.memory_bytes or 0
        if entry.state == "sleeping" and entry.sleep_level == 1:
            return entry.weights_bytes or 0
        return 0

    def _pressure(self, incoming: ModelEntry | None) -> Pressure | None:
        loaded = self._loaded()
        count = len(loaded) + (1 if incoming is not None else 0)
        if self.max_loaded_models is not None and count > self.max_loaded_models:
            return "count"
        if self.memory_budget_bytes is not None:
            # a model never loaded has no known size yet: it is counted once it has loaded (_fit_budget)
            others = [e for e in self.entries if e is not incoming and self.held_bytes(e)]
            held = sum(self.held_bytes(e) for e in others)
            if incoming is not None:
                held += incoming.memory_bytes or 0
            # one model alone over the budget is served anyway: there is nothing to give back
            if held > self.memory_budget_bytes and len(others) + (1 if incoming is not None else 0) > 1:
                return "memory"
        return None

    async def _evict_one(self, pressure: Pressure, keep: ModelEntry | None, why: str) -> bool:
        """Give back room: over the budget, a parked engine still holding its weights shuts down first, then
        the least recently used idle model parks at level 2; over the count, it parks at level 1 (its
        weights stay, so waking it only rebuilds its KV cache). False: nothing could go."""
        if pressure == "memory":
            holding = sorted((e for e in self._parked() if e is not keep and self.held_bytes(e)),
                             key=lambda e: e.last_used)
            if holding:
                await self.unload(holding[0], reason=f"parked, {why}")
                return True
        idle = sorted((e for e in self._loaded() if e.idle and e is not keep), key=lambda e: e.last_used)
        if not idle:
            return False
        await self.park(idle[0], level=2 if pressure == "memory" else 1, reason=f"least recently used, {why}")
        return True

    async def _make_room(self, incoming: ModelEntry) -> None:
        """Evict least recently used idle models until ``incoming`` fits; waits (bounded) for one to idle."""
        deadline = time.monotonic() + self.load_timeout_s
        while (pressure := self._pressure(incoming)) is not None:
            if await self._evict_one(pressure, incoming, "to make room for " + incoming.name):
                continue
            if time.monotonic() > deadline:
                raise _LoadBusy(f"The model `{incoming.name}` cannot be loaded now: the loaded models "
                                f"{[e.name for e in self._loaded()]} are all serving requests "
                                "(--max-loaded-models / --models-memory-budget)")
            await asyncio.sleep(0.05)

    async def _fit_budget(self, keep: ModelEntry) -> None:
        """After a load (its size known now): evict idle others while the budget is exceeded."""
        while (pressure := self._pressure(None)) is not None:
            if not await self._evict_one(pressure, keep, "over the memory budget"):
                logger.warning("the loaded models exceed --models-memory-budget and none is idle")
                return

    async def park(self, entry: ModelEntry, level: int, reason: str) -> None:
        """Put an idle model's engine to sleep at ``level`` and keep its process (unload it when parking is
        off or its engine refuses to sleep); then the parked-engine bound and the CPU split are kept."""
        if self.max_parked_models == 0 or entry.ctx is None:
            await self.unload(entry, reason=reason)
            await self.rebalance()
            return
        # not "loaded" from here on: a request arriving meanwhile waits for the wake, not for this engine
        entry.state = "sleeping"
        try:
            await entry.ctx.engine.sleep(level)
        except Exception as exc:  # noqa: BLE001 - asleep already (POST /sleep), or a dead engine: it goes
            logger.warning("model %s could not sleep (%s: %s); unloading it instead", entry.name,
                           type(exc).__name__, exc)
            await self.unload(entry, reason=reason)
            await self.rebalance()
            return
        entry.sleep_level = level
        logger.info("parking model %s (%s): asleep at level %d, its engine-core process kept", entry.name, reason,
                    level)
        for old in sorted(self._parked(), key=lambda e: e.last_used)[:max(0, len(self._parked())
                                                                             - self.max_parked_models)]:
            await self.unload(old, reason=f"the least recently used of more than {self.max_parked_models} "
                                          "parked models (--max-parked-models)")
        await self.rebalance()

    async def rebalance(self) -> None:
        """Each awake engine onto its own slice of the CPUs (threads = CPUs // awake engines), so their
        OpenMP pools stop spinning against each other; the engines apply it between steps."""
        awake = [e for e in self.entries if e.state == "loaded" and e.ctx is not None]
        if not awake:
            return
        for entry, cpus in zip(awake, split_cpus(self.cpus, len(awake))):
            assert entry.ctx is not None
            try:
                entry.cpu_share = await entry.ctx.engine.set_cpu_share(cpus)
            except Exception as exc:  # noqa: BLE001 - a dying engine; the monitor unloads it
                logger.warning("model %s: its CPU share was not set: %s", entry.name, exc)

    async def unload(self, entry: ModelEntry, reason: str) -> None:
        ctx, entry.ctx = entry.ctx, None
        entry.state, entry.sleep_level, entry.cpu_share = "unloaded", 0, None
        if ctx is None:
            return
        logger.info("unloading model %s (%s)", entry.name, reason)
        await asyncio.to_thread(ctx.engine.shutdown)
        if ctx.tokenize_executor is not None:
            ctx.tokenize_executor.shutdown(wait=False)
        self._keep_spare()

    # -- the admin endpoints (POST /v1/models/load, /v1/models/unload) --------------------------------
    async def load(self, model: str) -> ModelEntry:
        entry = self._by_name.get(model)
        if entry is None:
            self.lookup(model)  # the 404
            raise APIError(f"`{model}` is a LoRA adapter, not a model", 400, "model")
        if entry.state == "failed":
            entry.state = "unloaded"  # an explicit load tries again
        await self._wait_loaded(entry, None)
        entry.last_used = time.monotonic()
        return entry

    async def unload_named(self, model: str) -> ModelEntry:
        entry = self._by_name.get(model)
        if entry is None:
            self.lookup(model)
            raise APIError(f"`{model}` is a LoRA adapter, not a model", 400, "model")
        if entry.state == "loading":
            raise APIError(f"The model `{model}` is loading; unload it once it has loaded", 409, "model",
                           code="model_busy")
        if entry.leases:
            raise APIError(f"The model `{model}` is serving {entry.leases} request(s); unload it once they finish",
                           409, "model", code="model_busy")
        await self.unload(entry, reason="POST /v1/models/unload")
        entry.error = None
        await self.rebalance()
        return entry

    # -- the monitor: keep-alive expiry and engine deaths -----------------------------------------
    def start(self) -> None:
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._watch())

    def keep_alive_of(self, entry: ModelEntry) -> float | None:
        if entry.keep_alive_set:
            return entry.keep_alive
        return entry.spec.keep_alive if entry.spec.keep_alive is not None else self.idle_timeout_s

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(MONITOR_INTERVAL)
            if not self._load_lock.locked() and not any(e.leases for e in self.entries):
                self._keep_spare()
            for entry in self._loaded() + self._parked():
                if entry.ctx is None:
                    continue
                try:
                    await entry.ctx.engine.check_health()
                except Exception as exc:  # noqa: BLE001 - a dead core takes down its model only
                    entry.error = f"its engine died: {exc}"
                    logger.error("model %s: %s; it unloads, and the next request loads it again", entry.name, exc)
                    await self.unload(entry, reason="its engine died")
                    await self.rebalance()
                    continue
                keep = self.keep_alive_of(entry)
                # (not while a load or wake runs: it holds the lock, and parking now would race its rebalance)
                if (entry.idle and keep is not None and time.monotonic() - entry.last_used >= keep
                        and not self._load_lock.locked()):
                    async with self._load_lock:
                        if entry.idle:
                            # unwanted for a while: the weights' memory goes back too
                            await self.park(entry, level=2, reason=f"idle for {keep:g} s (keep_alive)")

    async def shutdown(self) -> None:
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
        for entry in self.entries:
            if entry.load_task is not None and not entry.load_task.done():
                entry.load_task.cancel()
            await self.unload(entry, reason="the server stops")

    # -- /v1/models -------------------------------------------------------------------------------
    def cards(self, created: int) -> list[dict[str, Any]]:
        cards: list[dict[str, Any]] = []
        for entry in self.entries:
            extra: dict[str, Any] = {"state": entry.state}
            if entry.error is not None:
                extra["error"] = entry.error
            if entry.sleep_level:
                extra["sleep_level"] = entry.sleep_level
            if entry.cpu_share is not None and entry.state == "loaded":
                extra["cpu_share"] = entry.cpu_share
            if entry.ctx is not None:
                cards.extend({**card, **extra} for card in entry.ctx.models.cards())
                continue
            root = entry.spec.engine_args.model or "SmolLM2-135M-Instruct"
            cards.extend({"id": name, "object": "model", "created": created, "owned_by": "pagoda", "root": root,
                          "parent": None, "max_model_len": entry.spec.engine_args.max_model_len, "permission": [],
                          **extra} for name in entry.spec.served_model_names)
        return cards


class ModelLeaseMiddleware:
    """Holds a request's models until its response has been sent (a stream's last byte included)."""

    def __init__(self, app: ASGIApp, pool: ModelPool) -> None:
        self.app = app
        self.pool = pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        leases: list[ModelEntry] = []
        scope[LEASES_KEY] = leases
        try:
            await self.app(scope, receive, send)
        finally:
            for entry in leases:
                self.pool.release(entry)
