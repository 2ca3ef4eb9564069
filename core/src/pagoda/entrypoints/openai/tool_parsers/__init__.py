"""Tool-call parsers (vLLM's interface) and the helpers parsers share. See docs/tool_calling.md."""

from pagoda.entrypoints.openai.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from pagoda.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ToolParser,
    ToolParserManager,
    make_tool_call_id,
)
from pagoda.entrypoints.openai.tool_parsers.utils import (
    CallScan,
    ScanMemo,
    ToolCallDeltaStream,
    partial_marker_len,
    scan_call_list,
    scan_call_object,
    scan_value,
)

__all__ = [
    "CallScan",
    "DeltaFunctionCall",
    "DeltaMessage",
    "DeltaToolCall",
    "ExtractedToolCallInformation",
    "FunctionCall",
    "ScanMemo",
    "ToolCall",
    "ToolCallDeltaStream",
    "ToolParser",
    "ToolParserManager",
    "make_tool_call_id",
    "partial_marker_len",
    "scan_call_list",
    "scan_call_object",
    "scan_value",
]
