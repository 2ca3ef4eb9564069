"""Entry point: registers the parsers by name; a parser's module is imported only when a server picks it."""

from pagoda.plugins import ToolParserSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.3"


@hookimpl
def pagoda_register_tool_parsers() -> list[ToolParserSpec]:
    return [
        ToolParserSpec(name="hermes", cls="pagoda_tool_parsers.hermes_tool_parser:Hermes2ProToolParser"),
        ToolParserSpec(name="llama3_json", cls="pagoda_tool_parsers.llama_tool_parser:Llama3JsonToolParser"),
        ToolParserSpec(name="mistral", cls="pagoda_tool_parsers.mistral_tool_parser:MistralToolParser"),
        ToolParserSpec(name="pythonic", cls="pagoda_tool_parsers.pythonic_tool_parser:PythonicToolParser"),
    ]
