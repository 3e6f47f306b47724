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
