"""The ``gguf`` quantization method: linear layers and embeddings keep a GGUF file's blocks.

The loader (``pagoda.model_loader.gguf.weights``) hands each layer its tensors as stored: a
``qweight_type`` (GGML type id) and a ``qweight`` (uint8 [rows, bytes per row]) per checkpoint
tensor; a fused layer (q/k/v -> qkv_proj) gets one of each per shard. Blocks run along a row,
so rows of one type concatenate into one matrix; shards of different types stay apart and their
outputs are concatenated.

On CPU the matmul runs on the blocks in C++ (``kernels``), and from a measured row count on
dequantized weight panels with ``F.linear`` (``dense``: the compute-bound batched steps); on CUDA / ROCm in Triton
(``triton_kernels``, every block type, chosen by ``triton_path``); elsewhere, and for block types
the kernel lacks, the weight is dequantized per call in torch (``dequant``), the reference path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import envs
from pagoda.layers.parallel_linear import input_split, shard_input, shard_output
from pagoda.quantization import EmbeddingMethodBase, LinearMethodBase, QuantizationConfig, QuantizeMethodBase
from pagoda_quant_gguf import dense, kernels, triton_path
from pagoda_quant_gguf.dequant import SUPPORTED_TYPES, block_size, dequantize_blocks, type_name

logger = logging.getLogger(__name__)


class GGUFConfig(QuantizationConfig):
    """A GGUF file's quantization: every type per tensor, so there is nothing to configure."""

    dequantizable = True
    # Linear layers split on whole rows (output) and whole blocks (input); see get_quant_method for the vocabulary
    supports_tensor_parallel = True

    @classmethod
    def get_name(cls) -> str:
        return "gguf"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFConfig:
        extra = set(config) - {"quant_method"}
        if extra:
            raise ValueError(f"the gguf method takes no settings; got {sorted(extra)}")
        kernels.start_build()
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from pagoda.layers import Embedding, Linear

        if getattr(layer, "tp_size", 1) > 1 and (isinstance(layer, Embedding) or hasattr(layer, "org_vocab_size")):
            # Across ranks the vocabulary is padded to a multiple of them and split by rows: the table and
            # the LM head are loaded dequantized there (the float layers split it), the linear layers keep blocks.
            return None
        if isinstance(layer, Linear):
            return GGUFLinearMethod()
        if isinstance(layer, Embedding):
            return GGUFEmbeddingMethod()
        return None

    def describe(self) -> str:
        triton = "Triton on CUDA/ROCm" if triton_path.triton_available() else "no Triton (not installed)"
        return f"quantization: gguf (blocks kept; CPU kernel: {kernels.describe()}; {triton})"


@dataclass
class Shard:
    """Rows of one GGML type: ``blocks`` uint8 [rows, bytes per row]; ``packed``: in the CPU kernel's
    repacked layout (``kernels.repack``: the same bytes, reordered), which only that kernel reads."""

    qtype: int
    blocks: torch.Tensor
    packed: bool = False

    @property
    def rows(self) -> int:
        return int(self.blocks.shape[0])


def _weight_loader(layer: nn.Module) -> Callable[[nn.Parameter, torch.Tensor, int | None], None]:
    """Collects one checkpoint tensor's type or blocks under its shard; ``process_weights_after_loading`` assembles them.

    A column-parallel layer over several ranks keeps its rows (whole rows of blocks) right away; the
    input features of a row-parallel one are cut in ``_assemble``, once the type says the block width.
    """
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        shards: dict[int, dict[str, torch.Tensor]] = param.gguf_shards  # type: ignore[attr-defined]
        key = "qweight_type" if loaded.dim() == 0 else "qweight"
        if key == "qweight":
            loaded = shard_output(layer, loaded, shard_id, dim=0, what="gguf qweight")
        shards.setdefault(0 if shard_id is None else shard_id, {})[key] = loaded

    return load


def _register(layer: nn.Module) -> None:
    """The two parameters the loader fills; their data is assembled after loading."""
    # the float weight was made on the model's device (and never filled): the blocks go there, so a
    # CUDA / ROCm model's layers hold them on the GPU (the loader reads them into host memory)
    weight = getattr(layer, "weight", None)
    device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")
    shards: dict[int, dict[str, torch.Tensor]] = {}
    for name in ("qweight", "qweight_type"):
        param = nn.Parameter(torch.empty(0, dtype=torch.uint8, device=device), requires_grad=False)
        param.weight_loader = _weight_loader(layer)  # type: ignore[attr-defined]
        param.gguf_shards = shards  # type: ignore[attr-defined]
        param.gguf_device = device  # type: ignore[attr-defined]
        layer.register_parameter(name, param)
    layer.register_parameter("weight", None)


