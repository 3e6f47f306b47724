"""What experiments/layer_parallel's scripts tell the user: their --help,
Fig. 5's axis from the run's own arguments, and the V-cycles of a solve
that did not reach the drop in words."""
import pytest

from experiments.layer_parallel import convergence
from experiments.layer_parallel import scaling
from tests.benchmarks.help_text import assert_whole_first_paragraph
from tests.benchmarks.help_text import help_text

MODULES = ('experiments.layer_parallel.convergence',
           'experiments.layer_parallel.kfac_training',
           'experiments.layer_parallel.scaling',
           'experiments.layer_parallel.training')


@pytest.mark.parametrize('module', MODULES)
def test_help_gives_the_whole_first_paragraph(module, capsys):
    assert_whole_first_paragraph(module, help_text(module, capsys))


def _fig5_labels(monkeypatch, tmp_path, layers_per_process, at_scale):
    """The x-axis label and legend of Fig. 5 drawn from two tiny fake
    launches (P = 1, 2)."""
    from matplotlib.figure import Figure
    drawn = []
    monkeypatch.setattr(Figure, 'savefig',
                        lambda figure, *_, **__: drawn.append(figure))
    n1, n2 = layers_per_process, 2 * layers_per_process
    serial = {str(n): 0.01 * n for n in (n1, n2)}
    launches = {p: {'cases': {'peaks': {
        'serial': serial, 'kernels_serial': serial, 'layers': p * n1,
        'time': 0.01 * p}}} for p in (1, 2)}
    checks = [{'case': 'peaks', 'layers': n, 'model_in_situ': 0.01}
              for n in (n1, n2)]
    predicted = [{'case': 'peaks', 'layers': n, 'parallel_model': 0.1,
                  'speedup': 2.0} for n, _ in at_scale]
    scaling.plot(launches, checks, predicted, str(tmp_path / 'fig5.png'),
                 layers_per_process, at_scale)
    [ax] = drawn[0].axes
    return ax.get_xlabel(), [t.get_text()
                             for t in ax.get_legend().get_texts()]


def test_fig5_axis_follows_the_run(monkeypatch, tmp_path):
    """--layers-per-process 4 --at-scale 64:8,128:16 is what the axis says,
    not the defaults' 64 per process and 4 per core."""
    label, legend = _fig5_labels(monkeypatch, tmp_path, 4,
                                 [(64, 8), (128, 16)])
    assert label == ('layers N (measured: 4 layers per process; model: 8 '
                     'layers per core)')
    assert 'layer-parallel, model (8 layers per core)' in legend


def test_fig5_axis_names_uneven_configurations(monkeypatch, tmp_path):
    label, _ = _fig5_labels(monkeypatch, tmp_path, 64,
                            [(256, 64), (512, 100)])
    assert label == ('layers N (measured: 64 layers per process; model: '
                     '256 layers on 64 cores, 512 layers on 100 cores)')


def test_convergence_says_when_the_drop_was_not_reached(tmp_path, capsys):
    """32 layers do not reach 1e-5 in 3 iterations: the summary says so in
    words rather than 'None'."""
    convergence.main(['--layers', '16,32', '--cases', 'peaks',
                      '--weights', 'smooth', '--iterations', '3',
                      '--batch', '10', '--out', str(tmp_path)])
    out = capsys.readouterr().out
    assert 'None' not in out
    assert 'most V-cycles to 1e-5: not reached in 3 iterations ' \
        '(goal <= 12)' in out
    assert 'N=   16 ' in out and 'V-cycles to 1e-5: state 2, adjoint 2' \
        in out
    assert 'state not reached in 3 iterations, adjoint not reached in 3 ' \
        'iterations' in out
