"""Read a module's ``--help`` the way a user sees it."""
import importlib
import os
from unittest import mock

import pytest


def help_text(module_name: str, capsys) -> str:
    """What ``python -m MODULE --help`` prints (through its ``main``, or
    ``parse_args`` where the module has one)."""
    module = importlib.import_module(module_name)
    entry = getattr(module, 'parse_args', None) or module.main
    # argparse wraps at the terminal's width: a wide one, so that a narrow
    # terminal does not break a default in two.
    with mock.patch.dict(os.environ, COLUMNS='200'), \
            pytest.raises(SystemExit) as exit_:
        entry(['--help'])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def first_paragraph(module_name: str) -> str:
    return importlib.import_module(module_name).__doc__.split('\n\n')[0]


def assert_whole_first_paragraph(module_name: str, text: str) -> None:
    """The help ``text`` of ``python -m MODULE``: its usage names that
    command, and its description is the module docstring's whole first
    paragraph, ending a sentence (not its first line)."""
    assert text.splitlines()[0].startswith('usage: python -m ' + module_name)
    description = text.split('\n\n')[1]
    assert description == first_paragraph(module_name).strip()
    assert description.rstrip()[-1] in '.:)'


def option_helps(text: str) -> dict:
    """``{'--out': 'JSON output (default: ...)', ...}``: each option's help
    on one line."""
    options = text.split('\n\n', 2)[2]
    helps, name = {}, None
    for line in options.splitlines()[1:]:
        if line.startswith('  -'):
            words = line.split()
            name = words[0].rstrip(',')
            # the help starts after the metavar, two spaces on
            rest = line.strip().split('  ', 1)
            helps[name] = rest[1].strip() if len(rest) > 1 else ''
        elif name is not None:
            helps[name] = (helps[name] + ' ' + line.strip()).strip()
    return helps
