"""Log records from libraries that print whole URLs, redacted before any handler sees them.

httpx logs every request at INFO as ``HTTP Request: GET <url> ...``; an adapter reference may be a
presigned URL whose query string is a credential (``X-Amz-Signature``), and ``hotlora serve -v``
shows INFO. The filter rewrites such arguments with ``redact_url``: the request is still logged,
its signature is not.
"""

from __future__ import annotations

import logging

from hotlora.adapters.store.references import redact_url

URL_LOGGERS = ("httpx", "httpcore", "huggingface_hub", "botocore", "urllib3")


class RedactURLs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_redacted(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _redacted(v) for k, v in record.args.items()}
        if isinstance(record.msg, str) and "://" in record.msg and "?" in record.msg:
            record.msg = " ".join(_redacted(word) for word in record.msg.split(" "))
        return True


def _redacted(value):
    text = str(value) if type(value).__name__ == "URL" else value  # httpx.URL, without importing httpx
    if isinstance(text, str) and text.lower().startswith(("http://", "https://")) and ("?" in text or "@" in text):
        return redact_url(text)
    return value


def redact_url_logs() -> None:
    """Install the filter on the loggers of the libraries that fetch adapters (once per logger)."""
    for name in URL_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactURLs) for f in logger.filters):
            logger.addFilter(RedactURLs())
