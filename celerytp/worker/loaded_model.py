"""A model loaded on this rank: its shard and the state step mode keeps between steps."""

from __future__ import annotations

from dataclasses import dataclass, field

from celerytp.core.tokenizer import Tokenizer
from celerytp.models import CausalLM
from celerytp.worker.image_features import ImageFeatures
from celerytp.worker.sampling import RowSampler


@dataclass
class LoadedModel:
    """A model shard, its serving settings, and step mode's sequence (in its own cache row)."""

    model: CausalLM
    path: str
    record: dict = field(default_factory=dict)  # core.registry.model_record: reported by ping
    prefill_budget: int = 256  # prompt tokens per serving step
    idle_s: float = 1.0  # a serving loop with no work ends after this
    history: list[int] = field(default_factory=list)  # step mode's tokens in its row (repetition penalty)
    step_sampler: RowSampler | None = None  # rank 0: step mode's sampling state
    step_draws: int = 0  # rank 0: tokens step mode's sampler has drawn (seeds its slice draws)
    row_tokens: dict[int, list[int]] = field(default_factory=dict)  # served rows: tokens in each (prefix reuse)
    tokenizer: Tokenizer | None = None  # rank 0: read and checked at load (stop strings); None: ids only
    memory: dict[str, int] = field(default_factory=dict)  # bytes: "weights" and "kv_cache" (worker/memory.py)
    images: ImageFeatures | None = None  # a vision-language model's image encoder (every rank)
    source: list[list] = field(default_factory=list)  # its files when read (model_ops.source_stamp)

    def reset_sequence(self) -> None:
        """Forget step mode's sequence; the served rows are not touched."""
        self.model.clear_cache(self.model.step_row)
        self.history.clear()
        self.step_sampler = None

    def forget_all(self) -> None:
        """Empty every cache row: step mode's and the served ones (no prefix is reused after)."""
        self.model.clear_cache()
        self.reset_sequence()
        self.row_tokens.clear()

