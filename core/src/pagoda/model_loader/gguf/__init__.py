"""Reading GGUF files (llama.cpp's format), one module per job.

* ``file``: the lean reader (metadata and tensor table from a memory map, tensor bytes on demand);
* ``config``: a transformers config from the file's metadata;
* ``names``: which Hugging Face parameter each GGUF tensor becomes, per llama.cpp architecture;
* ``weights``: the tensors, dequantized (or kept as blocks for ``pagoda-quant-gguf``) and renamed.

Nothing is imported here, so reading a config (``config``) does not import torch (``weights`` does).
"""
