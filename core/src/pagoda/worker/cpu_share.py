"""A process's share of the host CPUs: which cores its threads may run on and how many torch threads it uses.

A many-model server (pagoda beyond vLLM; docs/server.md, "Many models on one port") runs one engine-core
process per loaded model. Each sizes its torch/OpenMP pool for the whole machine at start, so two busy
engines run twice as many spinning OpenMP threads as there are cores and both crawl. The pool hands each
awake engine a disjoint slice of the CPUs instead; this module applies one slice to the calling process.
"""

from __future__ import annotations

import os

from pydantic import BaseModel

# OpenMP's own placement: where the user set one, the runtime binds its threads and the pool must not move them.
_BINDING_ENV = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


class CpuShare(BaseModel):
    """What one rank runs on after a ``set_cpu_share`` (what the engine core reports back)."""

    threads: int
    cpus: list[int]
    # why the share asked for was not applied in full (an explicit user setting wins); None: applied
    kept: str | None = None


def split_cpus(cpus: list[int], parts: int) -> list[list[int]]:
    """``cpus`` cut into ``parts`` contiguous, disjoint slices of ``max(1, len // parts)`` CPUs; with more
    parts than CPUs the slices wrap round (one CPU each, shared)."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    if not cpus:
        raise ValueError("no CPUs to split")
    size = max(1, len(cpus) // parts)
    return [[cpus[(i * size + j) % len(cpus)] for j in range(size)] for i in range(parts)]


def user_binding() -> str | None:
    """The OpenMP binding variable the user set, if any (then affinity is theirs to decide)."""
    for name in _BINDING_ENV:
        value = os.environ.get(name)
        if value and value.strip().lower() not in ("false", "0"):
            return f"{name}={value}"
    return None


def pin_process(cpus: list[int]) -> None:
    """Every thread of this process (OpenMP's pool included) onto ``cpus``.

    ``sched_setaffinity(0)`` moves only the calling thread; threads started before it keep their mask, so
    each of /proc/self/task goes. Threads started later inherit their creator's mask."""
    wanted = set(cpus)
    os.sched_setaffinity(0, wanted)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, wanted)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            continue


def apply_cpu_share(cpus: list[int], threads_override: int | None = None, override_name: str = "") -> CpuShare:
    """Run this process on ``cpus`` with one torch thread per CPU.

    ``threads_override``: the user's explicit thread count (a platform variable named ``override_name``)
    wins over the share: threads and affinity are left as they are."""
    import torch

    if threads_override is not None:
        return CpuShare(threads=torch.get_num_threads(), cpus=sorted(os.sched_getaffinity(0)),
                        kept=f"{override_name}={threads_override}")
    if not cpus:
        raise ValueError("a CPU share needs at least one CPU")
    binding = user_binding()
    if binding is None:
        pin_process(cpus)
    if torch.get_num_threads() != len(cpus):
        torch.set_num_threads(len(cpus))
    return CpuShare(threads=torch.get_num_threads(), cpus=sorted(os.sched_getaffinity(0)), kept=binding)
