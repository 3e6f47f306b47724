"""Figure 2: the alpha-beta model on a benchmark file made from a real
1-process K-FAC run (stage times from the optimizer, byte counts from the
communicators' packing layout)."""
import json
import os
import math

import chainerkfac  # NOQA  (before chainer)
import chainer.links as L
import numpy
import pytest

from analysis import _models, scaling
from chainerkfac import packing
from chainerkfac.assignment import Assignment
from chainerkfac.optimizers import KFAC
from tests.analysis.helpers import assert_picture, no_outputs, read_json

ARCH = {'depth': 8, 'width': 4, 'n_class': 10}


def layout_bytes(blocks, processes):
    """Per-step ReduceScatterV / AllGatherV bytes as the communicators count
    them (whole buffers), for the optimizer's assignment on P ranks."""
    owners = Assignment.from_blocks(blocks, processes).owners
    shapes, symmetric, rs_owners, grads, ag_owners = [], [], [], [], []
    for block, owner in zip(blocks, owners):
        for param in block.params:
            shapes.append(param.shape)
            symmetric.append(False)
            rs_owners.append(owner)
            grads.append(param.shape)
            ag_owners.append(owner)
        for shape in block.factor_shapes().values():
            shapes.append(shape)
            symmetric.append(len(shape) == 2)
            rs_owners.append(owner)
    rs = packing.Layout(shapes, ['float32'] * len(shapes), rs_owners,
                        symmetric, processes)
    ag = packing.Layout(grads, ['float32'] * len(grads), ag_owners,
                        [False] * len(grads), processes)
    return {'reduce_scatter_v': rs.reduce_scatter_nbytes,
            'all_gather_v': ag.all_gather_size * 4}


@pytest.fixture(scope='module')
def benchmark(tmp_path_factory):
    from threadpoolctl import threadpool_limits
    numpy.random.seed(0)
    model = L.Classifier(_models.build_model('small', **ARCH))
    optimizer = KFAC(lr=0.01, momentum=0.9, damping=1e-3, verbose=False)
    optimizer.setup(model)
    x = numpy.random.rand(16, 3, 8, 8).astype(numpy.float32)
    t = numpy.random.randint(0, 10, 16).astype(numpy.int32)
    stage_times, step_times = [], []
    with threadpool_limits(limits=1):
        for _ in range(4):
            optimizer.update(model, x, t)
            stage_times.append(dict(optimizer.stage_times))
            step_times.append(sum(optimizer.stage_times.values()))
    blocks = optimizer.blocks
    data = {
        'benchmark': 'dist_scaling', 'model': 'small', 'model_kwargs': ARCH,
        'batch_per_process': 16, 'device': 'CPU',
        'results': [{
            'processes': 1, 'oversubscribed': False,
            'step_time': float(numpy.mean(step_times[1:])),
            'stage_times': {k: float(numpy.mean([s[k] for s in
                                                 stage_times[1:]]))
                            for k in scaling.STAGES},
            'bytes': layout_bytes(blocks, 1),
            'n_kfac_layers': sum(1 for b in blocks if b.factor_names)}]}
    path = tmp_path_factory.mktemp('bench') / 'scaling.json'
    path.write_text(json.dumps(data))
    return str(path), data, blocks


