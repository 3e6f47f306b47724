"""Figure 5 from the Diff logs of real runs (conftest trains them)."""
import json
import math
import os
import shutil

import numpy
import pytest

from analysis import _io, fisher_diff
from tests.analysis.conftest import read_diff
from tests.analysis.helpers import assert_picture, no_outputs, read_json

CONVS_OF_SMALL_RESNET8 = 9    # stem + 3 blocks x 2 + 2 shortcuts


def test_percentiles_match_the_log(runs, tmp_path, capsys):
    out = tmp_path / 'fig5.png'
    dirs = [runs['kfac32'], runs['kfac64_diag']]
    assert fisher_diff.main(dirs + ['--mark', '10', '--out', str(out)]) == 0
    printed = capsys.readouterr().out
    assert_picture(str(out))
    data = read_json(str(tmp_path / 'fig5.json'))
    assert data['mark'] == 10 and data['mark_shown']
    assert [r['label'] for r in data['runs']] == ['BS=32', 'BS=64']
    for run, entry in zip(dirs, data['runs']):
        records = read_diff(run)
        assert entry['kronecker_layers'].startswith('conv layers')
        assert entry['layers'] == {'A': CONVS_OF_SMALL_RESNET8,
                                   'G': CONVS_OF_SMALL_RESNET8, 'F': 9}
        for factor in ('A', 'G', 'F'):
            series = entry['series'][factor]
            assert series['x'] == [r['step'] for r in records]
            for i, record in enumerate(records):
                values = [v for k, v in record[factor].items()
                          if not k.endswith('/fc')]
                expected = numpy.percentile(values, [5, 25, 50, 75, 95])
                got = [series['p{}'.format(q)][i]
                       for q in (5, 25, 50, 75, 95)]
                assert got == pytest.approx(expected)
        # The printed table holds the first step's median.
        first = entry['series']['G']
        assert '{:.4g}'.format(first['p50'][0]) in printed


def test_include_fc_and_no_model(runs, tmp_path):
    out = tmp_path / 'all.png'
    assert fisher_diff.main([runs['kfac32'], '--include-fc', '--out',
                             str(out)]) == 0
    data = read_json(str(tmp_path / 'all.json'))
    assert data['runs'][0]['layers']['A'] == CONVS_OF_SMALL_RESNET8 + 1
    assert not data['mark_shown']     # 500 is past the 30 logged steps
    # Without "arch" in config.json every Kronecker layer is kept.
    bare = tmp_path / 'bare'
    shutil.copytree(runs['kfac32'], str(bare))
    config = read_json(str(bare / 'config.json'))
    del config['run']['arch']
    (bare / 'config.json').write_text(json.dumps(config))
    assert fisher_diff.main([str(bare), '--out', str(out)]) == 0
    data = read_json(str(tmp_path / 'all.json'))
    assert data['runs'][0]['kronecker_layers'].startswith('conv+FC')
    assert data['runs'][0]['layers']['A'] == CONVS_OF_SMALL_RESNET8 + 1


def test_runs_of_one_config_told_apart_by_their_directories(runs, tmp_path):
    seed2 = tmp_path / 'seed2'
    shutil.copytree(runs['kfac32'], str(seed2))
    loaded = [_io.load_run(d) for d in (
        runs['kfac32'], str(seed2), runs['kfac64_diag'])]
    assert fisher_diff.run_labels(loaded) == [
        'BS=32 (kfac32)', 'BS=32 (seed2)', 'BS=64']
    # Equal batch sizes, different configs: the full labels, as before.
    diag = dict(loaded[2].config, global_batch_size=32)
    loaded[1] = _io.Run(loaded[2].path, loaded[2].log, diag)
    assert fisher_diff.run_labels(loaded[:2]) == [
        'BS=32 (K-FAC BS=32)', 'BS=32 (K-FAC BS=32 diag)']


def test_layer_prefix_fits_every_key():
    names = ['/conv1', '/res2/a/conv1', '/fc']
    assert fisher_diff.layer_prefix(
        ['/predictor/res2/a/conv1', '/predictor/fc'], names) == '/predictor'
    assert fisher_diff.layer_prefix(['/res2/a/conv1', '/conv1'], names) == ''
    # '/conv1' is a suffix of '/m/stage1/0/conv1', but no prefix fits all.
    assert fisher_diff.layer_prefix(
        ['/m/stage1/0/conv1', '/m/res2/a/conv1'], names) is None


