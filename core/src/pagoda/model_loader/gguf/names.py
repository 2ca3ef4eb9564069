"""Which Hugging Face parameter each tensor of a GGUF file becomes, per llama.cpp architecture.

GGUF names come from the ``gguf`` package's own tables: ``MODEL_TENSORS[arch]``
lists the tensor kinds an architecture may have and ``TENSOR_NAMES`` spells
each (``blk.{bid}.attn_q``). What the package cannot say is which of the many
Hugging Face spellings it knows for a kind (``gguf.tensor_mapping``) the target
transformers class uses; that is the one thing written here, per naming scheme
(a few architectures share one), with the layout changes llama.cpp's converter
makes that a loader has to undo (``GGUFArchitecture`` flags).

transformers finds the same names by instantiating the model on the meta
device and asking ``gguf.tensor_mapping`` for each of its parameters, which
needs the model's modeling module imported (seconds, at every start without
the convert cache). The tests check these tables against ``gguf.tensor_mapping``
and against the weights transformers loads from the same file instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Literal

from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES

T = MODEL_TENSOR

# How a group of GGUF tensors becomes HF parameters besides a rename:
#   fuse_rows: concatenated along dim 0 (q, k, v -> qkv_proj);
#   fuse_experts: stacked expert matrices concatenated along dim 1 (gate, up -> experts.gate_up_proj)
FuseKind = Literal["fuse_rows", "fuse_experts"]


@dataclass(frozen=True)
class Fused:
    """Several GGUF tensor kinds of one block that transformers holds as one parameter."""

    kinds: tuple[MODEL_TENSOR, ...]
    hf_name: str  # HF module path inside the block (for stacked experts: the parameter itself)
    how: FuseKind


@dataclass(frozen=True)
class GGUFArchitecture:
    """How the tensors of one llama.cpp architecture map to its transformers class's parameters."""

    arch: MODEL_ARCH
    layer_prefix: str  # HF path of block ``N`` without the number: ``model.layers``
    names: MappingProxyType[MODEL_TENSOR, str]  # kind -> HF module path (top level) or path inside the block
    fused: tuple[Fused, ...] = ()
    # Tensors with no HF parameter (transformers recomputes them from the config).
    ignored: frozenset[MODEL_TENSOR] = frozenset()
    # Parameters whose HF name has no ``.weight`` suffix (transformers 5's stacked experts).
    bare: frozenset[MODEL_TENSOR] = frozenset()
    # llama.cpp reorders Q/K rows for its rotary kernel (LlamaModel.permute): only the llama architecture.
    permute_qk: bool = False
    # llama.cpp stores Gemma's RMSNorm weight as 1 + w (GemmaModel.modify_tensors).
    norm_offset: bool = False
    # GPT-2's Conv1D matrices are [in, out] in HF; llama.cpp transposes them to [out, in].
    transposed: frozenset[MODEL_TENSOR] = frozenset()
    # llama.cpp regroups GPT-NeoX's per-head [q, k, v] rows into all q, all k, all v.
    regroup_neox_qkv: bool = False
    # ... and Falcon's per-KV-group [q..., k, v] rows the same way.
    regroup_falcon_qkv: bool = False
    # Names that replace ``names`` when the file has a tensor of the given kind (Falcon 40B's two norms).
    variant: tuple[MODEL_TENSOR, MappingProxyType[MODEL_TENSOR, str]] | None = None
    # A GGUF kind that is one HF parameter split in three (old Phi-2 files' fused qkv -> q, k, v).
    split_qkv: MappingProxyType[MODEL_TENSOR, tuple[str, str, str]] = field(
        default_factory=lambda: MappingProxyType({})
    )

    @property
    def name(self) -> str:
        return MODEL_ARCH_NAMES[self.arch]


_LLAMA_NAMES: dict[MODEL_TENSOR, str] = {
    T.TOKEN_EMBD: "model.embed_tokens",
    T.OUTPUT_NORM: "model.norm",
    T.OUTPUT: "lm_head",
    T.ATTN_NORM: "input_layernorm",
    T.ATTN_Q: "self_attn.q_proj",
    T.ATTN_K: "self_attn.k_proj",
    T.ATTN_V: "self_attn.v_proj",
    T.ATTN_OUT: "self_attn.o_proj",
    T.ATTN_Q_NORM: "self_attn.q_norm",
    T.ATTN_K_NORM: "self_attn.k_norm",
    T.FFN_NORM: "post_attention_layernorm",
    T.FFN_GATE: "mlp.gate_proj",
    T.FFN_UP: "mlp.up_proj",
    T.FFN_DOWN: "mlp.down_proj",
}
_MOE_NAMES: dict[MODEL_TENSOR, str] = {
    T.FFN_GATE_INP: "mlp.gate",
    T.FFN_DOWN_EXP: "mlp.experts.down_proj",
    T.FFN_GATE_INP_SHEXP: "mlp.shared_expert_gate",
    T.FFN_GATE_SHEXP: "mlp.shared_expert.gate_proj",
    T.FFN_UP_SHEXP: "mlp.shared_expert.up_proj",
    T.FFN_DOWN_SHEXP: "mlp.shared_expert.down_proj",
}
_MOE_FUSED = (Fused((T.FFN_GATE_EXP, T.FFN_UP_EXP), "mlp.experts.gate_up_proj", "fuse_experts"),)