def test_model_numbers(benchmark, tmp_path, capsys):
    path, data, blocks = benchmark
    out = tmp_path / 'fig2.png'
    alpha, beta = 1e-5, 1e9
    assert scaling.main([path, '--alpha', str(alpha), '--beta', str(beta),
                         '--out', str(out)]) == 0
    printed = capsys.readouterr().out
    assert_picture(str(out))
    result = read_json(str(tmp_path / 'fig2.json'))
    stages = data['results'][0]['stage_times']
    rows = {r['processes']: r for r in result['predicted']}
    assert sorted(rows) == [2 ** k for k in range(12)]
    # P = 1: the measured compute stages, no communication.
    one = rows[1]
    assert one['total'] == pytest.approx(
        sum(stages[s] for s in ('forward_backward', 'factors', 'update',
                                'inverse', 'precondition')))
    assert one['reduce_scatter'] == 0 and one['all_gather'] == 0
    # P = 4: inverse scaled by the heaviest rank's share of the assignment.
    assignment = Assignment.from_blocks(blocks, 4)
    share = max(assignment.loads) / sum(b.inverse_cost() for b in blocks)
    assert rows[4]['inverse'] == pytest.approx(stages['inverse'] * share)
    # Ring collectives; 19 layers, so at P = 4 nothing is duplicated.
    rs = data['results'][0]['bytes']['reduce_scatter_v']
    ag = data['results'][0]['bytes']['all_gather_v']
    assert rows[4]['reduce_scatter'] == pytest.approx(
        3 * alpha + 3 / 4 * rs / beta)
    assert rows[4]['all_gather'] == pytest.approx(
        3 * alpha + 3 / 4 * ag / beta)
    # P = 64 > 19 layers: every block owned ~64/19 times; the modelled
    # ReduceScatterV volume is what the packing layout really holds.
    assert rows[64]['reduce_scatter_bytes'] == pytest.approx(
        layout_bytes(blocks, 64)['reduce_scatter_v'], rel=1e-6)
    assert rows[2048]['inverse_share'] == pytest.approx(
        max(b.inverse_cost() for b in blocks) /
        sum(b.inverse_cost() for b in blocks))
    # Shape verdict printed and stored.
    shape = result['shape']
    assert set(shape['checks']) == {
        'faster at 64 than at 4 processes (T(4)/T(64) > 1.05)',
        'superlinear from 1 to 64 (T(1)/T(64) > 1.05)',
        'fastest between 64 and 256 processes',
        'slower past 256 (T rises from 256 to 2048)'}
    assert shape['speedup_1_to_64'] == pytest.approx(
        rows[1]['total'] / rows[64]['total'])
    assert scaling.SUPERLINEAR in printed
    assert 'shape matches the paper: {}'.format(
        'yes' if shape['matches_paper'] else 'no') in printed
    assert 'alpha = 1e-05 s, beta = 1e+09 bytes/s' in printed
    assert result['measured'][0]['step_time'] == \
        data['results'][0]['step_time']


def test_resnet50_layer_structure_and_paper_shape(benchmark, tmp_path):
    """With ResNet-50's blocks and stage times in the paper's proportions
    (inverse the largest stage on one GPU), the default EDR parameters give
    the paper's shape; the inverse stage stops shrinking at the heaviest
    block (a 4608 x 4608 A factor of res5, 12.2 % of the cost)."""
    _, data, _ = benchmark
    model = _models.build_model('resnet50')
    blocks = _models.kfac_blocks(model)
    bench = dict(data, model='resnet50', model_kwargs={})
    bench['results'] = [dict(data['results'][0], bytes=layout_bytes(
        blocks, 1), stage_times=dict(
            forward_backward=0.15, factors=0.01, reduce_scatter=0.0,
            inverse=0.8, precondition=0.05, all_gather=0.0, update=0.02),
        n_kfac_layers=107)]
    path = tmp_path / 'r50.json'
    path.write_text(json.dumps(bench))
    layers = scaling.layer_model_for(scaling.load_benchmark(str(path)),
                                     None, None)
    assert layers.n_layers == 107
    assert layers.at(64)['inverse_share'] == pytest.approx(0.12218, abs=1e-5)
    # 2048 = 19 * 107 + 15: every block has 19 or 20 owners, so their mean
    # weighted by wire size lies between (19.64 measured).
    assert 19 < layers.at(2048)['duplication'] < 20
    rows = scaling.predict(scaling.load_benchmark(str(path)), layers,
                           [1, 4, 64, 256, 512, 1024, 2048],
                           scaling.DEFAULT_ALPHA, scaling.DEFAULT_BETA)
    shape = scaling.shape_checks(rows)
    assert shape['checks'][scaling.FASTER_AT_64]
    assert shape['checks']['superlinear from 1 to 64 (T(1)/T(64) > 1.05)']
    assert shape['checks']['slower past 256 (T rises from 256 to 2048)']


def _shape_result(totals):
    rows = [{'processes': p, 'total': t} for p, t in totals.items()]
    shape = scaling.shape_checks(rows)
    return shape, scaling._verdict(scaling.SUPERLINEAR,
                                   shape['checks'][scaling.SUPERLINEAR], shape)


