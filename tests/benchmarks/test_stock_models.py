"""``python -m benchmarks.stock_models --smoke`` as a user runs it: the
JSON holds every figure, finite and positive; and the pieces the figures
rest on (the step-kind cycle, the amortised interval cost, the block
signature of a limit). Nothing here asserts a speed or an accuracy."""
import json
import math

import pytest

import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)
import chainer.links as L

from tests.benchmarks.help_text import assert_whole_first_paragraph
from tests.benchmarks.help_text import help_text
from tests.benchmarks.help_text import option_helps
from tests.benchmarks.test_benchmarks import check_header
from tests.benchmarks.test_benchmarks import positive
from tests.benchmarks.test_benchmarks import run_benchmark

INTERVALS = ('every', 'stale', '1', '5', '10', '20', 'A20/G5')


def test_stock_models_smoke(tmp_path):
    data, stdout = run_benchmark('stock_models', tmp_path)
    check_header(data, 'stock_models')
    assert data['smoke'] is True and data['blas_threads'] in (1, None)
    for text in ('K-FAC step time / stock optimizer step time',
                 'K-FAC stage seconds', 'Validation accuracy on the digits',
                 'The step in the Fisher metric', 'Candidates'):
        assert text in stdout
    timing = data['timing']
    assert {e['model'] for e in timing} == {'ptb', 'mnist_mlp', 'dcgan'}
    assert all(len(set(e['limit'] for e in timing if e['model'] == m)) == 5
               for m in ('ptb', 'mnist_mlp', 'dcgan'))
    for entry in timing:
        assert entry['stock_optimizer'] == 'Adam'
        assert entry['kfac_blocks'] > 0 and positive(
            entry['precondition_gflop'])
        assert positive(entry['stock_s']['median'])
        assert entry['inverse_retries'] >= 0 and entry['skipped_steps'] == 0
        assert set(entry['ratio']) == set(INTERVALS)
        for spread in entry['ratio'].values():
            assert positive(spread['median'])
            assert spread['min'] <= spread['median'] <= spread['max']
        for phase in ('every', 'g_only', 'stale'):
            assert positive(entry['kfac_s'][phase]['median'])
            stages = entry['stages_s'][phase]
            assert all(math.isfinite(v) and v >= 0 for v in stages.values())
    # The tiny MLP's factors (21 or fewer) are all full up to 512: the
    # other limits are the same blocks and are not timed again.
    mlp = [e for e in timing if e['model'] == 'mnist_mlp']
    assert 'same_as' not in mlp[0]
    assert all(e['same_as'] is None for e in mlp[1:])
    accuracy = data['accuracy']
    optimizers = {(e['net'], e['optimizer']) for e in accuracy}
    assert optimizers == {('digits_conv_bn', 'MomentumSGD'),
                          ('digits_conv_bn', 'KFAC'),
                          ('digits_mlp', 'MomentumSGD'),
                          ('digits_mlp', 'Adam'), ('digits_mlp', 'KFAC')}
    for entry in accuracy:
        assert 0 <= entry['accuracy_mean'] <= 1
        assert len(entry['runs']) == len(data['seeds']) == 1
        assert math.isfinite(entry['vs_sgd'])
    stability = data['stability']
    assert [(e['damping'], e['intervals']) for e in stability] == [
        (d, i) for d in (1e-3, 1e-2, 3e-2) for i in ('1', '5')]
    assert all(len(e['sizes']) == e['steps'] and positive(e['median'])
               for e in stability)
    assert data['candidates'] and all(
        'mnist_mlp' in row for row in data['candidates'])


def test_merge_keeps_what_is_not_redone(tmp_path):
    from benchmarks import stock_models
    timing = tmp_path / 'timing.json'
    accuracy = tmp_path / 'accuracy.json'
    out = tmp_path / 'all.json'
    stock_models.main(['--smoke', '--part', 'timing', '--models',
                       'mnist_mlp', '--limits', 'None', '--out',
                       str(timing)])
    stock_models.main(['--smoke', '--part', 'accuracy', '--limits', 'None',
                       '--out', str(accuracy)])
    stock_models.main(['--smoke', '--part', 'stability', '--merge',
                       str(timing), '--merge', str(accuracy), '--out',
                       str(out)])
    with open(out) as f:
        data = json.load(f)
    assert [e['model'] for e in data['timing']] == ['mnist_mlp']
    assert len(data['accuracy']) == 7 and len(data['stability']) == 6
    assert [m['file'] for m in data['merged_from']] == [str(timing),
                                                        str(accuracy)]
    assert data['candidates'] and all('mnist_mlp' in row
                                      for row in data['candidates'])


def test_amortised_step_time_of_intervals():
    from benchmarks import stock_models
    times = {'every': 10.0, 'g_only': 4.0, 'stale': 1.0}
    assert stock_models.amortised(times, (1, 1)) == 10.0
    assert stock_models.amortised(times, (5, 5)) == pytest.approx(14 / 5)
    # Every 20 steps: 1 every, 3 G only, 16 stale.
    assert stock_models.amortised(times, (20, 5)) == pytest.approx(
        (10 + 12 + 16) / 20)
    with pytest.raises(ValueError, match='multiple'):
        stock_models.amortised(times, (5, 20))


def test_the_cycle_takes_every_g_only_and_stale_steps():
    from benchmarks import stock_models
    from tests.chainerkfac.stock import nets
    trainee = nets.mnist_mlp(batch=4, n_in=5, n_units=3)().setup(
        stock_models._kfac_for_cycle(None))
    refreshed = []
    for _ in range(6):
        trainee.step()
        optimizer = trainee.optimizers[0]
        last = optimizer.last_refresh
        refreshed.append(''.join(k for k in 'AG'
                                 if last[k] == optimizer.t - 1))
    assert refreshed == ['AG', 'G', '', 'AG', 'G', '']


def test_block_signature_follows_the_limit():
    from benchmarks import stock_models
    model = L.Linear(3000, 20)
    full = stock_models.describe_blocks(
        stock_models.block_signature([model], None))
    guarded = stock_models.describe_blocks(
        stock_models.block_signature([model], 1024))
    assert full['largest_full_factor'] == 3001
    assert full['precondition_gflop'] == pytest.approx(
        2 * 20 * 3001 * (20 + 3001) / 1e9)
    assert guarded['largest_full_factor'] == 20
    assert guarded['diagonal_factors'] == 1
    assert guarded['precondition_gflop'] == pytest.approx(
        2 * 20 * 3001 * (20 + 1) / 1e9)


def test_help_gives_every_option_a_help_and_its_default(capsys):
    text = help_text('benchmarks.stock_models', capsys)
    assert_whole_first_paragraph('benchmarks.stock_models', text)
    helps = option_helps(text)
    for option in ('--part', '--models', '--limits', '--cycles', '--seeds',
                   '--epochs', '--batch', '--dampings', '--intervals',
                   '--kl-clip', '--low-rank', '--threads', '--out'):
        assert 'default' in helps[option], option
    assert '(default: result/stock_models.json)' in helps['--out']
    assert all(helps.values())