def _assemble(layer: nn.Module, cols: int, rows: int) -> list[Shard]:
    shards: dict[int, dict[str, torch.Tensor]] = layer.qweight.gguf_shards
    out: list[Shard] = []
    for index in sorted(shards):
        parts = shards[index]
        if set(parts) != {"qweight", "qweight_type"}:
            raise ValueError(f"GGUF shard {index} of a layer got {sorted(parts)}, not both qweight and qweight_type")
        qtype = int(parts["qweight_type"])
        if qtype not in SUPPORTED_TYPES:
            raise ValueError(f"GGUF type {type_name(qtype)} is not supported by pagoda-quant-gguf")
        values, nbytes = block_size(qtype)
        blocks = parts["qweight"]
        if input_split(layer):  # this rank's whole blocks of every row
            per_row = blocks.reshape(blocks.shape[0], -1, nbytes)
            blocks = shard_input(layer, per_row, dim=1, unit=values,
                                 what=f"gguf {type_name(qtype)} blocks of {values}").reshape(blocks.shape[0], -1)
        blocks = blocks.to(layer.qweight.gguf_device)
        if cols % values or blocks.shape[1] != cols // values * nbytes:
            raise ValueError(f"GGUF {type_name(qtype)} tensor of {blocks.shape[1]} bytes a row does not hold {cols} values")
        if out and out[-1].qtype == qtype:  # rows of one type: one matrix
            out[-1] = Shard(qtype, torch.cat([out[-1].blocks, blocks], dim=0))
        else:
            out.append(Shard(qtype, blocks.contiguous()))
    if sum(s.rows for s in out) != rows:
        raise ValueError(f"GGUF layer got {sum(s.rows for s in out)} rows, expected {rows}")
    for i, shard in enumerate(out):
        if envs.PAGODA_KERNELS_IMPL == "triton":  # Triton asked for (on CPU: its interpreter): it reads the stored layout
            break
        # decode reads 4 rows' blocks at once on CPU: rewritten in place of the stored layout (no copy kept)
        packed = kernels.repack(shard.blocks, shard.qtype, cols)
        if packed is not None:
            out[i] = Shard(shard.qtype, packed, packed=True)
    # the assembled blocks become the parameters' data (what the model's memory report counts)
    device = layer.qweight.gguf_device
    layer.qweight.data = out[0].blocks if len(out) == 1 else torch.empty(0, dtype=torch.uint8, device=device)
    layer.qweight_type.data = torch.tensor([s.qtype for s in out], dtype=torch.uint8, device=device)
    del layer.qweight.gguf_shards, layer.qweight_type.gguf_shards, layer.qweight.gguf_device, layer.qweight_type.gguf_device
    return out


def matmul(shards: list[Shard], x: torch.Tensor, cols: int) -> torch.Tensor:
    """``x`` [T, cols] times the rows of every shard, transposed: [T, rows] in float32 or x's dtype."""
    outs = []
    for shard in shards:
        if (shard.packed or kernels.supports(shard.qtype, x)) and _takes_dense(shard.qtype, x):
            outs.append(dense.DensePath(shard.blocks, shard.qtype, cols, shard.packed)(x, torch.float32))
        elif shard.packed:
            outs.append(kernels.matmul(x, shard.blocks, shard.qtype, cols, packed=True))
        elif triton_path.supports(shard.qtype, x):
            outs.append(triton_path.matmul(x, shard.blocks, shard.qtype, cols))
        elif kernels.supports(shard.qtype, x):
            outs.append(kernels.matmul(x, shard.blocks, shard.qtype, cols))
        else:
            w = dequantize_blocks(shard.blocks, shard.qtype, cols).to(x.dtype)
            outs.append(F.linear(x, w))
    return outs[0] if len(outs) == 1 else torch.cat([o.to(x.dtype) for o in outs], dim=-1)


def _takes_dense(qtype: int, x: torch.Tensor) -> bool:
    """Whether ``x`` [M, cols] on the CPU has the rows for the dense batched path of a ``qtype`` layer."""
    rows = x.shape[0]
    if x.device.type != "cpu" or rows < dense.smallest_candidate():
        return False
    threshold = dense.min_rows(qtype, x.dtype)
    return threshold > 0 and rows >= threshold


Forward = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


