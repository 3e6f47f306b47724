"""The library's logger, ``logging.getLogger('chainerkfac')``.

The registration table and the assignment are INFO messages that users
expect to see without configuring anything, as kfac-jax shows its table.
:func:`ensure_visible` gives the ``chainerkfac`` logger a plain handler on
stdout when the application has configured no logging at all; an
application that configures logging (a handler on the root logger or on
``chainerkfac``) decides itself, and ``verbose=False`` logs nothing.
"""
import logging
import sys

logger = logging.getLogger('chainerkfac')


class _PlainHandler(logging.StreamHandler):
    """The handler :func:`ensure_visible` installs: writes to whatever
    ``sys.stdout`` is at the time of the message."""

    stream = property(lambda self: sys.stdout, lambda self, value: None)


def ensure_visible() -> None:
    """Show the library's INFO messages on stdout unless logging is
    configured (idempotent)."""
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = _PlainHandler()
    handler.setFormatter(logging.Formatter('%(message)s'))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