def _arch(
    arch: MODEL_ARCH,
    names: dict[MODEL_TENSOR, str],
    layer_prefix: str = "model.layers",
    fused: tuple[Fused, ...] = (),
    ignored: frozenset[MODEL_TENSOR] = frozenset(),
    bare: frozenset[MODEL_TENSOR] = frozenset(),
    permute_qk: bool = False,
    norm_offset: bool = False,
    transposed: frozenset[MODEL_TENSOR] = frozenset(),
    regroup_neox_qkv: bool = False,
    split_qkv: dict[MODEL_TENSOR, tuple[str, str, str]] | None = None,
    regroup_falcon_qkv: bool = False,
    variant: tuple[MODEL_TENSOR, dict[MODEL_TENSOR, str]] | None = None,
) -> GGUFArchitecture:
    # Keep only the kinds llama.cpp defines for this architecture: a name table shared by several
    # architectures must not accept another one's tensors.
    allowed = set(MODEL_TENSORS[arch])
    return GGUFArchitecture(
        arch=arch,
        layer_prefix=layer_prefix,
        names=MappingProxyType({kind: hf for kind, hf in names.items() if kind in allowed}),
        fused=tuple(f for f in fused if set(f.kinds) <= allowed),
        ignored=ignored & allowed,
        bare=bare,
        permute_qk=permute_qk,
        norm_offset=norm_offset,
        transposed=transposed,
        regroup_neox_qkv=regroup_neox_qkv,
        split_qkv=MappingProxyType(split_qkv or {}),
        regroup_falcon_qkv=regroup_falcon_qkv,
        variant=None if variant is None else (variant[0], MappingProxyType(variant[1])),
    )


def _without(names: dict[MODEL_TENSOR, str], *kinds: MODEL_TENSOR) -> dict[MODEL_TENSOR, str]:
    return {kind: hf for kind, hf in names.items() if kind not in kinds}


_ROPE_FREQS = frozenset({T.ROPE_FREQS})  # Llama 3 files store the rope scaling factors; HF recomputes them

_GEMMA2_NAMES = _LLAMA_NAMES | {
    T.ATTN_POST_NORM: "post_attention_layernorm",
    T.FFN_PRE_NORM: "pre_feedforward_layernorm",  # spelled ffn_norm, as FFN_NORM is elsewhere
    T.FFN_POST_NORM: "post_feedforward_layernorm",
}

_FALCON_NAMES: dict[MODEL_TENSOR, str] = {
    T.TOKEN_EMBD: "transformer.word_embeddings",
    T.OUTPUT_NORM: "transformer.ln_f",
    T.OUTPUT: "lm_head",
    T.ATTN_NORM: "input_layernorm",
    T.ATTN_QKV: "self_attention.query_key_value",
    T.ATTN_OUT: "self_attention.dense",
    T.FFN_UP: "mlp.dense_h_to_4h",
    T.FFN_DOWN: "mlp.dense_4h_to_h",
}