@pytest.mark.parametrize('t64, ok, verdict', [
    (1.0 / 1.001, False, 'NO (T(1)/T(64) = 1.001: within 5 % of 1, noise)'),
    (1.0 / 0.999, False, 'NO (T(1)/T(64) = 0.999: within 5 % of 1, noise)'),
    (1.0 / 1.2, True, 'yes'),
    (1.0 / 0.5, False, 'NO'),
])
def test_superlinear_needs_a_stated_margin(t64, ok, verdict):
    """T(1)/T(64) = 1.001 is noise, not a speed-up: the check needs the
    ratio above 1.05, says so in its name, and a ratio within 5 % of 1 is
    printed as noise."""
    totals = {1: 1.0, 4: 2.0, 64: t64, 256: 1.1, 512: 1.2, 1024: 1.3,
              2048: 1.4}
    shape, printed = _shape_result(totals)
    assert scaling.SUPERLINEAR == \
        'superlinear from 1 to 64 (T(1)/T(64) > 1.05)'
    assert shape['checks'][scaling.SUPERLINEAR] is ok
    assert shape['superlinear_margin'] == 0.05
    assert printed == verdict


@pytest.mark.parametrize('t64, ok, verdict', [
    (2.0 / 1.001, False, 'NO (T(4)/T(64) = 1.001: within 5 % of 1, noise)'),
    (2.0 / 1.2, True, 'yes'),
    (2.0 / 0.5, False, 'NO'),
])
def test_faster_from_4_to_64_needs_the_same_margin(t64, ok, verdict):
    """T(4)/T(64) = 1.001 is noise too, not 'faster at 64'."""
    totals = {1: 4.0, 4: 2.0, 64: t64, 256: 2.1, 512: 2.2, 1024: 2.3,
              2048: 2.4}
    shape = scaling.shape_checks(
        [{'processes': p, 'total': t} for p, t in totals.items()])
    assert scaling.FASTER_AT_64 == \
        'faster at 64 than at 4 processes (T(4)/T(64) > 1.05)'
    assert shape['checks'][scaling.FASTER_AT_64] is ok
    assert scaling._verdict(scaling.FASTER_AT_64, ok, shape) == verdict


def test_uniform_layers_without_a_known_model():
    layers = scaling.LayerModel(n_layers=10)
    assert layers.at(1)['inverse_share'] == 1.0
    assert layers.at(4)['inverse_share'] == pytest.approx(3 / 10)
    assert layers.at(64)['inverse_share'] == pytest.approx(1 / 10)
    assert layers.at(40)['duplication'] == pytest.approx(4.0)
    assert scaling.ring_time(1, 1e9, 1e-5, 1e9) == 0.0
    assert scaling.ring_time(8, 8e9, 1e-5, 1e9) == pytest.approx(
        7e-5 + 7.0)
    assert math.isclose(layers.at(8)['precondition_share'], 2 / 10)


def test_bad_inputs_are_clear_errors(benchmark, tmp_path, capsys):
    _, data, _ = benchmark
    outdir = tmp_path / 'out'
    outdir.mkdir()

    def write(name, content):
        path = tmp_path / name
        path.write_text(content if isinstance(content, str)
                        else json.dumps(content))
        return str(path)

    no_inverse = json.loads(json.dumps(data))
    del no_inverse['results'][0]['stage_times']['inverse']
    two_only = json.loads(json.dumps(data))
    two_only['results'][0]['processes'] = 2
    no_bytes = json.loads(json.dumps(data))
    no_bytes['results'][0]['bytes'] = {'reduce_scatter_v': 0,
                                       'all_gather_v': 0}
    negative = json.loads(json.dumps(data))
    negative['results'][0]['step_time'] = -1
    twice = json.loads(json.dumps(data))
    twice['results'].append(dict(twice['results'][-1]))
    cases = [
        (write('a.json', 'not json'), 'not JSON'),
        (write('b.json', {'benchmark': 'kfac_step', 'results': []}),
         'not a dist_scaling benchmark output'),
        (write('c.json', no_inverse), 'stage_times["inverse"]'),
        (write('d.json', two_only), 'no 1-process result'),
        (write('e.json', no_bytes), 'no result has byte counts'),
        (str(tmp_path / 'missing.json'), 'cannot read'),
        # plotted as "measured -1.0000 s"; duplicates drawn both
        (write('g.json', negative), '"step_time" must be a number of '
         'seconds > 0, got -1'),
        (write('h.json', twice), 'more than one result for {} '
         'process(es)'.format(twice['results'][-1]['processes'])),
    ]
    for path, message in cases:
        assert scaling.main([path, '--out', str(outdir / 'f.png')]) == 2
        assert message in capsys.readouterr().err
    assert scaling.main([write('f.json', data), '--layer-model', 'vgg',
                         '--out', str(outdir / 'f.png')]) == 2
    assert "unknown model 'vgg'" in capsys.readouterr().err
    # a NaN passed every comparison: --alpha nan drew NaN rows
    for option in ('--alpha', '--beta', '--inverse-overhead'):
        for value in ('nan', 'inf'):
            with pytest.raises(SystemExit):
                scaling.main([write('f.json', data), option, value,
                              '--out', str(outdir / 'f.png')])
            assert 'must be finite' in capsys.readouterr().err
    assert no_outputs(outdir)


