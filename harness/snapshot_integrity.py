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


def _check_array(path, member):
    """Read one ``.npy`` member to its end (``ZipExtFile`` checks the CRC
    there) and check its length against its header; refuse an object
    array before reading its data."""
    shape, _, dtype = member_header(member)
    if dtype.hasobject:
        name = member.name
        raise PickledArrayError(path, name[:-4] if name.endswith('.npy')
                                else name)
    size = 0
    while True:
        chunk = member.read(_CHUNK)
        if not chunk:
            break
        size += len(chunk)
    expected = int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize
    if size != expected:
        raise ValueError('member {} holds {} bytes, its header says {} '
                         '({} {})'.format(member.name, size, expected, shape,
                                          dtype))


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
