"""Tool calls in each model family's own format (README, "Serving agents"): formats (markers, parsing),
render (a conversation with tools through the chat template, or the generic form), stream (an answer split
into reasoning, content and calls as it streams), grammars (a forced call held to its schema)."""

from .detect import detect
from .formats import Call, ToolCallError, ToolFormat
from .render import template_input
from .stream import CallArgs, CallStart, Splitter, Text

__all__ = ["Call", "CallArgs", "CallStart", "Splitter", "Text", "ToolCallError", "ToolFormat", "detect",
           "template_input"]
