"""`pagoda serve`'s start-up order (issues 31 and 39): listen first, then spawn the engine core ahead of the
config so its imports overlap the API process's, then resolve, load and serve.

- a busy address fails the second server in well under a second of work, before any engine process exists;
- the standby engine core is spawned before the API process's heavy imports end, and it is the process that
  serves (not a second spawn);
- a standby nobody takes (the core runs in a thread) is stopped, and one whose parent dies exits by itself;
- the CPU step budget is measured in the engine core, not in the API process before the core can start.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from pagoda.engine import core_process
from pagoda.entrypoints.openai.listen import bind_socket


def test_a_second_bind_socket_on_one_port_fails_at_once() -> None:
    # both sockets set SO_REUSEADDR; only listening makes the second one fail on Linux
    first = bind_socket("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(OSError):
            bind_socket("127.0.0.1", port).close()
        # it listens already: a client connects (and waits in the backlog until the server accepts)
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    finally:
        first.close()


def test_a_second_server_on_a_busy_port_exits_before_spawning_or_loading_anything() -> None:
    holder = bind_socket("127.0.0.1", 0)  # the first server, as far as the second can tell
    port = holder.getsockname()[1]
    try:
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli.main", "serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - started
    finally:
        holder.close()
    assert proc.returncode == 1, proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr
    # nothing heavy ran: no engine core spawned, no platform resolved, no model loaded
    for never in ("engine core", "platform cpu selected", "loaded", "torch threads"):
        assert never not in proc.stderr, (never, proc.stderr)
    assert elapsed < 60, elapsed  # the CLI's own imports only (seconds on a loaded 2-vCPU machine)


def _lines(log: str) -> list[str]:
    return log.splitlines()


def test_the_standby_core_starts_before_the_api_imports_end_and_is_the_one_that_serves(start_server: Any) -> None:
    server = start_server(["--max-model-len", "256"])
    log = _lines(server.output())
    spawned = next(i for i, line in enumerate(log) if "spawned as process" in line and "ahead of the config" in line)
    platform = next(i for i, line in enumerate(log) if "pagoda.platforms: platform" in line and "selected" in line)
    config = next(i for i, line in enumerate(log) if "engine config (platform" in line)
    assert spawned < platform < config, "\n".join(log)
    standby_pid = int(re.search(r"spawned as process (\d+)", log[spawned]).group(1))  # type: ignore[union-attr]
    serving = next(line for line in log if "engine core 0 runs in process" in line)
    assert int(serving.rsplit(" ", 1)[1]) == standby_pid
    # the core's imports were done before (or while) its config came, not after it
    assert any("[engine core 0] pagoda.engine.core_proc: engine core imports took" in line for line in log)
    # exactly one engine-core process was spawned
    assert sum("spawned as process" in line for line in log) == 1
    # the step budget is decided (and logged) in the engine core, the process that runs the matmul; the API
    # process's start-up block says it left it there, and the API process never measures the matmul
    assert any("[engine core 0] pagoda.engine.config_resolution: scheduler_config.max_num_batched_tokens = " in line
               and "decided in the engine core" in line for line in log), "\n".join(log)
    assert any("scheduler_config.max_num_batched_tokens = None (platform default: decided in the engine core" in line
               for line in log)
    assert not any("pagoda_platform_cpu.gemm_tuning: " in line and "[engine core" not in line for line in log)


def test_a_standby_core_nobody_takes_is_stopped(tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda.config import EngineArgs
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.engine.core_client import ThreadedClient

    path, _ = tiny_model_dir("llama")
    monkeypatch.setenv("PAGODA_ENABLE_V1_MULTIPROCESSING", "0")
    standby = core_process.start_standby_core()
    try:
        engine = AsyncLLM.from_engine_args(EngineArgs(model=str(path), skip_tokenizer_init=True, max_model_len=128),
                                           engine_core_process=True)
        try:
            assert isinstance(engine.engine_core, ThreadedClient)
            standby.proc.join(10)
            assert not standby.proc.is_alive()
            assert not os.path.exists(standby.sockdir)
            assert core_process.take_standby_core(0) is None
        finally:
            engine.shutdown()
    finally:
        core_process.discard_standby_core()
        standby.close()


def test_an_mp_client_takes_the_standby_core_and_serves_from_it(tiny_model_dir: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from pagoda.config import EngineArgs
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.engine.mp_client import MPClient
    from pagoda.sampling_params import RequestOutputKind, SamplingParams

    path, _ = tiny_model_dir("llama")
    monkeypatch.delenv("PAGODA_ENABLE_V1_MULTIPROCESSING", raising=False)
    standby = core_process.start_standby_core()
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(path), skip_tokenizer_init=True, max_model_len=128),
                                       engine_core_process=True)
    try:
        assert isinstance(engine.engine_core, MPClient)
        assert engine.engine_core.proc.pid == standby.proc.pid
        assert core_process.take_standby_core(0) is None  # taken once

        async def run() -> list[int]:
            params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False,
                                    output_kind=RequestOutputKind.FINAL_ONLY)
            outs = [o async for o in engine.generate([1, 2, 3], params, "r0")]
            return list(outs[-1].outputs[0].token_ids)

        assert len(asyncio.run(asyncio.wait_for(run(), 60))) == 4
    finally:
        engine.shutdown()
    assert not standby.proc.is_alive()


_ORPHAN = """
import sys, time
from pagoda.engine.core_process import start_standby_core
core = start_standby_core()
print(core.proc.pid, flush=True)
time.sleep(600)
"""


def test_a_standby_core_exits_when_its_parent_dies() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 60  # it may still be importing torch when the parent goes
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            if _zombie(pid):
                return
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the standby core outlived its parent by a minute")
    finally:
        if parent.poll() is None:
            parent.kill()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")
    except OSError:
        return True


_SPAWN_PROBE = """
import sys
from pagoda.engine import core_process

def probe(config_imports=True):
    print("torch imported at the standby spawn:", "torch" in sys.modules, flush=True)
    print("transformers' config classes imported ahead:", config_imports, flush=True)
    raise SystemExit(0)

core_process.start_standby_core = probe
from pagoda.entrypoints.cli.main import main
sys.argv = ["pagoda", "serve", "--port", "0", "--lora-modules", "a=/nowhere", "--enable-lora"]
main()
"""


def test_nothing_imports_torch_before_the_standby_core_is_spawned() -> None:
    # torch's import is 2-3 s of a 2-vCPU machine's start; the standby core imports it in its own process,
    # so the API process must spawn it before paying for torch itself (the --lora-modules check once did)
    proc = subprocess.run([sys.executable, "-c", _SPAWN_PROBE], capture_output=True, text=True, timeout=120)
    assert "torch imported at the standby spawn: False" in proc.stdout, (proc.stdout, proc.stderr)
    # the default model is a GGUF file: its core needs none of transformers (next test)
    # (unless the convert cache lacks its config: the core looks, next tests)
    assert "transformers' config classes imported ahead: UnlessCachedGGUF(model=None)" in proc.stdout, (
        proc.stdout, proc.stderr)


def test_which_models_a_standby_core_imports_transformers_for() -> None:
    unless = core_process.UnlessCachedGGUF
    assert core_process.standby_config_imports(None) == unless(None)
    assert core_process.standby_config_imports("/models/SmolLM2.Q4_K_M.GGUF") == unless("/models/SmolLM2.Q4_K_M.GGUF")
    assert core_process.standby_config_imports("/models/llama-dir") is True
    assert core_process.standby_config_imports("org/name") is True
    assert core_process.standby_config_imports(None, model_impl="transformers") is True


def test_a_gguf_models_config_is_plain_values_once_the_convert_cache_holds_it(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the standby core looks at: on a machine's first start the GGUF file is read through transformers
    (its core needs their config classes), from the second on its cached config is plain values."""
    from pagoda.config import EngineArgs
    from pagoda.engine.config_resolution import prepare_engine_config
    from pagoda.model_loader.hf_config import CachedHFConfig, gguf_config_is_plain_values

    monkeypatch.setenv("PAGODA_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("PAGODA_DISABLE_CACHE", raising=False)
    assert not gguf_config_is_plain_values(None)
    config = EngineArgs(max_model_len=256, num_kv_blocks=64).create_engine_config()
    prepare_engine_config(config)
    assert not isinstance(config.resolved.hf_config, CachedHFConfig)  # the first read: transformers'
    assert gguf_config_is_plain_values(None)
    config = EngineArgs(max_model_len=256, num_kv_blocks=64).create_engine_config()
    prepare_engine_config(config)
    assert isinstance(config.resolved.hf_config, CachedHFConfig)
    assert not gguf_config_is_plain_values(str(tmp_path / "missing.gguf"))


_CORE_OF_THE_DEFAULT_MODEL = """
import sys
import torch
import pagoda.engine.core
from pagoda.engine.core_proc import loads
from pagoda.platforms import set_current_platform
kind, (config, platform) = loads(open(sys.argv[1], "rb").read())
set_current_platform(platform)
from pagoda.engine.core import EngineCore
core = EngineCore(config, platform)
print("transformers imported:", sorted(m for m in sys.modules if m.split(".")[0] == "transformers")[:5], flush=True)
"""


def test_the_default_models_engine_core_never_imports_transformers(tmp_path: Any) -> None:
    """Its config is plain values (the GGUF file's cached one), its weights pagoda's own reader's: transformers'
    config modules (3-4 s of imports on a 2-vCPU Zen 3) stay out of its engine core's start-up."""
    from pagoda.config import EngineArgs
    from pagoda.engine.config_resolution import prepare_engine_config
    from pagoda.engine.core_proc import dumps

    for _ in range(2):  # the first read of a GGUF file fills pagoda's convert cache; the second reads it
        config = EngineArgs(max_model_len=256, num_kv_blocks=64).create_engine_config()
        platform = prepare_engine_config(config)
    frame = tmp_path / "config.bin"
    frame.write_bytes(dumps("config", (config, platform)))
    proc = subprocess.run([sys.executable, "-c", _CORE_OF_THE_DEFAULT_MODEL, str(frame)], capture_output=True,
                          text=True, timeout=300)
    assert "transformers imported: []" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
