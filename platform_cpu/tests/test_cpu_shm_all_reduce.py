"""The shared-memory all-reduce / all-gather of the CPU platform.

The protocol on threads standing in for ranks (this CPU's build and the AVX2 one, no AVX-512), then
CpuCommunicator in 2 and 3 spawned processes over gloo on 127.0.0.1 against gloo's own results, a
rank killed while another waits for it, and no segment left in /dev/shm.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from pagoda_platform_cpu import shm_all_reduce as shm
from pagoda_platform_cpu.shm_all_reduce import NAME_PREFIX, SHM_DIR, ShmCollectiveError, ShmSegment

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _inputs(rank: int, numel: int, dtype: torch.dtype, call: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * call + 10 * rank + numel)
    return (torch.randn(numel, generator=g) * 4).to(dtype)


def _rank_order_sum(world: int, numel: int, dtype: torch.dtype, call: int) -> torch.Tensor:
    """The sum the segment must give, bit for bit: fp32, rank 0 first, rounded once to the dtype."""
    acc = _inputs(0, numel, dtype, call).float()
    for r in range(1, world):
        acc = acc + _inputs(r, numel, dtype, call).float()
    return acc.to(dtype)


class _CtypesLibrary:
    """A plain-C build of the library (another -m flag) with the module's call signatures."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, u64, ptr = ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
        sigs: dict[str, tuple[Any, list[Any]]] = {
            "pagoda_shm_isa": (ctypes.c_char_p, []),
            "pagoda_shm_segment_bytes": (i64, [i64, i64]),
            "pagoda_shm_map": (i64, [i64, i64]),
            "pagoda_shm_unmap": (i64, [ptr, i64]),
            "pagoda_shm_init": (None, [ptr, i64, i64, u64, i64]),
            "pagoda_shm_attach": (i64, [ptr, i64, i64, i64, u64, i64]),
            "pagoda_shm_sequence": (i64, [ptr, i64]),
            "pagoda_shm_all_reduce": (i64, [ptr, i64, ptr, i64, i64, i64]),
            "pagoda_shm_all_gather": (i64, [ptr, i64, ptr, ptr, i64]),
        }
        for name, (restype, argtypes) in sigs.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, name, fn)


def _host_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _segments(world: int, slot_bytes: int, library: Any, initial_seq: int = 0,
              pids: list[int] | None = None) -> list[ShmSegment]:
    """One segment (a memfd), mapped once per simulated rank as separate processes would."""
    nbytes = int(library.pagoda_shm_segment_bytes(world, slot_bytes))
    fd = os.memfd_create("pagoda-shm-test")
    try:
        os.ftruncate(fd, nbytes)
        bases = [int(library.pagoda_shm_map(fd, nbytes)) for _ in range(world)]
    finally:
        os.close(fd)
    library.pagoda_shm_init(bases[0], world, slot_bytes, 12345, initial_seq)
    segments = []
    for r, base in enumerate(bases):
        assert library.pagoda_shm_attach(base, r, world, slot_bytes, 999, os.getpid()) != 0  # wrong token
        assert library.pagoda_shm_attach(base, r, world, slot_bytes, 12345, (pids or [os.getpid()] * world)[r]) == 0
        segments.append(ShmSegment(library, base, nbytes, r, world, slot_bytes, "memfd"))
    return segments


def _run_as_threads(segments: list[ShmSegment], work: Any) -> list[Any]:
    results: list[Any] = [None] * len(segments)
    errors: list[BaseException] = []

    def rank_main(r: int) -> None:
        try:
            results[r] = work(segments[r])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(segments))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a simulated rank hung"
    if errors:
        raise errors[0]
    return results


def _check_protocol(library: Any, world: int) -> None:
    slot = 256  # 64 fp32 / 128 16-bit elements a round: most calls take several rounds
    # counters start 40 rounds before 2**32: the calls below take them across the wrap
    segments = _segments(world, slot, library, initial_seq=2**32 - 40)
    cases = [(dtype, n) for dtype in DTYPES for n in (1, 63, 64, 65, 129, 1000)]

    def work(seg: ShmSegment) -> list[torch.Tensor]:
        outs = []
        for call, (dtype, n) in enumerate(cases):
            outs.append(seg.all_reduce(_inputs(seg.rank, n, dtype, call)))
            outs.append(seg.all_gather(_inputs(seg.rank, n, dtype, call).view(1, n)))
        return outs

    results = _run_as_threads(segments, work)
    for call, (dtype, n) in enumerate(cases):
        expected = _rank_order_sum(world, n, dtype, call)
        gathered = torch.stack([_inputs(r, n, dtype, call) for r in range(world)])
        for r in range(world):
            assert torch.equal(results[r][2 * call], expected), (dtype, n, r)
            assert torch.equal(results[r][2 * call + 1], gathered), (dtype, n, r)
    assert all(seg.sequence() == segments[0].sequence() for seg in segments)
    assert segments[0].sequence() < 2**31, "the counters did not wrap"
    for seg in segments:
        seg.close()