def test_inverse_overhead(benchmark):
    _, data, blocks = benchmark
    t_inverse = 0.1
    n_factors = sum(len(b.factor_names) for b in blocks)
    half = scaling.LayerModel(blocks, inverse_overhead=t_inverse / 2 /
                              n_factors, inverse_time=t_inverse)
    assert sum(half.inverse_weights) == pytest.approx(1.0)
    cubic = [b.inverse_cost() if b.factor_names else 0.0 for b in blocks]
    for block, weight, cost in zip(blocks, half.inverse_weights, cubic):
        assert weight == pytest.approx(
            0.5 * len(block.factor_names) / n_factors +
            0.5 * cost / sum(cubic))
    # One block per rank at 2048 processes: the heaviest block's weight.
    assert half.at(2048)['inverse_share'] == pytest.approx(
        max(half.inverse_weights))
    with pytest.raises(scaling._io.AnalysisError, match='not below'):
        scaling.LayerModel(blocks, inverse_overhead=t_inverse / n_factors,
                           inverse_time=t_inverse)


def test_output_never_overwrites_the_input(benchmark, tmp_path, capsys):
    path, _, _ = benchmark
    before = open(path).read()
    png = path[:-len('.json')] + '.png'
    assert scaling.main([path, '--out', png]) == 2
    assert 'would overwrite the input' in capsys.readouterr().err
    assert open(path).read() == before
    assert scaling.main([path, '--out', str(tmp_path / 'x.svg')]) == 2
    assert 'ending in .png' in capsys.readouterr().err


def test_help_states_the_output_default(capsys):
    with pytest.raises(SystemExit) as exit_:
        scaling.parse_args(['--help'])
    assert exit_.value.code == 0
    text = ' '.join(capsys.readouterr().out.split())
    assert '(default: fig2_scaling.png, in the current directory)' in text
    assert 'default 2048' in text


def test_outputs_hold_null_for_nan_and_leave_no_png_named_temporary(
        tmp_path, monkeypatch):
    """``NaN`` is not JSON (JavaScript's parser refuses it): written as
    null. A script killed while saving left ``f.png.tmp.png``, which a
    glob of the pictures picks up: the temporaries are hidden and end in
    ``.tmp``."""
    from analysis import _io
    figure = _io.new_figure()
    png = tmp_path / 'f.png'
    written = []
    real = figure.savefig

    def savefig(path, **kwargs):
        written.append(str(path))
        return real(path, **kwargs)

    monkeypatch.setattr(figure, 'savefig', savefig)
    _io.save_outputs(figure, str(png), {'a': [1.0, float('nan')],
                                        'b': {'c': float('inf')}})
    with open(str(tmp_path / 'f.json')) as f:
        text = f.read()
    assert 'NaN' not in text and 'Infinity' not in text
    assert json.loads(text) == {'a': [1.0, None], 'b': {'c': None}}
    [temporary] = written
    name = os.path.basename(temporary)
    assert name.startswith('.') and not name.endswith('.png')
    assert sorted(os.listdir(str(tmp_path))) == ['f.json', 'f.png']
