"""The leader client: drives rank workers through chords; imports no torch."""

from celerytp.client.generation import GenerationResult, TokenStream
from celerytp.client.leader import Leader

__all__ = ["GenerationResult", "Leader", "TokenStream"]
