"""All-reduce and all-gather among the CPU ranks of one host through a shared-memory segment.

Over gloo every collective is a loopback TCP exchange (about a millisecond each on a loaded 2-core
machine, docs/benchmarks.md); ranks on one host can instead copy their tensors into one shared
segment and read each other's. The protocol and its memory ordering are in ``csrc/shm_all_reduce.cpp``;
this module sets the segment up, collectively, over the group's gloo connection:

1. every rank tells the others whether it may use shared memory (``PAGODA_CPU_SHM_ALLREDUCE``, the C++
   library built) and where it runs (host name, boot id, pid namespace): any "no" or any difference
   and the group stays on gloo;
2. group rank 0 creates ``/dev/shm/pagoda-cpu-ar-<pid>-<random>`` and broadcasts its name and a random
   token; the others map it and check the token (a rank in another container sees another /dev/shm);
3. once every rank has answered, rank 0 unlinks the name. The mappings stay valid until each process
   unmaps (``close``) or exits, so nothing is left in /dev/shm whatever happens to the ranks later
   (a rank killed mid-call included). Only a rank 0 killed inside step 2 leaves its file behind; the
   next group that rank 0 of any pagoda process creates on this host removes such files whose
   creator's pid is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from pagoda import envs
from pagoda.cpp_extension import CppExtension, ExtensionBuildError

logger = logging.getLogger(__name__)

EXTENSION_NAME = "pagoda_cpu_shm_all_reduce"
SOURCE = "csrc/shm_all_reduce.cpp"
EXTENSION = CppExtension(EXTENSION_NAME, "pagoda_platform_cpu", [SOURCE])

SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "pagoda-cpu-ar-"
# Per rank and buffer (two buffers): a decode step's activations fit in one round; larger tensors
# (prefill) go through in slot-sized rounds, each one barrier (a few microseconds) apart.
DEFAULT_SLOT_BYTES = 1 << 20
# The dtypes the C++ sum handles (fp32 accumulation); others stay on gloo.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_PEER_DIED = -1000
_PEER_DISAGREES = -2000


class ShmCollectiveError(RuntimeError):
    """A shared-memory collective failed (a rank's process is gone, or the ranks ran different calls)."""


def host_identity() -> tuple[str, str, int]:
    """What ranks compare to know they share a host and its /proc: host name, boot id, pid namespace."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    try:
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pid_ns = 0
    return socket.gethostname(), boot_id, pid_ns


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def remove_stale_segments(directory: Path = SHM_DIR) -> list[str]:
    """Unlink segments whose creator died before it could unlink them; the names removed."""
    removed = []
    with contextlib.suppress(OSError):
        for path in directory.glob(NAME_PREFIX + "*"):
            pid_text = path.name[len(NAME_PREFIX):].split("-", 1)[0]
            if pid_text.isdigit() and not _pid_alive(int(pid_text)):
                with contextlib.suppress(OSError):
                    path.unlink()
                    removed.append(path.name)
    return removed


@dataclass
class ShmSegment:
    """This process's mapping of its group's segment, and the collectives over it."""

    library: ModuleType
    base: int
    nbytes: int
    rank: int
    world_size: int
    slot_bytes: int
    name: str
    _error: str | None = None

    @classmethod
    def map_file(cls, library: ModuleType, path: Path, nbytes: int, create: bool) -> int:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            elif os.fstat(fd).st_size != nbytes:
                raise OSError(f"{path} has {os.fstat(fd).st_size} bytes, {nbytes} expected")
            base = library.pagoda_shm_map(fd, nbytes)
        finally:
            os.close(fd)  # the mapping keeps the memory
        if not base:
            raise OSError(f"mmap of {path} ({nbytes} bytes) failed")
        return int(base)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks into ``x`` (float32 / bfloat16 / float16, on CPU), in place; returns ``x``."""
        code = DTYPE_CODES.get(x.dtype)
        if code is None or x.device.type != "cpu":
            raise ValueError(f"shared-memory all_reduce takes CPU float32/bfloat16/float16 tensors, not {x.dtype} on {x.device}")
        self._check_usable()
        work = x if x.is_contiguous() else x.contiguous()
        self._check(self.library.pagoda_shm_all_reduce(self.base, self.rank, work.data_ptr(), work.numel(), code,
                                                       torch.get_num_threads()))
        if work is not x:
            x.copy_(work)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (same shape and dtype everywhere) stacked along dim 0: [world * d0, ...]."""
        if x.device.type != "cpu":
            raise ValueError(f"shared-memory all_gather takes CPU tensors, not {x.device}")
        x = x.contiguous()
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype)
        nbytes = x.numel() * x.element_size()
        self._check_usable()
        self._check(self.library.pagoda_shm_all_gather(self.base, self.rank, x.data_ptr(), out.data_ptr(), nbytes))
        return out

    def sequence(self, rank: int | None = None) -> int:
        """The last round number rank ``rank`` (default: this one) published (32 bits, wraps)."""
        self._check_usable()
        return int(self.library.pagoda_shm_sequence(self.base, self.rank if rank is None else rank))

    def close(self) -> None:
        """Unmap; the memory goes when the last rank has unmapped it (the name is gone since set-up)."""
        if self.base:
            self.library.pagoda_shm_unmap(self.base, self.nbytes)
            self.base = 0
            self._error = self._error or "the shared-memory segment was closed"

    def _check_usable(self) -> None:
        if self._error is not None:
            raise ShmCollectiveError(self._error)

    def _check(self, rc: int) -> None:
        if rc == 0:
            return
        if _PEER_DISAGREES - self.world_size < rc <= _PEER_DISAGREES:
            why = f"group rank {_PEER_DISAGREES - rc} ran another collective (size or dtype) in the same round"
        elif _PEER_DIED - self.world_size < rc <= _PEER_DIED:
            why = f"group rank {_PEER_DIED - rc}'s process exited while group rank {self.rank} waited for it"
        else:
            why = f"bad shared-memory segment (code {rc})"
        # the peers' rounds no longer line up: every later call on this segment fails the same way
        self._error = f"shared-memory collective failed: {why}"
        raise ShmCollectiveError(self._error)


def _library_or_reason() -> tuple[ModuleType | None, str | None]:
    try:
        return EXTENSION.library(), None
    except ExtensionBuildError as exc:
        return None, str(exc)


def open_shm_segment(group: dist.ProcessGroup, ranks: list[int], rank_in_group: int,
                     slot_bytes: int = DEFAULT_SLOT_BYTES, initial_seq: int = 0) -> tuple[ShmSegment | None, str]:
    """Set up the group's segment; every rank of ``group`` calls it together (over gloo).

    Returns the segment, or None and why the group stays on gloo (the same answer on every rank).
    ``initial_seq`` is the round counters' start (tests start near 2**32 to see them wrap).
    """
    if slot_bytes <= 0 or slot_bytes % 64:
        raise ValueError(f"slot_bytes must be a positive multiple of 64, got {slot_bytes}")
    world = len(ranks)
    enabled = envs.PAGODA_CPU_SHM_ALLREDUCE
    library, build_failure = _library_or_reason() if enabled else (None, None)
    facts: list[Any] = [None] * world
    dist.all_gather_object(facts, (enabled, build_failure, host_identity()), group=group)
    for r, (on, failure, _) in enumerate(facts):
        if not on:
            return None, f"PAGODA_CPU_SHM_ALLREDUCE=0 on group rank {r}"
        if failure is not None:
            return None, f"group rank {r} has no shared-memory kernel: {failure}"
    if len({identity for _, _, identity in facts}) != 1:
        return None, "the ranks are not on one host (host name, boot id or pid namespace differ)"
    assert library is not None
    nbytes = int(library.pagoda_shm_segment_bytes(world, slot_bytes))
    announce: list[Any] = [None, 0, ""]
    segment: ShmSegment | None = None
    path: Path | None = None
    try:
        if rank_in_group == 0:
            remove_stale_segments()
            name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
            token = secrets.randbits(63)
            try:
                path = SHM_DIR / name
                base = ShmSegment.map_file(library, path, nbytes, create=True)
                library.pagoda_shm_init(base, world, slot_bytes, token, initial_seq % 2**32)
                segment = ShmSegment(library, base, nbytes, 0, world, slot_bytes, name)
                announce = [name, token, ""]
            except OSError as exc:
                if path is not None and path.exists():
                    path.unlink()
                path = None
                announce = [None, 0, f"group rank 0 could not create a segment in {SHM_DIR}: {exc}"]
        dist.broadcast_object_list(announce, src=ranks[0], group=group)
        name, token, reason = announce
        if name is None:
            return None, reason
        if rank_in_group != 0:
            try:
                base = ShmSegment.map_file(library, SHM_DIR / name, nbytes, create=False)
                segment = ShmSegment(library, base, nbytes, rank_in_group, world, slot_bytes, name)
            except OSError as exc:
                reason = f"group rank {rank_in_group} could not map {SHM_DIR / name}: {exc}"
        if segment is not None and library.pagoda_shm_attach(segment.base, rank_in_group, world, slot_bytes, token,
                                                             os.getpid()) != 0:
            reason = f"group rank {rank_in_group} mapped another segment under {name} (another /dev/shm?)"
        answers: list[Any] = [None] * world
        dist.all_gather_object(answers, reason, group=group)
    finally:
        if path is not None:
            # every rank has mapped it (or failed to): the name is no longer needed
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    # no rank returns before the name is gone: a caller (or a test) sees no file left in /dev/shm
    dist.barrier(group=group)
    failures = [a for a in answers if a]
    if failures:
        if segment is not None:
            segment.close()
        return None, failures[0]
    assert segment is not None
    return segment, f"shared memory ({world} ranks, {slot_bytes} B slots)"
