"""Byte sizes as a user writes them on a command line: ``4096``, ``2KiB``,
``8MiB``, ``1GiB`` (whole numbers of bytes, KiB, MiB or GiB)."""
from typing import Optional

UNITS = {'': 1, 'B': 1, 'KIB': 1 << 10, 'MIB': 1 << 20, 'GIB': 1 << 30}


def parse(text: str) -> int:
    """``'8MiB'`` -> 8388608.

    Raises
    ------
    ValueError
        Naming the text, where it is not such a size.
    """
    item = text.strip()
    number = item.rstrip('BbIiKkMmGg')
    unit = item[len(number):].upper()
    if unit not in UNITS or not number.isdigit():
        raise ValueError('{!r}: a size is bytes, or a whole number of KiB, '
                         'MiB or GiB (e.g. 8MiB)'.format(text))
    return int(number) * UNITS[unit]


def words(nbytes: Optional[int]) -> str:
    """8388608 -> ``'8MiB'``; None -> ``'default'``."""
    if nbytes is None:
        return 'default'
    for unit in ('GiB', 'MiB', 'KiB'):
        size = UNITS[unit.upper()]
        if nbytes >= size and nbytes % size == 0:
            return '{}{}'.format(nbytes // size, unit)
    return '{}B'.format(nbytes)
