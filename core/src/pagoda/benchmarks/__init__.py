"""`pagoda bench`: throughput, latency, serve and startup benchmarks (vLLM's `vllm bench`)."""
