"""Secrets out of messages: a URL's password is shown as *** wherever a URL is printed or logged."""

from __future__ import annotations

import logging
import re

# scheme://[user]:password@host -> scheme://[user]:***@host, where the scheme is an ASCII letter
# then letters, digits, "+", "." or "-" (RFC 3986), the user has no ":", "/", "@" or whitespace,
# and the password runs to its "@" (no whitespace in it). As one regex, this took quadratic time
# on long runs of letters, and on "a://:a://:..." (every start re-scanned the rest), and messages
# echo what callers send; the scan below reads each character a bounded number of times.
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_SCHEME_CHARS = _LETTERS + "0123456789+.-"
_SCHEME_NON_LETTERS = "0123456789+.-"
_USER_END = re.compile(r"[:/@\s]")
_PASSWORD_END = re.compile(r"[@\s]")


def mask_secrets(text: str) -> str:
    """`text` with the password of every URL in it replaced by ***, in time linear in its length."""
    at = text.find("://")
    if at < 0:
        return text
    out: list[str] = []
    done = 0  # text[:done] is in `out`
    previous = -1  # the last "://" looked at: a scheme never reaches back past it (":" is no scheme character)
    stop = -1  # the first "@" or whitespace at or after the last password's start (read once per stretch)
    while at >= 0:
        before = text[max(done, previous + 1):at]  # disjoint slices: linear in all
        scheme = before[len(before.rstrip(_SCHEME_CHARS)):]
        if scheme.lstrip(_SCHEME_NON_LETTERS):  # a letter starts it (the scheme is from its first letter)
            user_end = _USER_END.search(text, at + 3)  # stops at the next ":" at the latest: disjoint too
            if user_end is not None and text[user_end.start()] == ":":
                password = user_end.start() + 1
                if stop < password:
                    found = _PASSWORD_END.search(text, password)
                    stop = found.start() if found else len(text)
                if stop > password and stop < len(text) and text[stop] == "@":
                    out += [text[done:password], "***"]
                    done = stop
                    previous = at
                    at = text.find("://", stop)
                    continue
        previous = at
        at = text.find("://", at + 1)
    out.append(text[done:])
    return "".join(out)


def clipped(value: object, limit: int = 64) -> str:
    """What a message may show of a value a caller sent: its first `limit` characters, then "…"
    (a 1 MB model name is not echoed back, nor masked, nor logged whole), surrogates escaped so
    that the message encodes as UTF-8."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = text[:limit] + "…"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class MaskSecrets(logging.Filter):
    """A logging filter that masks URL passwords in every record it passes (Celery's and ours)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask_secrets(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True


def mask_logged_secrets() -> None:
    """Mask URL passwords on every handler of the root logger."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, MaskSecrets) for f in handler.filters):
            handler.addFilter(MaskSecrets())
