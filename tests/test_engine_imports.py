"""What an engine on the CPU imports at start-up: neither Triton (a GPU compiler) nor a structured-outputs
backend (xgrammar pulls in transformers' tokenizer stack) until a request asks for a grammar.

Each import cost the engine-core process its share of start-up (loading every plugin took 1.63 s with
xgrammar imported by its plugin's package, 0.41 s without, on the 2-vCPU guest). The engine runs in a
fresh interpreter, so nothing the test process imported counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

_SCRIPT = """
import json, sys
from pagoda import LLM, SamplingParams
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=128, num_kv_blocks=64)
llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
             use_tqdm=False)
print(json.dumps(sorted(m for m in ("triton", "xgrammar", "llguidance") if m in sys.modules)))
"""


def test_a_cpu_engine_imports_no_triton_and_no_grammar_backend(tiny_model_dir: Any) -> None:
    path, _ = tiny_model_dir("llama")
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(path)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ), check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