@pytest.mark.parametrize("world", [2, 3])
def test_protocol_on_threads(world: int) -> None:
    library = shm.EXTENSION.library()
    _check_protocol(library, world)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("c++") is None,
                    reason="needs an x86-64 C++ compiler")
def test_protocol_avx2_build(tmp_path: Path) -> None:
    library = _CtypesLibrary(shm.EXTENSION.compile_to(tmp_path / "libshm_avx2.so", ["-mno-avx512f"]))
    assert library.pagoda_shm_isa().decode() == ("avx2" if "avx2" in _host_flags() else "portable")
    _check_protocol(library, 3)


def test_ranks_running_different_calls_fail_instead_of_mixing() -> None:
    segments = _segments(2, 256, shm.EXTENSION.library())
    with pytest.raises(ShmCollectiveError, match="ran another collective"):
        _run_as_threads(segments, lambda seg: seg.all_reduce(torch.ones(10 + seg.rank)))
    # the segment is unusable afterwards, on every rank
    with pytest.raises(ShmCollectiveError, match="ran another collective"):
        segments[0].all_reduce(torch.ones(4))


def test_a_dead_peer_is_an_error_not_a_hang() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    segments = _segments(2, 256, shm.EXTENSION.library(), pids=[os.getpid(), gone.pid])
    started = time.monotonic()
    with pytest.raises(ShmCollectiveError, match="group rank 1's process exited"):
        segments[0].all_reduce(torch.ones(8))
    assert time.monotonic() - started < 10


# -- CpuCommunicator in spawned processes --------------------------------------------------------------


def _init(rank: int, world: int, port: int) -> Any:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return dist


def _mapped(name: str) -> bool:
    return name in Path("/proc/self/maps").read_text()


def _battery(rank: int, world: int, port: int) -> None:
    from pagoda.distributed.communicator import DeviceCommunicatorBase
    from pagoda_platform_cpu.communicator import CpuCommunicator

    dist = _init(rank, world, port)
    ranks = list(range(world))
    group = dist.new_group(ranks)
    cpu = torch.device("cpu")
    gloo = DeviceCommunicatorBase(group, ranks, cpu)
    slot = 4096
    comm = CpuCommunicator(group, ranks, cpu, slot_bytes=slot, initial_seq=2**32 - 100)
    assert comm.shm is not None, comm.transport
    name = comm.shm.name
    assert _mapped(name) and not (SHM_DIR / name).exists(), "the name must be gone once every rank mapped it"

    def same_on_every_rank(t: torch.Tensor) -> None:
        everyone = gloo.all_gather(t.reshape(1, -1).view(torch.uint8), 0)
        assert all(torch.equal(everyone[0], everyone[r]) for r in range(world)), "ranks disagree bitwise"

    def check_against_gloo(ours: torch.Tensor, theirs: torch.Tensor) -> None:
        if world == 2:  # a + b is b + a: gloo's sum is the same bits
            assert torch.equal(ours, theirs)
        else:
            # gloo's 3-way sum goes in its own order and rounds 16-bit partial sums: a few units in the last
            # place of the inputs' magnitude (|x| < ~20) apart, relative error unbounded where the sum cancels
            eps = torch.finfo(ours.dtype).eps
            torch.testing.assert_close(ours, theirs, atol=64 * eps, rtol=2 * eps)

    call = 0
    for dtype in DTYPES:
        size = torch.tensor([], dtype=dtype).element_size()
        for n in (1, 7, 576, 8 * 576, slot // size + 1, 3 * slot // size + 5):
            x = _inputs(rank, n, dtype, call)
            ours = comm.all_reduce(x.clone())
            theirs = gloo.all_reduce(x.clone())
            same_on_every_rank(ours)
            assert torch.equal(ours, _rank_order_sum(world, n, dtype, call)), (dtype, n)
            check_against_gloo(ours, theirs)
            # a strided view: summed through a contiguous copy, written back in place
            z = _inputs(rank, 2 * n, dtype, call).view(n, 2)
            column = z.clone()
            comm.all_reduce(column[:, 0])
            assert torch.equal(column[:, 1], z[:, 1])
            check_against_gloo(column[:, 0], gloo.all_reduce(z[:, 0].contiguous()))
            for shape, dim in (((3, n), 0), ((3, n), 1), ((2, n, 3), -1)):
                g = torch.randn(shape, generator=torch.Generator().manual_seed(rank + call)).to(dtype)
                assert torch.equal(comm.all_gather(g, dim), gloo.all_gather(g, dim)), (shape, dim)
            call += 1
    # other dtypes stay on gloo
    ints = torch.arange(5) * (rank + 1)
    assert torch.equal(comm.all_reduce(ints.clone()), gloo.all_reduce(ints.clone()))
    # many small calls back to back, across the 32-bit wrap of the round counters
    x = torch.full((64,), float(rank + 1))
    for _ in range(300):
        comm.all_reduce(x)
        x /= world * (world + 1) / 2  # back to 1.0 everywhere; exact in binary
        x *= rank + 1
    assert torch.equal(x, torch.full((64,), float(rank + 1)))
    assert comm.shm.sequence() < 2**31, "the counters did not wrap"
    comm.destroy()
    assert not _mapped(name), "destroy() must unmap the segment"

    # the switch and the host check, decided together: any rank saying no keeps the whole group on gloo
    os.environ["PAGODA_CPU_SHM_ALLREDUCE"] = "0" if rank == world - 1 else "1"
    off = CpuCommunicator(group, ranks, cpu)
    assert off.shm is None and f"PAGODA_CPU_SHM_ALLREDUCE=0 on group rank {world - 1}" in off.transport
    assert torch.equal(off.all_reduce(torch.ones(3)), torch.full((3,), float(world)))
    os.environ["PAGODA_CPU_SHM_ALLREDUCE"] = "1"
    if rank == 1:
        shm.host_identity = lambda: ("elsewhere", "another-boot", 1)  # type: ignore[assignment]
    apart = CpuCommunicator(group, ranks, cpu)
    assert apart.shm is None and "not on one host" in apart.transport
    dist.destroy_process_group()


def _leftovers() -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(NAME_PREFIX + "*"))


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")
@pytest.mark.parametrize("world", [2, 3])
def test_communicator_matches_gloo(world: int) -> None:
    from pagoda.distributed import get_open_port

    before = _leftovers()
    mp.spawn(_battery, args=(world, get_open_port()), nprocs=world)
    assert _leftovers() == before


