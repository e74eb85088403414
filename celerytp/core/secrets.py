"""Secrets out of messages: a URL's password is shown as *** wherever a URL is printed or logged."""

from __future__ import annotations

import re

# scheme://[user]:password@host -> scheme://[user]:***@host
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*:)(?P<secret>[^@\s]+)(?=@)")


def mask_secrets(text: str) -> str:
    """`text` with the password of every URL in it replaced by ***."""
    return _URL_PASSWORD.sub(r"\g<head>***", text)
