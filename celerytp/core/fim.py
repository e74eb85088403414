"""Fill-in-the-middle prompts: a completion's `prompt` and `suffix` in the form the model was trained on.

A code model trained for infilling has three special tokens around the prefix, the suffix and the
middle it writes. The form is found from the tokenizer's vocabulary; each token must encode as its
one special id (not as text pieces), or the model would read the markers as ordinary text.

CodeLlama (`▁<PRE>`, `▁<SUF>`, `▁<MID>`) is left out: Meta's format encodes the prefix and suffix
without sentencepiece's leading space and puts a space before each marker, which a rendered text
reproduces only with some sentencepiece settings; its token ids would have to be assembled directly.
"""

from __future__ import annotations

from dataclasses import dataclass

from celerytp.core.tokenizer import Tokenizer


@dataclass(frozen=True)
class FimForm:
    """One family's fill-in-the-middle tokens, in prefix-suffix-middle (PSM) order.

    Args:
        name: the family, for messages.
        prefix, suffix, middle: the special tokens that open the prefix, the suffix and the middle.
    """

    name: str
    prefix: str
    suffix: str
    middle: str

    def prompt(self, prefix: str, suffix: str) -> str:
        """The text whose completion is the middle between `prefix` and `suffix`."""
        return f"{self.prefix}{prefix}{self.suffix}{suffix}{self.middle}"

    @property
    def tokens(self) -> tuple[str, str, str]:
        return self.prefix, self.suffix, self.middle


FORMS = (
    FimForm("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2, SantaCoder
    FimForm("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
)


def fim_form(tokenizer: Tokenizer) -> FimForm | None:
    """The model's fill-in-the-middle form, or None when its vocabulary has none of FORMS whole."""
    for form in FORMS:
        if all(_whole(tokenizer, token) for token in form.tokens):
            return form
    return None


def _whole(tokenizer: Tokenizer, token: str) -> bool:
    """`token` is in the vocabulary and a text holding it encodes it as that one id."""
    token_id = tokenizer.backend.token_to_id(token)
    return token_id is not None and tokenizer.encode_rendered(token) == [token_id]
