"""Structured output on rank 0: a request's grammar as a token mask, with llguidance.

A request that carries a grammar (GenSpec.grammar: `{"json_schema": {...}}`, with `"strict": true`
when the schema is to be followed exactly (core/grammar.py), or `{"lark": "..."}`)
gets a matcher when it enters a row. Each step its row's logits are whole on rank 0 (the row
takes the WHOLE path of worker/sampling.py `slice_mode`), the matcher's mask sets every token
the grammar forbids to -inf, and the sampled token advances the matcher. A grammar that can go
no further ends the row with "stop". Grammars compile once per (tokenizer, grammar) and are
cached; each request gets a copy of the compiled matcher.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.grammar import check_grammar, grammar_text

_CACHE_SIZE = 64
_lock = threading.Lock()
_tokenizers: dict[int, Any] = {}  # id(Tokenizer) -> (Tokenizer, LLTokenizer)
_compiled: OrderedDict[tuple[int, str], Any] = OrderedDict()  # (tokenizer, grammar) -> a fresh LLMatcher


def _ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    import llguidance

    with _lock:
        held = _tokenizers.get(id(tokenizer))
        if held is None or held[0] is not tokenizer:
            ll = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                        eos_token=sorted(tokenizer.eos_token_ids) or None)
            held = _tokenizers[id(tokenizer)] = (tokenizer, ll)
        return held[1]


class RowGrammar:
    """One request's matcher: its mask over the vocabulary and its progress through the grammar."""

    def __init__(self, matcher: Any, vocab_size: int, eos_ids: list[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids

    @classmethod
    def create(cls, tokenizer: Any, vocab_size: int, grammar: dict[str, Any]) -> RowGrammar:
        """A matcher for `grammar`, compiled once per tokenizer and grammar (cached, copied per request)."""
        import llguidance

        ll = _ll_tokenizer(tokenizer, vocab_size)
        key = (id(tokenizer), json.dumps(grammar, sort_keys=True))
        with _lock:
            template = _compiled.get(key)
            if template is not None:
                _compiled.move_to_end(key)
        if template is None:
            # checked as the leader checks it (a request from the Celery task or Leader.submit may
            # not have been); strict (core/grammar.py): an approximation refused too
            problem = check_grammar(grammar)
            if problem:
                raise CeleryTPError(ErrorKind.BAD_REQUEST, f"field 'grammar': {problem}")
            try:
                template = llguidance.LLMatcher(ll, grammar_text(grammar), log_level=0)
            except (ValueError, TypeError) as exc:  # refused alone: the loop goes on with the other rows
                raise CeleryTPError(ErrorKind.BAD_REQUEST, f"field 'grammar': {exc}") from None
            if template.is_error():
                raise CeleryTPError(ErrorKind.BAD_REQUEST, f"field 'grammar': {template.get_error()}")
            with _lock:
                _compiled[key] = template
                while len(_compiled) > _CACHE_SIZE:
                    _compiled.popitem(last=False)
        return cls(template.deep_copy(), vocab_size, sorted(tokenizer.eos_token_ids))

    def allowed(self) -> torch.Tensor:
        """(V,) bool: the tokens the grammar allows next (EOS alone when it allows none)."""
        # one bit per token, little-endian 32-bit words: numpy unpacks it in microseconds (a torch
        # shift-and-mask over (V/32, 32) cost ~0.3 ms, and far more with its threads contended)
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: self.vocab_size].astype(bool))
        if not bool(allowed.any()):
            allowed[self.eos_ids] = True
        return allowed

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits (V,) of every token the grammar forbids to -inf, in place."""
        forbidden = ~self.allowed()[: logits.shape[-1]]
        if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and logits.is_contiguous():
            logits.numpy()[forbidden.numpy()] = -np.inf  # numpy: no torch worker threads to wake for 49k floats
        else:
            logits.masked_fill_(forbidden.to(logits.device), float("-inf"))

    def advance(self, tokens: list[int]) -> bool:
        """Feed sampled (or resumed) tokens; True when the grammar is finished (the row stops)."""
        for token in tokens:
            if not self.matcher.consume_token(token):
                return True  # a token it refused (an earlier attempt's): nothing more can match
        return self.matcher.is_stopped()
