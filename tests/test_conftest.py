"""tests/conftest.py: the guard that the suite leaves the checkout as it
found it."""
from tests import conftest


def test_the_checkout_guard_names_what_a_run_left():
    """tests/conftest.py fails a session that leaves files in the top
    folder (a Trainer without out= writes result/log there); caches and
    virtualenvs may appear."""
    before = ['README.md', 'tests']
    assert conftest.left_in_checkout(
        before, before + ['result', '__pycache__', '.pytest_cache']) == \
        ['result']
    assert conftest.left_in_checkout(before, before + ['.cache']) == []


def test_reports_the_command_line_asks_for_are_not_litter():
    before = ['README.md']
    after = before + ['report.xml', '.coverage', '.coverage.host.1', 'log']
    assert conftest.left_in_checkout(
        before, after, ['-q', '--junitxml=report.xml', 'tests']) == ['log']
