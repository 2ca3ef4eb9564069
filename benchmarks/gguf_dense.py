"""The GGUF dense batched path (issue 38) at the layer level: SmolLM2-135M's decoder linears (qkv 960x576,
o 576x576, gate/up 3072x576, down 576x1536; Q4_1, repacked as loaded) at M rows, bf16 activations, one
thread, thread CPU time (best of 3 interleaved), times 30 layers: the block kernel, the dense path
(``pagoda_quant_gguf.dense``), and the same weights dequantized (one F.linear on the whole float32 / bf16
weight, what a dequantized model's matmul costs at best).

usage: python -m benchmarks.gguf_dense [ROWS ...]   (default 64 512 2048)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def main() -> None:
    from pagoda_quant_gguf import dense, kernels
    from pagoda_quant_gguf.dequant import dequantize_blocks

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    mats = []
    for n, k in SHAPES:
        blocks = torch.from_numpy(quantize(rng.standard_normal((n, k)).astype(np.float32), Q.Q4_1))
        w = dequantize_blocks(blocks, int(Q.Q4_1), k)
        packed = kernels.repack(blocks, int(Q.Q4_1), k)
        assert packed is not None
        mats.append((k, packed, dense.DensePath(packed, int(Q.Q4_1), k, True), w, w.to(torch.bfloat16)))

    def step(kind: str, m: int) -> Callable[[], None]:
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in (576, 1536)}

        def run() -> None:
            for k, packed, path, w, wb in mats:
                x = xs[k]
                if kind == "block":
                    kernels.matmul(x, packed, int(Q.Q4_1), k, packed=True, out_dtype=x.dtype)
                elif kind == "dense":
                    path(x, x.dtype)
                elif kind == "dequant_fp32":
                    F.linear(x.float(), w).to(x.dtype)
                else:
                    F.linear(x, wb)
        return run

    for m in [int(a) for a in sys.argv[1:]] or [64, 512, 2048]:
        fns = {kind: step(kind, m) for kind in ("block", "dense", "dequant_fp32", "dequant_bf16")}
        for fn in fns.values():
            fn()
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(3):
            for kind, fn in fns.items():
                start = time.thread_time()
                fn()
                best[kind] = min(best[kind], time.thread_time() - start)
        ms = {kind: round(s * LAYERS * 1e3, 1) for kind, s in best.items()}
        print(f"{m} rows: ms a step ({LAYERS} layers, one core) {ms}; dense / block speed "
              f"{best['block'] / best['dense']:.2f}, dense / dequantized fp32 {best['dequant_fp32'] / best['dense']:.2f}, "
              f"block / dequantized bf16 {best['dequant_bf16'] / best['block']:.2f}", flush=True)


if __name__ == "__main__":
    main()
