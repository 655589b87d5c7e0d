"""Which tool-call format a checkpoint writes: the parser its tokenizer_config.json names, else read from its chat
template (and mlx-lm's own inference from template and vocabulary), as mlx-lm chooses the parser that reads its
calls; where mlx-lm's parser misreads a family (canitoolcall's fixtures, issue 53), the reader of our own for it.
The formats themselves live in formats.py (the shared pieces and the simple forms) and one module per family."""

from __future__ import annotations

import importlib.util
import re

from .dsml import dsml_format
from .formats import DEEPSEEK, FUNCTION_GEMMA, GENERIC, JSON, PYTHON_TAG, ToolFormat, mlx_lm_format
from .gemma4 import GEMMA4
from .glm import GLM
from .harmony import HARMONY
from .kimi_k2 import KIMI_K2
from .kimi_k3 import KIMI_K3
from .llama import LLAMA3, LLAMA4
from .mistral import MISTRAL
from .qwen3_xml import QWEN3_XML


def _template(tokenizer) -> str:
    t = getattr(tokenizer, "chat_template", None)
    return t if isinstance(t, str) else ""


def _declared_parser(tokenizer) -> str | None:
    """The mlx-lm parser a checkpoint names in its tokenizer_config.json (`tool_parser_type`, as mlx-lm's
    conversions write it: Laguna's "laguna"), when mlx-lm has it."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    name = (getattr(inner, "init_kwargs", None) or {}).get("tool_parser_type")
    if not isinstance(name, str) or not re.fullmatch(r"\w+", name):
        return None
    try:
        return name if importlib.util.find_spec(f"mlx_lm.tool_parsers.{name}") is not None else None
    except ImportError:
        return None


def detect(tokenizer) -> ToolFormat:
    """The format of this model: the parser its checkpoint names, else read from its chat template (and
    mlx-lm's own inference), as mlx-lm chooses the parser that reads its calls."""
    template = _template(tokenizer)
    dsml = dsml_format(tokenizer, template)
    if dsml is not None:
        return dsml
    if "tool▁calls▁begin" in template:
        return DEEPSEEK
    if "<|header_start|>" in template:  # Llama 4's headers: its pythonic calls (llama.py)
        return LLAMA4
    if PYTHON_TAG in template and "parameters" in template:
        return LLAMA3
    if "<|channel|>" in template and "<|message|>" in template:  # gpt-oss's Harmony (harmony.py)
        return HARMONY
    name = _declared_parser(tokenizer)
    try:  # mlx-lm's inference from the template and vocabulary (a private helper: its absence is no error)
        from mlx_lm.tokenizer_utils import _infer_tool_parser

        name = name or _infer_tool_parser(getattr(tokenizer, "_tokenizer", tokenizer))
    except Exception:
        pass
    if name == "function_gemma":  # (our reader: mlx-lm's reads scalars only)
        return FUNCTION_GEMMA
    if name == "glm47":  # (glm.py: mlx-lm's strips string values and cuts one at a `</tool_call>` inside it)
        return GLM
    if name == "kimi_k2":  # (kimi_k2.py: mlx-lm's cuts arguments at a `<|tool_call_end|>` inside a string)
        return KIMI_K2
    if name == "kimi_k3":  # (kimi_k3.py: XTML's channels, read by our reader)
        return KIMI_K3
    if name == "mistral":  # (mistral.py: mlx-lm's names a call by its [CALL_ID], splits no [THINK] reasoning)
        return MISTRAL
    if name == "gemma4":  # (gemma4.py: mlx-lm's reads a string's <|"|> or keys with spaces as calls' ends)
        return GEMMA4
    if name == "qwen3_coder":  # (qwen3_xml.py: mlx-lm's cuts a value at a `</parameter>` inside it)
        return QWEN3_XML
    if name and name != "json_tools":
        return mlx_lm_format(name)
    if "tools" in template and "<tool_call>" in template:
        return JSON
    return GENERIC
