"""Where a multimodal checkpoint keeps its language model's tensors.

transformers' save_pretrained (and the hub's files) store the text model of a
...ForConditionalGeneration as `language_model.model.*` with `language_model.lm_head.weight`; its
module names, which some files use, are `model.language_model.*` and `lm_head.weight`. A model
built with weight_prefix `model.language_model.` reads whichever its checkpoint has.
"""

from __future__ import annotations

from typing import Any

from celerytp.loading.checkpoint import Checkpoint
from celerytp.models.base import CausalLM, Progress

SAVED_PREFIX, SAVED_LM_HEAD = "language_model.model.", "language_model.lm_head.weight"


class LanguageModelLayout(CausalLM):
    """A CausalLM whose text model may sit in a multimodal checkpoint's saved layout."""

    _saved_layout = False  # set by load_weights when the checkpoint uses SAVED_PREFIX

    def checkpoint_table(self) -> dict[str, Any]:
        table = super().checkpoint_table()
        if not self._saved_layout:
            return table
        prefix = self.config.weight_prefix
        return {_saved_name(name, prefix): entry for name, entry in table.items()}

    def is_ignorable(self, name: str) -> bool:
        return (name == SAVED_LM_HEAD and self.config.tie_word_embeddings) or super().is_ignorable(name)

    def load_weights(self, checkpoint: Checkpoint, progress: Progress | None = None) -> set[str]:
        names = checkpoint.names()
        self._saved_layout = self.config.weight_prefix != "model." and any(n.startswith(SAVED_PREFIX) for n in names)
        return super().load_weights(checkpoint, progress)


def _saved_name(name: str, prefix: str) -> str:
    if name.startswith(prefix):
        return SAVED_PREFIX + name[len(prefix) :]
    return SAVED_LM_HEAD if name == "lm_head.weight" else name
