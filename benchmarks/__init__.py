"""The benchmarks (``python -m benchmarks.<name>``; docs/benchmarks.md).

Their tables name κ, ν, µs and ±. Where standard output cannot encode
them (a Latin-1 or ASCII locale: ``LANG=en_US`` on an older cluster), they
are printed escaped (``\\u03ba``) instead of ending a finished run with a
``UnicodeEncodeError``; the experiments, which import these modules, too.
"""
import sys

_SYMBOLS = 'κν±µ×≤²−'


def _escape_what_stdout_cannot_encode(stream=None) -> None:
    stream = sys.stdout if stream is None else stream
    try:
        _SYMBOLS.encode(getattr(stream, 'encoding', None) or 'ascii')
    except (UnicodeEncodeError, LookupError):
        reconfigure = getattr(stream, 'reconfigure', None)
        if reconfigure is not None:
            reconfigure(errors='backslashreplace')


_escape_what_stdout_cannot_encode()
