"""Damage a file the way a killed writer or a failing disk does (the
resume tests of the harness and of the training script)."""
import os


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
