"""Secrets out of messages: a URL's password is shown as *** wherever a URL is printed or logged."""

from __future__ import annotations

import logging
import re

# scheme://[user]:password@host -> scheme://[user]:***@host
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*:)(?P<secret>[^@\s]+)(?=@)")


def mask_secrets(text: str) -> str:
    """`text` with the password of every URL in it replaced by ***."""
    return _URL_PASSWORD.sub(r"\g<head>***", text)


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
