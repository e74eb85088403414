"""A model loaded on this rank: its shard and the state step mode keeps between steps."""

from __future__ import annotations

import ctypes
import gc
from dataclasses import dataclass, field

import torch

from celerytp.models import CausalLM


@dataclass
class LoadedModel:
    """A model shard and what its sequence needs between steps."""

    model: CausalLM
    path: str
    history: list[int] = field(default_factory=list)  # tokens in the KV cache (repetition penalty)
    generator: torch.Generator | None = None
    generator_seed: int | None = None

    def reset_sequence(self) -> None:
        """Forget step mode's sequence (the cache rows are about to be reused)."""
        self.model.clear_cache()
        self.history.clear()
        self.generator, self.generator_seed = None, None


def release_memory() -> None:
    """Return freed heap to the OS, so an unload shows in the RSS."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass
