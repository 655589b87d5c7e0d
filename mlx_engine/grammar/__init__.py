"""Structured output: grammars over the model's tokens, kept under speculation (docs/structured-output.md).

spec: compiled grammars (JSON schema, json_object, regex, Lark) and their errors; matcher: one sequence's
state (masks along a draft, rollback, forced tokens, the reasoning gate); masks: applying a mask to logits
on the device; drafter: the grammar's forced tokens as a drafter ahead of any other; tokenizer: the
grammar engine's view of a model's tokenizer. The engine is llguidance (docs/structured-output.md says why).
"""

from .matcher import GrammarViolation, Matcher
from .masks import apply_bitmask
from .spec import Grammar, GrammarError, json_object, json_schema, lark, regex
from .tokenizer import grammar_tokenizer

__all__ = ["Grammar", "GrammarError", "GrammarViolation", "Matcher", "apply_bitmask", "grammar_tokenizer",
           "json_object", "json_schema", "lark", "regex"]