class KernelForward:
    """A layer's one CPU-kernel shard, bound at load: the entry point, type, layout and weight pointer are
    fixed then, so a call is a few attribute reads, the output's allocation and the kernel call
    (measured, thread CPU time of a 1-row ``Linear.forward``, same run: 10.2 us in float32 and 13.5 in
    bfloat16 before, 4.9 in both after; bfloat16's two conversions are now made in the kernel).
    Every call goes through the module's ``pagoda_gguf_linear`` and reads no tensor
    values, so a kernel graph captures it (the weight is the layer's ``qweight``, which the model holds).

    Inputs of ``dense_from`` rows or more (``dense.min_rows`` for the model's dtype, measured or read
    from the disk cache at load, so no request waits on it) take the dense batched path instead
    (``dense.DensePath``); below ``gate`` rows no threshold is looked at."""

    __slots__ = ("blocks", "cols", "dense", "dense_from", "dtype", "fn", "gate", "packed", "ptr", "qtype", "rows")

    def __init__(self, shard: Shard, cols: int, dtype: torch.dtype) -> None:
        lib = kernels.library()
        assert lib is not None
        self.fn = lib.pagoda_gguf_linear
        self.blocks = shard.blocks  # holds the memory ptr points into
        self.qtype, self.packed, self.ptr = shard.qtype, int(shard.packed), shard.blocks.data_ptr()
        self.rows, self.cols = shard.rows, cols
        self.dense = dense.DensePath(shard.blocks, shard.qtype, cols, shard.packed)
        self.dtype = dtype
        self.dense_from = dense.min_rows(shard.qtype, dtype)
        self.gate = dense.smallest_candidate()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        code = kernels.DTYPE_CODES.get(x.dtype)
        if code is None or x.shape[-1] != self.cols:
            raise ValueError(f"gguf layer takes [..., {self.cols}] float32/bfloat16/float16 input; got "
                             f"{list(x.shape)} {x.dtype}")
        if not x.is_contiguous():
            x = x.contiguous()
        m = x.numel() // self.cols
        if m >= self.gate:
            threshold = self.dense_from if x.dtype == self.dtype else dense.min_rows(self.qtype, x.dtype)
            if 0 < threshold <= m:
                y = self.dense(x.reshape(m, self.cols), x.dtype).reshape(*x.shape[:-1], self.rows)
                return y if bias is None else y + bias
        y = x.new_empty((*x.shape[:-1], self.rows))  # (torch.empty with a dtype costs ~1 us more)
        status = self.fn(self.qtype, self.packed, self.ptr, self.rows, self.cols, x.data_ptr(), code,
                         m, y.data_ptr(), code, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"gguf kernel refused type {type_name(self.qtype)} with {self.cols} columns")
        return y if bias is None else y + bias


def bind(shards: list[Shard], cols: int, rows: int, dtype: torch.dtype) -> Forward:
    """The layer's forward, decided once at load: the bound CPU kernel where one shard runs on it, else
    ``matmul`` over the shards (several types, the Triton kernel, the torch reference), which decides per call.
    The dense path's thresholds for the model's ``dtype`` are settled here (measured once per CPU, at load)."""
    probe = torch.empty(0, cols)
    for shard in shards:
        if shard.blocks.device.type == "cpu" and (shard.packed or kernels.supports(shard.qtype, probe)):
            dense.min_rows(shard.qtype, dtype)
    if len(shards) == 1:
        shard = shards[0]
        on_cpu = shard.blocks.device.type == "cpu"
        if on_cpu and (shard.packed or (kernels.supports(shard.qtype, probe)
                                        and not triton_path.supports(shard.qtype, probe))):
            return KernelForward(shard, cols, dtype)

    def forward(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        y = matmul(shards, x.reshape(-1, cols), cols).to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, rows)

    return forward


class GGUFLinearMethod(LinearMethodBase):
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],  # type: ignore[override]
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        _register(layer)
        self.cols = input_size_per_partition
        self.rows = sum(output_partition_sizes)
        self.dtype = params_dtype
        self.shards: list[Shard] = []

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.shards = _assemble(layer, self.cols, self.rows)
        self.forward = bind(self.shards, self.cols, self.rows, self.dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        return self.forward(x, bias)


class GGUFEmbeddingMethod(EmbeddingMethodBase):
    """The vocabulary table in blocks: a lookup dequantizes only the rows it reads; as a tied head, a matmul on the blocks."""

    def create_weights(self, layer: nn.Module, num_embeddings: int, embedding_dim: int,  # type: ignore[override]
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        _register(layer)
        self.rows, self.cols, self.dtype = num_embeddings, embedding_dim, params_dtype
        self.shards: list[Shard] = []

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.shards = _assemble(layer, self.cols, self.rows)
        if len(self.shards) != 1:
            raise ValueError("a GGUF embedding table is one tensor of one type")
        self.forward = bind(self.shards, self.cols, self.rows, self.dtype)

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        shard = self.shards[0]
        ids = input_ids.reshape(-1)
        if shard.packed:
            rows = kernels.unpack_rows(shard.blocks, shard.qtype, self.cols, ids)
        else:
            rows = shard.blocks.index_select(0, ids)
        out = dequantize_blocks(rows, shard.qtype, self.cols).to(self.dtype)
        return out.reshape(*input_ids.shape, self.cols)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        return self.forward(x, bias)
