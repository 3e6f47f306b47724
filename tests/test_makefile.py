"""Which Python the Makefile builds its virtualenvs with: the first that
really is 3.11 (3.12 for the NumPy-2 leg) on PATH, then pyenv's; where
there is none, `make test` stops before it creates anything and says how
to name one. Run with a PATH and pyenv of the test's own making (fake
interpreters that only answer the version check), with `make -n`."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAKE = shutil.which('make')
pytestmark = [pytest.mark.skipif(MAKE is None, reason='no make on PATH'),
              pytest.mark.usefixtures('exec_tmp_path')]   # fakes run there


def fake_python(path, is_the_version=True):
    """An executable that passes (or fails) the Makefile's version check;
    it runs nothing else (the tests only use `make -n`)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
        f.write('#!/bin/sh\nexit {}\n'.format(0 if is_the_version else 1))
    os.chmod(path, 0o755)
    return path


def make(tmp_path, *args):
    if ' ' in str(tmp_path):
        pytest.skip("make cannot take VENV={} (a path with a space)".format(
            tmp_path / 'venv'))
    env = {'PATH': str(tmp_path / 'bin'), 'HOME': str(tmp_path / 'home'),
           'PYENV_ROOT': str(tmp_path / 'pyenv')}
    (tmp_path / 'bin').mkdir(exist_ok=True)
    return subprocess.run(
        [MAKE, '-C', ROOT, '--no-print-directory'] + list(args) +
        ['VENV=' + str(tmp_path / 'venv'),
         'VENV_NP2=' + str(tmp_path / 'venv-np2')],
        env=env, capture_output=True, text=True, timeout=60)


def test_python_on_path_first(tmp_path):
    on_path = fake_python(str(tmp_path / 'bin' / 'python3.11'))
    fake_python(str(tmp_path / 'pyenv/versions/3.11.9/bin/python3.11'))
    done = make(tmp_path, '-n', 'venv')
    assert done.returncode == 0, done.stderr
    assert '{} -m venv {}'.format(on_path, tmp_path / 'venv') in done.stdout


def test_pyenvs_version_where_path_has_none_that_is_it(tmp_path):
    """A python3.11 on PATH that is not 3.11 (a pyenv shim of an unselected
    version fails the same way) is passed over for pyenv's 3.11."""
    fake_python(str(tmp_path / 'bin' / 'python3.11'), is_the_version=False)
    pyenv = fake_python(str(tmp_path / 'pyenv/versions/3.11.9/bin/'
                                       'python3.11'))
    done = make(tmp_path, '-n', 'venv')
    assert done.returncode == 0, done.stderr
    assert '{} -m venv'.format(pyenv) in done.stdout


def test_numpy2_leg_finds_312_the_same_way(tmp_path):
    fake_python(str(tmp_path / 'bin' / 'python3.11'))
    pyenv = fake_python(str(tmp_path / 'pyenv/versions/3.12.4/bin/'
                                       'python3.12'))
    done = make(tmp_path, '-n', 'venv-np2')
    assert done.returncode == 0, done.stderr
    assert "py='{}'".format(pyenv) in done.stdout


def test_no_python_311_stops_before_anything_is_made(tmp_path):
    fake_python(str(tmp_path / 'bin' / 'python3.11'), is_the_version=False)
    fake_python(str(tmp_path / 'pyenv/versions/3.12.4/bin/python3.12'))
    done = make(tmp_path, 'test')
    assert done.returncode != 0
    assert 'no Python 3.11 found' in done.stderr
    assert 'make test PYTHON=/path/to/python3.11' in done.stderr
    assert not (tmp_path / 'venv').exists()


def test_a_python_named_that_does_not_run_is_said(tmp_path):
    """``make test PYTHON=/nonexistent`` gave the shell's ``make:
    /nonexistent: No such file or directory`` / ``Error 127``."""
    missing = str(tmp_path / 'nowhere' / 'python3.11')
    done = make(tmp_path, 'test', 'PYTHON=' + missing)
    assert done.returncode != 0
    assert 'make: PYTHON={} does not run'.format(missing) in done.stderr
    assert 'make test PYTHON=/path/to/python3.11' in done.stderr
    assert not (tmp_path / 'venv').exists()