def test_bad_inputs_are_clear_errors(runs, tmp_path, capsys):
    nodiff = tmp_path / 'sgd'
    shutil.copytree(runs['sgd32'], str(nodiff))
    garbled = tmp_path / 'garbled'
    shutil.copytree(runs['kfac32'], str(garbled))
    with open(str(garbled / 'fisher_diff.jsonl'), 'a') as f:
        f.write('{"loss": 1}\n')
    nolog = tmp_path / 'nolog'
    nolog.mkdir()
    cases = [
        ([str(nodiff)], 'a sgd run: Diff(t) of eq. (21) exists for K-FAC '
         'runs only'),
        ([str(garbled)], 'not a FisherDiffLog record'),
        ([str(nolog)], 'no fisher_diff.jsonl (train with Diff logging on'),
        ([runs['kfac32'], '--model', 'resnet50'],
         "are not the K-FAC layers of model 'resnet50'"),
        ([runs['kfac32'], '--model', 'alexnet'], "unknown model 'alexnet'"),
    ]
    outdir = tmp_path / 'out'
    outdir.mkdir()
    for argv, message in cases:
        assert fisher_diff.main(argv + ['--out', str(outdir / 'f.png')]) == 2
        assert message in capsys.readouterr().err
    assert no_outputs(outdir)


def test_a_run_stopped_in_its_first_epoch_has_its_figure(runs, tmp_path):
    """Killed before its first epoch ended: Diff records and a config but
    no log yet; Figure 5 needs only those."""
    early = tmp_path / 'early'
    shutil.copytree(runs['kfac32'], str(early))
    os.remove(str(early / 'log'))
    out = tmp_path / 'f.png'
    assert fisher_diff.main([str(early), '--out', str(out)]) == 0
    assert_picture(str(out))
    whole = fisher_diff.analyse([runs['kfac32']], fisher_diff.parse_args(
        [runs['kfac32']]))
    data = read_json(str(tmp_path / 'f.json'))
    assert data['runs'][0]['series'] == whole['runs'][0]['series']


def test_non_finite_values_are_left_out():
    records = [{'iteration': 1, 'step': 1,
                'A': {'/a': 0.1, '/b': float('inf'), '/c': 0.3}}]
    series = fisher_diff.percentile_series(records, 'A', None)
    assert series['n_layers'] == [2]
    assert series['p50'] == [pytest.approx(0.2)]
    assert all(math.isfinite(v) for v in series['p95'])


def test_help_states_the_output_default(capsys):
    with pytest.raises(SystemExit) as exit_:
        fisher_diff.parse_args(['--help'])
    assert exit_.value.code == 0
    text = ' '.join(capsys.readouterr().out.split())
    assert '(default: fig5_fisher_diff.png, in the current directory)' \
        in text


@pytest.mark.parametrize('damage, message', [
    (b'\xe9\x00\xff garbage\n', 'not a FisherDiffLog record (not a JSON '
     'object'),
    (b'{"iteration": 3, "step": "three", "A": {}}\n', "step is 'three'"),
    (b'{"iteration": 3, "step": 3, "A": {"/c": true}}\n', 'A of /c is True'),
])
def test_a_damaged_record_is_refused_naming_its_line(runs, tmp_path, capsys,
                                                     damage, message):
    """Random bytes, a string step, booleans: a traceback (UnicodeDecode,
    int(), NumPy's subtract) before."""
    run = tmp_path / 'damaged'
    shutil.copytree(runs['kfac32'], str(run))
    path = run / 'fisher_diff.jsonl'
    lines = path.read_bytes().count(b'\n')
    with open(str(path), 'ab') as f:
        f.write(damage)
    outdir = tmp_path / 'out'
    assert fisher_diff.main([str(run), '--out', str(outdir / 'f.png')]) == 2
    err = capsys.readouterr().err
    assert '{}:{}: '.format(path, lines + 1) in err and message in err
    assert not outdir.exists() or no_outputs(outdir)


def test_an_unfinished_last_line_is_left_out_as_on_resuming(runs, tmp_path,
                                                            capsys):
    """SIGKILL while a record is written leaves half a line with no
    newline: the trainer drops it on resuming, the figure refused the
    run; now it is left out, said on stderr."""
    run = tmp_path / 'killed'
    shutil.copytree(runs['kfac32'], str(run))
    path = run / 'fisher_diff.jsonl'
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"iteration": 99, "step": 99, "A": {"/pre')
    out = tmp_path / 'f.png'
    assert fisher_diff.main([str(run), '--out', str(out)]) == 0
    assert 'an unfinished last line, left out' in capsys.readouterr().err
    data = read_json(str(tmp_path / 'f.json'))
    whole_data = fisher_diff.analyse([runs['kfac32']], fisher_diff.parse_args(
        [runs['kfac32']]))
    assert data['runs'][0]['series'] == whole_data['runs'][0]['series']


def test_steps_without_a_finite_value_are_counted():
    records = [{'iteration': 1, 'step': 1, 'A': {'/a': float('nan')}},
               {'iteration': 2, 'step': 2, 'A': {'/a': 0.5}},
               {'iteration': 3, 'step': 3, 'G': {'/a': 0.5}}]
    series = fisher_diff.percentile_series(records, 'A', None)
    assert series['x'] == [2]
    assert series['steps_without_a_finite_value'] == 1