ARCHITECTURES: dict[str, GGUFArchitecture] = {
    a.name: a
    for a in (
        _arch(MODEL_ARCH.LLAMA, _LLAMA_NAMES, ignored=_ROPE_FREQS, permute_qk=True),
        _arch(MODEL_ARCH.QWEN2, _LLAMA_NAMES, ignored=_ROPE_FREQS),
        _arch(MODEL_ARCH.QWEN3, _LLAMA_NAMES, ignored=_ROPE_FREQS),
        _arch(MODEL_ARCH.QWEN2MOE, _LLAMA_NAMES | _MOE_NAMES, fused=_MOE_FUSED, bare=frozenset({T.FFN_DOWN_EXP})),
        _arch(MODEL_ARCH.QWEN3MOE, _LLAMA_NAMES | _MOE_NAMES, fused=_MOE_FUSED, bare=frozenset({T.FFN_DOWN_EXP})),
        _arch(MODEL_ARCH.GEMMA, _LLAMA_NAMES, norm_offset=True),
        _arch(MODEL_ARCH.GEMMA2, _GEMMA2_NAMES, norm_offset=True),
        _arch(
            MODEL_ARCH.PHI3,
            # fused projections: separate q / k / v tensors (other converters) are fused back
            _without(_LLAMA_NAMES, T.ATTN_Q, T.ATTN_K, T.ATTN_V)
            | {T.ATTN_QKV: "self_attn.qkv_proj", T.FFN_UP: "mlp.gate_up_proj"},
            fused=(Fused((T.ATTN_Q, T.ATTN_K, T.ATTN_V), "self_attn.qkv_proj", "fuse_rows"),),
        ),
        # StableLM 2 12B's per-head q/k norms (stacked by llama.cpp) have no single HF parameter: not mapped
        _arch(MODEL_ARCH.STABLELM, _without(_LLAMA_NAMES, T.ATTN_Q_NORM, T.ATTN_K_NORM)),
        _arch(
            MODEL_ARCH.GPT2,
            {
                T.TOKEN_EMBD: "transformer.wte",
                T.POS_EMBD: "transformer.wpe",
                T.OUTPUT_NORM: "transformer.ln_f",
                T.OUTPUT: "lm_head",
                T.ATTN_NORM: "ln_1",
                T.ATTN_QKV: "attn.c_attn",
                T.ATTN_OUT: "attn.c_proj",
                T.FFN_NORM: "ln_2",
                T.FFN_UP: "mlp.c_fc",
                T.FFN_DOWN: "mlp.c_proj",
            },
            layer_prefix="transformer.h",
            transposed=frozenset({T.ATTN_QKV, T.ATTN_OUT, T.FFN_UP, T.FFN_DOWN}),
        ),
        _arch(
            MODEL_ARCH.GPTNEOX,
            {
                T.TOKEN_EMBD: "gpt_neox.embed_in",
                T.OUTPUT_NORM: "gpt_neox.final_layer_norm",
                T.OUTPUT: "lm_head",  # transformers 5 names it so (checkpoints: embed_out)
                T.ATTN_NORM: "input_layernorm",
                T.ATTN_QKV: "attention.query_key_value",
                T.ATTN_OUT: "attention.dense",
                T.FFN_NORM: "post_attention_layernorm",
                T.FFN_UP: "mlp.dense_h_to_4h",
                T.FFN_DOWN: "mlp.dense_4h_to_h",
            },
            layer_prefix="gpt_neox.layers",
            regroup_neox_qkv=True,
        ),
        _arch(
            MODEL_ARCH.FALCON,
            _FALCON_NAMES,
            layer_prefix="transformer.h",
            regroup_falcon_qkv=True,
            # new_decoder_architecture (Falcon 40B): llama.cpp's attn_norm is ln_mlp, attn_norm_2 ln_attn
            variant=(T.ATTN_NORM_2, _without(_FALCON_NAMES, T.ATTN_NORM) | {T.ATTN_NORM: "ln_mlp", T.ATTN_NORM_2: "ln_attn"}),
        ),
        _arch(
            MODEL_ARCH.PHI2,
            {
                T.TOKEN_EMBD: "model.embed_tokens",
                T.OUTPUT_NORM: "model.final_layernorm",
                T.OUTPUT: "lm_head",
                T.ATTN_NORM: "input_layernorm",
                T.ATTN_Q: "self_attn.q_proj",
                T.ATTN_K: "self_attn.k_proj",
                T.ATTN_V: "self_attn.v_proj",
                T.ATTN_OUT: "self_attn.dense",
                T.FFN_UP: "mlp.fc1",
                T.FFN_DOWN: "mlp.fc2",
            },
            split_qkv={T.ATTN_QKV: ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")},
        ),
    )
}


@dataclass(frozen=True)
class TensorRole:
    """What one GGUF tensor is: its kind, its block (None at top level) and its suffix (``weight`` / ``bias``)."""

    kind: MODEL_TENSOR
    block: int | None
    suffix: str


def _gguf_base_names(arch: GGUFArchitecture) -> dict[str, tuple[MODEL_TENSOR, bool]]:
    """GGUF base name (``attn_q`` inside a block, ``token_embd`` at top level) -> (kind, is per block)."""
    bases: dict[str, tuple[MODEL_TENSOR, bool]] = {}
    for kind in MODEL_TENSORS[arch.arch]:
        spelled = TENSOR_NAMES[kind]
        if spelled.startswith("blk.{bid}."):
            bases[spelled.removeprefix("blk.{bid}.")] = (kind, True)
        elif "{" not in spelled:
            bases[spelled] = (kind, False)
    return bases


_BASES = {name: _gguf_base_names(arch) for name, arch in ARCHITECTURES.items()}


def tensor_role(architecture: str, gguf_name: str) -> TensorRole | None:
    """The role of ``gguf_name`` in ``architecture``; None when llama.cpp defines no such tensor for it."""
    base, _, suffix = gguf_name.rpartition(".")
    if not base:
        return None
    block: int | None = None
    if base.startswith("blk."):
        _, number, base = base.split(".", 2) if base.count(".") >= 2 else ("", "", "")
        if not number.isdigit():
            return None
        block = int(number)
    entry = _BASES[architecture].get(base)
    if entry is None or entry[1] != (block is not None):
        return None
    return TensorRole(kind=entry[0], block=block, suffix=suffix)


def names_for(arch: GGUFArchitecture, kinds: set[MODEL_TENSOR]) -> GGUFArchitecture:
    """``arch`` with its variant names when the file has the variant's marker tensor."""
    if arch.variant is None or arch.variant[0] not in kinds:
        return arch
    return replace(arch, names=arch.variant[1], variant=None)


def hf_parameter(arch: GGUFArchitecture, role: TensorRole, module: str) -> str:
    """The full HF name of parameter ``role.suffix`` of ``module`` (a path inside the block or at top level)."""
    path = module if role.block is None else f"{arch.layer_prefix}.{role.block}.{module}"
    return path if role.kind in arch.bare else f"{path}.{role.suffix}"
