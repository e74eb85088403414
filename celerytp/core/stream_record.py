"""One entry of a request's Redis Stream, typed: a token, the final result, or an error.

Rank 0 writes these (worker/serving) and leaders read them (client/requests); both ends go
through this model so the wire format lives in one place. On the wire an entry is `t` (token id)
with `i` (its index in the completion) and, when the request asked for logprobs, `l` (JSON
[logprob, [[id, logprob], ...]]), or `done` (RowResult JSON) or `error` ({kind, message} JSON).
The index lets a reader drop a token that a resumed request's earlier holder also wrote.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.protocol import RowResult


class StreamRecord(BaseModel):
    token: int | None = None
    index: int = 0  # the token's position in the completion
    logprob: tuple[float, list[tuple[int, float]]] | None = None  # the token's, and the top ones, when asked for
    done: RowResult | None = None
    error: tuple[ErrorKind, str] | None = None  # (kind, message)

    @classmethod
    def of_token(cls, token: int, index: int, logprob: tuple[float, list] | None = None) -> StreamRecord:
        return cls(token=token, index=index, logprob=logprob)

    @classmethod
    def of_result(cls, result: RowResult) -> StreamRecord:
        return cls(done=result)

    @classmethod
    def of_error(cls, error: CeleryTPError) -> StreamRecord:
        return cls(error=(error.kind, error.message))

    def to_fields(self) -> dict[str, str | int]:
        """The Redis Stream fields of this record (XADD's mapping)."""
        if self.token is not None:
            fields: dict[str, str | int] = {"t": self.token, "i": self.index}
            if self.logprob is not None:
                fields["l"] = json.dumps(self.logprob)
            return fields
        if self.done is not None:
            return {"done": self.done.model_dump_json()}
        if self.error is not None:
            return {"error": json.dumps({"kind": str(self.error[0]), "message": self.error[1]})}
        raise ValueError("an empty stream record")

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> StreamRecord:
        """Parse one XREAD entry's fields; CeleryTPError(internal) for anything else."""
        try:
            if b"t" in fields:
                logprob = json.loads(fields[b"l"]) if b"l" in fields else None
                return cls(token=int(fields[b"t"]), index=int(fields[b"i"]), logprob=logprob)
            if b"done" in fields:
                return cls(done=RowResult.model_validate_json(fields[b"done"]))
            if b"error" in fields:
                error = json.loads(fields[b"error"])
                return cls(error=(ErrorKind(error["kind"]), str(error["message"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise CeleryTPError(ErrorKind.INTERNAL, f"malformed stream record {fields!r:.200}: {exc}") from None
        raise CeleryTPError(ErrorKind.INTERNAL, f"malformed stream record {fields!r:.200}")

    def raise_error(self) -> None:
        if self.error is not None:
            raise CeleryTPError(self.error[0], self.error[1], op="generate")
