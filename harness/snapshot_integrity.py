"""Whether a snapshot file can be loaded, read whole before it is trusted.

A file cut short (a full disk, a copy that stopped) or with flipped bytes
(a failing disk or transfer) must be named with the cause, not found by
``numpy.load`` halfway through a resume as a ``zipfile.BadZipFile`` that
names no file. :func:`verify_file` opens the ``.npz`` and reads every
member to its end: the zip directory, the CRC-32 of every member (what
``zipfile.ZipFile.testzip`` checks) and that every member is an array of
the size its header gives. A member that only pickle could load (an
object array) is refused there too, naming the file and the key
(:class:`chainerkfac.serializers.PickledArrayError`): nothing of a snapshot
is ever unpickled.
"""
import struct
import zipfile
import zlib

import numpy

from chainerkfac.serializers import PickledArrayError, member_header

#: Bytes read at a time when checking a file (the CRC is computed as the
#: member is read).
_CHUNK = 1 << 20
#: What reading a damaged zip / npy raises.
DAMAGE = (zipfile.BadZipFile, OSError, ValueError, EOFError, zlib.error,
          NotImplementedError, struct.error, OverflowError)


class DamagedSnapshotError(OSError):
    """A snapshot file that cannot be loaded.

    Attributes
    ----------
    path : str
    cause : str
        What is wrong, e.g. ``"Bad CRC-32 for file 'updater/...'"``.
    """

    def __init__(self, path, cause):
        self.path = path
        self.cause = cause
        super().__init__('snapshot file {} is damaged: {}'.format(path,
                                                                  cause))

    def __reduce__(self):
        # Sent between processes (the message alone would not rebuild it).
        return DamagedSnapshotError, (self.path, self.cause)


def verify_file(path):
    """Read the npz file ``path`` whole and check it.

    Raises
    ------
    DamagedSnapshotError
        No zip directory (truncated), a member whose CRC-32 does not match
        (flipped bytes), a member that is not an array of the size its
        header says, or the file cannot be read.
    PickledArrayError
        A member is an object array (found from its header, before its
        data is read).
    """
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                with archive.open(info) as member:
                    _check_array(path, member)
    except PickledArrayError:
        raise
    except DAMAGE as error:
        cause = str(error) or type(error).__name__
        if isinstance(error, zipfile.BadZipFile) and \
                'not a zip file' in cause:
            cause += ' (no zip directory: cut short?)'
        raise DamagedSnapshotError(path, cause) from error


#: Members whose floating-point values must be finite: the model's
#: weights and running statistics, the optimizer's state (momentum, K-FAC's
#: factors). The harness never writes a non-finite one there (a
#: non-finite step is skipped, leaving them as they were); one rank's
#: momentum of inf, loaded, gave that rank NaN weights, every later step
#: skipped, and the job an exit status of 0.
FINITE_PREFIXES = ('updater/model:main/', 'updater/optimizer:main/')


def _check_array(path, member):
    """Read one ``.npy`` member to its end (``ZipExtFile`` checks the CRC
    there) and check its length against its header; refuse an object
    array before reading its data, and a non-finite value in the model or
    the optimizer (:data:`FINITE_PREFIXES`)."""
    shape, _, dtype = member_header(member)
    name = member.name[:-4] if member.name.endswith('.npy') else member.name
    if dtype.hasobject:
        raise PickledArrayError(path, name)
    finite = dtype.kind == 'f' and name.startswith(FINITE_PREFIXES)
    size, data = 0, bytearray() if finite else None
    while True:
        chunk = member.read(_CHUNK)
        if not chunk:
            break
        size += len(chunk)
        if finite:
            data += chunk
    expected = int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize
    if size != expected:
        raise ValueError('member {} holds {} bytes, its header says {} '
                         '({} {})'.format(member.name, size, expected, shape,
                                          dtype))
    if finite:
        values = numpy.frombuffer(data, dtype)
        bad = int(values.size - numpy.count_nonzero(numpy.isfinite(values)))
        if bad:
            raise ValueError('{} holds {} non-finite values of {} (the '
                             'harness writes none there: altered, or damaged '
                             'before it was written)'.format(
                                 name, bad, values.size))


def verify_files(paths):
    """The :class:`DamagedSnapshotError` of each damaged file of ``paths``
    and the :class:`~chainerkfac.serializers.PickledArrayError` of each
    file with an object array (empty if all are whole and pickle-free)."""
    problems = []
    for path in paths:
        try:
            verify_file(path)
        except (DamagedSnapshotError, PickledArrayError) as error:
            problems.append(error)
    return problems
