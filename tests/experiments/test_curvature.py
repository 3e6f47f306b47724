"""What experiments/curvature's scripts tell the user: their --help and
the overhead's progress lines."""
import argparse

import numpy
import pytest

from experiments.curvature import overhead
from tests.benchmarks.help_text import assert_whole_first_paragraph
from tests.benchmarks.help_text import help_text

MODULES = ('experiments.curvature.optimisation',
           'experiments.curvature.overhead')


@pytest.mark.parametrize('module', MODULES)
def test_help_gives_the_whole_first_paragraph(module, capsys):
    assert_whole_first_paragraph(module, help_text(module, capsys))


def test_overhead_labels_its_warm_up_round(capsys):
    """One repetition prints an untimed warm-up and round 1/1, not a
    'round 0/1'."""
    args = argparse.Namespace(batch=2, repetitions=1, exact_repetitions=1)
    _, times = overhead.measure('3c3d', args, numpy, lambda: None)
    lines = capsys.readouterr().out.splitlines()
    quantities = overhead.CHEAP + overhead.EXACT
    assert not any('round 0/' in line for line in lines)
    assert [line.split()[1] for line in lines] == \
        ['warm-up:'] * len(quantities) + ['round'] * len(quantities)
    assert all(len(v) == 1 for v in times['cpu'].values())
