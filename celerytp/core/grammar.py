"""Grammars as requests carry them (GenSpec.grammar), in llguidance's terms: what the leader
checks before queueing and what rank 0 compiles (worker/grammar.py). No torch here."""

from __future__ import annotations

import json
from typing import Any

# JSON as json.dumps writes it, and no free whitespace: a small model given free whitespace can
# spend its whole budget on newlines. A schema's own "x-guidance" options override these.
JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def grammar_text(grammar: dict[str, Any]) -> str:
    """llguidance's grammar string for a GenSpec grammar (raises ValueError for an unknown form)."""
    import llguidance

    if "json_schema" in grammar:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(grammar["json_schema"]), defaults=JSON_STYLE)
    if "lark" in grammar:
        return llguidance.LLMatcher.grammar_from_lark(grammar["lark"])
    raise ValueError(f"unknown grammar form {sorted(grammar)}; expected json_schema or lark")


def check_grammar(grammar: dict[str, Any]) -> str | None:
    """Why `grammar` cannot be compiled (None when it can); no tokenizer needed (the leader's check)."""
    import llguidance

    try:
        return llguidance.LLMatcher.validate_grammar(grammar_text(grammar)) or None
    except ValueError as exc:
        return str(exc)
