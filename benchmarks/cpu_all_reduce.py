"""One collective's cost on CPU: the shared-memory all-reduce / all-gather vs gloo's, in the same processes.

    python -m benchmarks.cpu_all_reduce --ranks 2 --rounds 5
    python -m benchmarks.cpu_all_reduce --ranks 3 --dtype bfloat16 --sizes 576,4608,73728

``--ranks`` processes (one torch thread each) join a gloo group on 127.0.0.1 and hold both a
``CpuCommunicator`` (shared memory) and core's gloo ``DeviceCommunicatorBase`` on the same group. Each
round times ``--calls`` back-to-back all-reduces of every size on one, then the other, so a round's
ratio compares like with like on a machine whose speed drifts. Every rank calls at once, so the time is
the transport's (a step's collectives also wait for the slowest rank's compute, which this leaves out).
Rank 0 prints the median over rounds of each size's microseconds per call, and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch


def _rank(rank: int, a: argparse.Namespace, port: int) -> None:
    import torch.distributed as dist

    from pagoda.distributed.communicator import DeviceCommunicatorBase
    from pagoda_platform_cpu.communicator import CpuCommunicator

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=a.ranks)
    ranks = list(range(a.ranks))
    group = dist.new_group(ranks)
    cpu = torch.device("cpu")
    comms: dict[str, Any] = {"shm": CpuCommunicator(group, ranks, cpu), "gloo": DeviceCommunicatorBase(group, ranks, cpu)}
    if comms["shm"].shm is None:
        raise SystemExit(f"no shared memory here: {comms['shm'].transport}")
    dtype = getattr(torch, a.dtype)
    sizes = [int(s) for s in a.sizes.split(",")]
    times: dict[tuple[str, str, int], list[float]] = {}
    for r in range(a.rounds + 1):  # round 0 warms up
        for size in sizes:
            x = torch.randn(size).to(dtype)
            for op in ("all_reduce", "all_gather"):
                for label, comm in comms.items():
                    fn = comm.all_reduce if op == "all_reduce" else comm.all_gather
                    dist.barrier(group=group)
                    t0 = time.perf_counter()
                    for _ in range(a.calls):
                        fn(x)
                    if r:
                        times.setdefault((op, label, size), []).append((time.perf_counter() - t0) / a.calls * 1e6)
    if rank == 0:
        print(f"ranks={a.ranks} dtype={a.dtype} calls={a.calls} rounds={a.rounds} load={os.getloadavg()}")
        for op in ("all_reduce", "all_gather"):
            for size in sizes:
                shm_us = statistics.median(times[(op, "shm", size)])
                gloo_us = statistics.median(times[(op, "gloo", size)])
                print(f"{op} {size} elements ({size * x.element_size()} B): shm {shm_us:.1f} us, gloo {gloo_us:.1f} us, "
                      f"gloo/shm {gloo_us / shm_us:.1f}x", flush=True)
    comms["shm"].destroy()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    # a decode step's hidden state (SmolLM2: 576; 8 sequences), a prefill chunk's, a logits row block
    parser.add_argument("--sizes", default="576,4608,73728,1048576")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    a = parser.parse_args()
    import torch.multiprocessing as mp

    from pagoda.distributed import get_open_port

    mp.spawn(_rank, args=(a, get_open_port()), nprocs=a.ranks)


if __name__ == "__main__":
    main()
