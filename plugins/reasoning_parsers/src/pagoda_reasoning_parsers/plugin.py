"""Entry point of the reasoning-parsers plugin; the parser modules are imported only when one is picked."""

from pagoda.plugins import ReasoningParserSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.4"


@hookimpl
def pagoda_register_reasoning_parsers() -> list[ReasoningParserSpec]:
    return [
        ReasoningParserSpec(name="deepseek_r1",
                            cls="pagoda_reasoning_parsers.deepseek_r1_reasoning_parser:DeepSeekR1ReasoningParser"),
        ReasoningParserSpec(name="qwen3", cls="pagoda_reasoning_parsers.qwen3_reasoning_parser:Qwen3ReasoningParser"),
    ]
