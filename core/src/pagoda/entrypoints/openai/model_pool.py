"""Many models behind one port: the pool that loads, routes and evicts them (pagoda beyond vLLM; issue 36).

Each served model is a ``ModelEntry``: its ``ModelSpec`` (engine arguments, names, LoRA modules, keep-alive),
its state, and while loaded the ``ServingContext`` of its own ``AsyncLLM`` (its own engine-core process).
A request names its model; ``acquire`` answers that model's context, loading it first when it is not
loaded (one load at a time; waiters share it, a bounded wait, a client that goes away leaves the queue).
While a request holds a model (from the route's lookup to the end of its response body, released by
``ModelLeaseMiddleware``) the model is never evicted. Before a load the pool makes room: the least
recently used idle models go until ``max_loaded_models`` and the memory budget (weights + KV cache, as
each engine reports it) allow the new one. A monitor unloads models idle past their keep-alive, and one
whose engine core died (it answers 503 meanwhile; the next request loads it again): one model's death
never stops the server. docs/server.md, "Many models on one port".
"""

from __future__ import annotations

import asyncio
import logging
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

logger = logging.getLogger(__name__)

ModelState = Literal["unloaded", "loading", "loaded", "failed"]

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
    load_seconds: float | None = None
    loads: int = 0

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
                 load_timeout_s: float = 600.0) -> None:
        self.entries = [ModelEntry(spec) for spec in specs]
        self._by_name = {name: self.entries[i] for name, i in served_name_index(specs).items()}
        self._loader = loader
        self.max_loaded_models = max_loaded_models
        self.memory_budget_bytes = memory_budget_bytes
        self.idle_timeout_s = idle_timeout_s
        self.load_timeout_s = load_timeout_s
        # one load at a time: two at once would double the peak memory and split the CPU between them
        self._load_lock = asyncio.Lock()
        self._monitor: asyncio.Task[None] | None = None

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
                entry.state, entry.error = "unloaded", str(exc)
                raise
            started = time.perf_counter()
            logger.info("loading model %s (%s)", entry.name, entry.spec.engine_args.model or "the default model")
            try:
                ctx = await self._loader(entry.spec)
            except Exception as exc:
                entry.state, entry.error = "failed", f"{type(exc).__name__}: {exc}"
                logger.error("model %s failed to load: %s", entry.name, entry.error)
                raise
            entry.load_seconds = time.perf_counter() - started
            entry.memory_bytes = await ctx.engine.get_memory_bytes()
            entry.ctx, entry.state, entry.loads = ctx, "loaded", entry.loads + 1
            entry.last_used = time.monotonic()
            logger.info("model %s loaded in %.1f s (weights + KV cache %.1f MiB)", entry.name, entry.load_seconds,
                        entry.memory_bytes / 2**20)
        await self._fit_budget(keep=entry)

    def _loaded(self) -> list[ModelEntry]:
        return [e for e in self.entries if e.state == "loaded"]

    def _over_limits(self, incoming: ModelEntry | None) -> bool:
        loaded = self._loaded()
        count = len(loaded) + (1 if incoming is not None else 0)
        if self.max_loaded_models is not None and count > self.max_loaded_models:
            return True
        if self.memory_budget_bytes is not None:
            # a model never loaded has no known size yet: it is counted once it has loaded (_fit_budget)
            held = sum(e.memory_bytes or 0 for e in loaded)
            if incoming is not None:
                held += incoming.memory_bytes or 0
            return held > self.memory_budget_bytes and count > 1
        return False

    async def _make_room(self, incoming: ModelEntry) -> None:
        """Evict least recently used idle models until ``incoming`` fits; waits (bounded) for one to idle."""
        deadline = time.monotonic() + self.load_timeout_s
        while self._over_limits(incoming):
            idle = sorted((e for e in self._loaded() if e.idle and e is not incoming), key=lambda e: e.last_used)
            if idle:
                await self.unload(idle[0], reason="least recently used, to make room for " + incoming.name)
                continue
            if time.monotonic() > deadline:
                raise _LoadBusy(f"The model `{incoming.name}` cannot be loaded now: the loaded models "
                                f"{[e.name for e in self._loaded()]} are all serving requests "
                                "(--max-loaded-models / --models-memory-budget)")
            await asyncio.sleep(0.05)

    async def _fit_budget(self, keep: ModelEntry) -> None:
        """After a load (its size known now): evict idle others while the budget is exceeded."""
        while self._over_limits(None):
            idle = sorted((e for e in self._loaded() if e.idle and e is not keep), key=lambda e: e.last_used)
            if not idle:
                logger.warning("the loaded models exceed --models-memory-budget and none is idle")
                return
            await self.unload(idle[0], reason="least recently used, over the memory budget")

    async def unload(self, entry: ModelEntry, reason: str) -> None:
        ctx, entry.ctx = entry.ctx, None
        entry.state = "unloaded"
        if ctx is None:
            return
        logger.info("unloading model %s (%s)", entry.name, reason)
        await asyncio.to_thread(ctx.engine.shutdown)
        if ctx.tokenize_executor is not None:
            ctx.tokenize_executor.shutdown(wait=False)

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
        if entry.state == "unloaded":
            entry.error = None
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
            for entry in self._loaded():
                assert entry.ctx is not None
                try:
                    await entry.ctx.engine.check_health()
                except Exception as exc:  # noqa: BLE001 - a dead core takes down its model only
                    entry.error = f"its engine died: {exc}"
                    logger.error("model %s: %s; it unloads, and the next request loads it again", entry.name, exc)
                    await self.unload(entry, reason="its engine died")
                    continue
                keep = self.keep_alive_of(entry)
                if entry.idle and keep is not None and time.monotonic() - entry.last_used >= keep:
                    await self.unload(entry, reason=f"idle for {keep:g} s (keep_alive)")

    async def shutdown(self) -> None:
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
