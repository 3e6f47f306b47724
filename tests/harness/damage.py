"""Damage a file the way a killed writer or a failing disk does, or an
attacker (the resume tests of the harness and of the training script)."""
import os

import numpy


def truncate(path):
    """Cut the file to two thirds (a writer killed mid-file)."""
    size = os.path.getsize(path)
    with open(path, 'r+b') as f:
        f.truncate(size * 2 // 3)


def flip(path, n=64):
    """Flip ``n`` bytes in the middle of the file (inside an array: a
    failing disk)."""
    size = os.path.getsize(path)
    with open(path, 'r+b') as f:
        f.seek(size // 2)
        data = bytearray(f.read(n))
        f.seek(size // 2)
        f.write(bytes(b ^ 0xff for b in data))


class _Opens:
    """Unpickled, it opens (creates) ``path``: an attacker's payload."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, 'w')


def pickled(path, key, marker):
    """Replace the array ``key`` of the ``.npz`` file ``path`` by an object
    array whose unpickling creates the file ``marker`` (the array an
    attacker puts in weights or a snapshot)."""
    with numpy.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    assert key in arrays, (key, sorted(arrays)[:5])
    payload = numpy.empty((), dtype=object)
    payload[()] = _Opens(str(marker))
    arrays[key] = payload
    with open(path, 'wb') as f:
        numpy.savez(f, **arrays)
