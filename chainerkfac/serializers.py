"""Loading ``.npz`` files without pickle.

Chainer's ``load_npz`` opens files with ``numpy.load(allow_pickle=True)``:
an object array in the file is unpickled when its key is read, and
unpickling runs whatever code the file names. Weights and snapshots are
passed between users and kept on shared file systems, so here a file is
opened with ``allow_pickle=False``, after its members' ``.npy`` headers
(read without loading any data) have been checked: an object array is
refused, naming the file and the key, before anything of the file is
loaded. Everything else is Chainer's own ``NpzDeserializer``::

    chainerkfac.serializers.load_npz('optimizer_rank0.npz', optimizer)

in place of ``chainer.serializers.load_npz``. Files written by Chainer's
``save_npz`` hold object arrays only for values that were ``None`` (a
pickled ``None``); saving ``None`` as an absent key (see
:func:`without_none`) keeps them loadable here.
"""
import os
import zipfile

import numpy
from chainer.serializers import npz


class PickledArrayError(ValueError):
    """An ``.npz`` member that only pickle can load (an object array).

    Attributes
    ----------
    path : str
        The file.
    key : str
        The member's key (without ``.npy``).
    """

    def __init__(self, path, key):
        self.path = path
        self.key = key
        super().__init__(
            '{}: key {!r} holds an object array, which only pickle can load '
            '(and unpickling runs code the file names): refused, nothing of '
            'the file was loaded'.format(path, key))

    def __reduce__(self):
        # Sent between processes (the message alone would not rebuild it).
        return PickledArrayError, (self.path, self.key)


def member_header(member):
    """``(shape, fortran_order, dtype)`` of an open ``.npy`` member, read
    from its header (no array data, nothing unpickled)."""
    version = numpy.lib.format.read_magic(member)
    if version == (1, 0):
        return numpy.lib.format.read_array_header_1_0(member)
    return numpy.lib.format.read_array_header_2_0(member)


def _key(info):
    name = info.filename
    return name[:-4] if name.endswith('.npy') else name


def check_no_pickle(file):
    """Refuse an ``.npz`` file that holds an object array.

    Parameters
    ----------
    file : str, os.PathLike or binary file object
        A file object is read from its current position and left there.

    Raises
    ------
    PickledArrayError
        Naming the file and the first such key.
    """
    position = None if _is_path(file) else file.tell()
    try:
        with zipfile.ZipFile(file) as archive:
            for info in archive.infolist():
                with archive.open(info) as member:
                    if member_header(member)[2].hasobject:
                        raise PickledArrayError(_name(file), _key(info))
    finally:
        if position is not None:
            file.seek(position)


def open_npz(file):
    """``numpy.load(file, allow_pickle=False)`` of an ``.npz`` file, once
    :func:`check_no_pickle` has passed it."""
    check_no_pickle(file)
    return numpy.load(file, allow_pickle=False)


def load_npz(file, obj, path='', strict=True, ignore_names=None):
    """``chainer.serializers.load_npz`` without pickle: the same arguments
    and behaviour, except that a file with an object array is refused
    (:class:`PickledArrayError`) before anything is loaded.

    Parameters
    ----------
    file : str, os.PathLike or binary file object
    obj
        What to load into (a link, an optimizer, a trainer, ...).
    path, strict, ignore_names
        As for ``chainer.serializers.load_npz``.
    """
    with open_npz(file) as data:
        npz.NpzDeserializer(data, path=path, strict=strict,
                            ignore_names=ignore_names).load(obj)


def loaded(deserializer, key):
    """``key``'s value in a file being loaded, or None where the file has
    none (an earlier version's): Chainer's strict loader raises
    ``KeyError`` for a missing key, ``strict=False`` gives back the
    default (None here)."""
    try:
        return deserializer(key, None)
    except KeyError:
        return None


def without_none(target):
    """``{key: value}`` of Chainer's ``DictionarySerializer`` without the
    values that were ``None`` (saved as a pickled 0-d object array): a key
    absent from a file leaves the loaded object's value as it is under
    ``strict=False``, as ``None`` does."""
    return {key: value for key, value in target.items()
            if not (isinstance(value, numpy.ndarray) and
                    value.dtype == object and value.shape == () and
                    value[()] is None)}


def _is_path(file):
    return isinstance(file, (str, bytes, os.PathLike))


def _name(file):
    if _is_path(file):
        return os.fsdecode(file)
    return getattr(file, 'name', repr(file))
