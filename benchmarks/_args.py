"""Option types of the benchmarks' and experiments' command lines.

Each refuses a bad value in argparse's words (``error: argument --jobs:
expected an integer >= 1, got '0'``, exit 2) before any work is done. Bad
values used to hang a run (``--jobs 0``), run something other than what
was asked without a word (``--epochs 0`` took the default, an unknown
optimizer name ran Adam, ``mpiexec -n 0`` started one process per core),
or end in a traceback after minutes of measurement (an ``--out`` under a
regular file).
"""
import argparse
import json
import math
import os
from typing import Callable, List, Sequence


def _integer(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        value = None
    if value is None or value < minimum:
        raise argparse.ArgumentTypeError(
            'expected an integer >= {}, got {!r}'.format(minimum, text))
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _integer(text, 1)


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    return _integer(text, 0)


def at_least(minimum: int) -> Callable[[str], int]:
    """An integer >= ``minimum``."""
    def parse(text: str) -> int:
        return _integer(text, minimum)
    parse.__name__ = 'integer >= {}'.format(minimum)
    return parse


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            'expected a finite number > 0, got {!r}'.format(text))
    return value


def fraction(text: str) -> float:
    """A number in (0, 1]: a target accuracy."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(
            'expected a fraction in (0, 1], got {!r}'.format(text))
    return value


def _comma_list(text: str, item: Callable[[str], object],
                what: str) -> list:
    """``text`` split at commas, each part parsed by ``item``; at least
    one, else an error saying ``expected comma-separated <what>``."""
    try:
        values = [item(v.strip()) for v in text.split(',')]
    except (argparse.ArgumentTypeError, ValueError):
        values = []
    if not values:
        raise argparse.ArgumentTypeError(
            'expected comma-separated {}, got {!r}'.format(what, text))
    return values


def int_list(minimum: int = 1) -> Callable[[str], List[int]]:
    """Comma-separated integers, each >= ``minimum``, at least one."""
    def parse(text: str) -> List[int]:
        return _comma_list(text, lambda v: _integer(v, minimum),
                           'integers >= {}'.format(minimum))
    parse.__name__ = 'list of integers'
    return parse


def float_list(text: str) -> List[float]:
    """Comma-separated finite numbers > 0, at least one."""
    return _comma_list(text, positive_float, 'numbers > 0')


def names(choices: Sequence[str]) -> Callable[[str], List[str]]:
    """Comma-separated names among ``choices``, at least one, in the order
    given, without repeats."""
    def parse(text: str) -> List[str]:
        given = [n.strip() for n in text.split(',') if n.strip()]
        unknown = [n for n in given if n not in choices]
        if unknown or not given:
            raise argparse.ArgumentTypeError(
                '{}choose from {} (got {!r})'.format(
                    'unknown {}: '.format(', '.join(unknown))
                    if unknown else '', ', '.join(choices), text))
        return list(dict.fromkeys(given))
    parse.__name__ = 'list of names'
    return parse


def _accuracy(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise ValueError(text)
    return value


def accuracy_list(text: str) -> List[float]:
    """Comma-separated accuracies (numbers in [0, 1]), at least one."""
    return _comma_list(text, _accuracy, 'accuracies in [0, 1]')


def or_empty(parse: Callable[[str], list]) -> Callable[[str], list]:
    """``parse``, with ``''`` the empty list: an option whose empty value
    skips a part (``--agreement-sizes ''``)."""
    def either(text: str) -> list:
        return [] if not text.strip() else parse(text)
    either.__name__ = getattr(parse, '__name__', 'list')
    return either


def read_json(path: str):
    """The JSON in the file ``path`` (an earlier run's result), or
    :class:`argparse.ArgumentTypeError` saying why not."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as error:
        raise argparse.ArgumentTypeError('cannot read {}: {}'.format(
            path, error.strerror or error))
    except ValueError as error:
        raise argparse.ArgumentTypeError('{} is not JSON: {}'.format(
            path, error))


def json_file(text: str) -> str:
    """The path of a readable file holding JSON; returned as given."""
    read_json(text)
    return text


def folder_problem(folder: str) -> str:
    """Why files cannot be written in ``folder`` or in folders made under
    it, or ``''``: the nearest part of it that exists must be a writable
    folder (a file, or a link to nothing, on the way is not)."""
    folder = os.path.abspath(folder)
    while not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    if os.path.islink(folder) and not os.path.exists(folder):
        return '{} is a link to nothing'.format(folder)
    if not os.path.isdir(folder):
        return '{} is a file, not a folder'.format(folder)
    if not os.access(folder, os.W_OK | os.X_OK):
        return 'the folder {} is not writable'.format(folder)
    return ''


def output_problem(path: str) -> str:
    """Why a file cannot be written at ``path`` (an existing directory,
    a file or a dangling link on the way, a folder that is not writable),
    or ``''``."""
    if os.path.isdir(path):
        return '{} is a directory'.format(path)
    return folder_problem(os.path.dirname(os.path.abspath(path)))


def check_paths(parser: argparse.ArgumentParser, args: argparse.Namespace,
                files: Sequence[str] = ('out',),
                folders: Sequence[str] = ()) -> None:
    """``parser.error`` (exit 2) naming the option where one of the
    output files ``files`` or folders ``folders`` (attribute names of
    ``args``; unset ones are skipped) could not be written: before the
    measurement, not after it."""
    for names_, check in ((files, output_problem),
                          (folders, folder_problem)):
        for name in names_:
            path = getattr(args, name, None)
            if not path:
                continue
            problem = check(path)
            if problem:
                parser.error('--{} {}: {}'.format(
                    name.replace('_', '-'), path, problem))


def _pair(text: str) -> tuple:
    pair = tuple(positive_int(v) for v in text.split(':'))
    if len(pair) != 2:
        raise ValueError(text)
    return pair


def int_pairs(text: str) -> List[tuple]:
    """Comma-separated ``a:b`` pairs of integers >= 1 (layers:cores)."""
    return _comma_list(text, _pair, 'pairs a:b of integers >= 1')
