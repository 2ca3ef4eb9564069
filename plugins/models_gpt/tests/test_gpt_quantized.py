"""W8A8 int8 GPT-family checkpoints (made by the compressed-tensors library) served through ``pagoda.LLM``.

The reference is transformers running the same tiny model with each quantized Linear's weight
dequantized from the checkpoint and its input rounded to int8 per token
(``pagoda.testing.quantized_checkpoint``, which also says how the tolerances were measured).
OPT stacks separately quantized q/k/v and quantizes project_in/out; Falcon's new architecture
interleaves its fused query_key_value rows per KV group, so its int8 weight and per-channel
scales are regrouped alike. GPT-2's Conv1D projections are no nn.Linear: refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import FalconConfig, GPT2Config, OPTConfig

from pagoda.testing.model_parity import build_tiny_model, save_tiny_model

pytest.importorskip("compressed_tensors", reason="the test makes its checkpoints with compressed-tensors")
pytest.importorskip("pagoda_quant_compressed_tensors", reason="pagoda serves compressed-tensors through that plugin")

VOCAB = 256
OPT = dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_attention_heads=4, num_hidden_layers=2,
           max_position_embeddings=512, do_layer_norm_before=False, word_embed_proj_dim=32)
FALCON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=512,
              new_decoder_architecture=True, num_kv_heads=2, bias=True)


def _config(case: str) -> Any:
    return OPTConfig(**OPT) if case == "opt" else FalconConfig(**FALCON)


@pytest.mark.parametrize("case", ["opt", "falcon"])
def test_w8a8_matches_its_dequantized_reference(tmp_path: Path, case: str) -> None:
    from pagoda.testing.quantized_checkpoint import check_w8a8_parity

    check_w8a8_parity(_config(case), tmp_path, model_impl="pagoda")


def test_quantized_gpt2_is_refused_by_name(tmp_path: Path) -> None:
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    from pagoda import LLM

    path = save_tiny_model(build_tiny_model(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4), seed=1),
                           tmp_path / "ckpt")
    # a W8A8 recipe aimed at GPT-2's Conv1D layers: compressed-tensors' own config for it
    quant = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("W8A8", ["Conv1D"])},
                               ignore=["lm_head"], format="int-quantized", quantization_status="compressed")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quant.model_dump(mode="json")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel does not load quantized weights .*Conv1D"):
        LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=128, num_kv_blocks=32,
            model_impl="pagoda")
