"""GGUF quantization for pagoda: the ``gguf`` method (vLLM's name) keeps a GGUF file's blocks in memory."""