def _wait_then_be_killed(rank: int, world: int, port: int, queue: Any) -> None:
    from pagoda_platform_cpu.communicator import CpuCommunicator

    dist = _init(rank, world, port)
    comm = CpuCommunicator(dist.group.WORLD, list(range(world)), torch.device("cpu"))
    assert comm.shm is not None, comm.transport
    comm.all_reduce(torch.ones(16))
    queue.put(("ready", rank, os.getpid()))
    if rank == 1:
        time.sleep(600)  # killed by the test
    try:
        comm.all_reduce(torch.ones(16))  # rank 1 never arrives: it is killed meanwhile
        queue.put(("no error", rank, ""))
    except ShmCollectiveError as exc:
        queue.put(("error", rank, str(exc)))


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")
def test_rank_killed_mid_call() -> None:
    from pagoda.distributed import get_open_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = get_open_port()
    before = _leftovers()
    procs = [ctx.Process(target=_wait_then_be_killed, args=(r, 2, port, queue), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        ready = [queue.get(timeout=180) for _ in range(2)]
        assert sorted(kind for kind, _, _ in ready) == ["ready", "ready"], ready
        time.sleep(0.5)  # rank 0 is inside all_reduce by now, waiting for rank 1
        assert procs[1].pid is not None
        os.kill(procs[1].pid, signal.SIGKILL)
        kind, rank, message = queue.get(timeout=60)
        assert (kind, rank) == ("error", 0), message
        assert "group rank 1's process exited" in message
    finally:
        for p in procs:
            p.kill()
            p.join(30)
    assert _leftovers() == before


# -- end to end: a TP=2 engine ------------------------------------------------------------------------


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")
def test_tp2_engine_greedy_equals_transformers_over_shared_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mp executor's two workers map a segment (and with the switch off they do not); greedy tokens equal transformers'."""
    import transformers

    from pagoda import LLM, SamplingParams
    from pagoda.testing.model_parity import _hf_greedy, build_tiny_model, mixed_prompts, save_tiny_model

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=131,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    hf_model = build_tiny_model(cfg, seed=7)
    model = save_tiny_model(hf_model, tmp_path / "m")
    prompts = mixed_prompts(131, num_prompts=8, max_len=40)
    expected = [_hf_greedy(hf_model, p, 6) for p in prompts]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for setting in ("1", "0"):
        monkeypatch.setenv("PAGODA_CPU_SHM_ALLREDUCE", setting)  # the spawned workers inherit it
        llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=256, num_kv_blocks=64,
                  tensor_parallel_size=2, distributed_executor_backend="mp")
        try:
            pids = [p.pid for p in llm.llm_engine.engine_core.core.model_executor.workers]
            mapped = [NAME_PREFIX in Path(f"/proc/{pid}/maps").read_text() for pid in pids]
            assert mapped == [setting == "1"] * 2, (setting, mapped)
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outputs] == expected, setting
        finally:
            llm.llm_engine.engine_core.shutdown()
    assert not list(SHM_DIR.glob(f"{NAME_PREFIX}{pids[0]}-*"))


def test_stale_segments_of_dead_creators_are_removed(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / f"{NAME_PREFIX}{gone.pid}-abc"
    live = tmp_path / f"{NAME_PREFIX}{os.getpid()}-def"
    other = tmp_path / "unrelated-file"
    for path in (stale, live, other):
        path.write_bytes(b"x")
    assert shm.remove_stale_segments(tmp_path) == [stale.name]
    assert not stale.exists() and live.exists() and other.exists()
