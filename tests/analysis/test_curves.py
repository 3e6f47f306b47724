"""Figures 3 and 6 from real run directories (conftest trains them)."""
import json
import os
import shutil

import pytest

from analysis import curves
from tests.analysis.conftest import read_log
from tests.analysis.helpers import assert_picture, no_outputs, read_json


def test_figure3_numbers_match_the_logs(runs, tmp_path, capsys):
    out = tmp_path / 'fig3.png'
    dirs = [runs['kfac32'], runs['kfac64_diag'], runs['sgd32']]
    assert curves.main(dirs + ['--target', '60', '--out', str(out)]) == 0
    printed = capsys.readouterr().out
    assert_picture(str(out))
    data = read_json(str(tmp_path / 'fig3.json'))
    labels = [r['label'] for r in data['runs']]
    assert labels == ['K-FAC BS=32', 'K-FAC BS=64 diag', 'SGD BS=32']
    for run, entry in zip(dirs, data['runs']):
        log = read_log(run)
        accuracy = [100 * e['validation/main/accuracy'] for e in log]
        assert entry['epoch'] == [e['epoch'] for e in log]
        assert entry['val_accuracy_percent'] == pytest.approx(accuracy)
        assert entry['lr']['source'] == 'log'
        assert entry['lr']['lr'] == pytest.approx([e['lr'] for e in log])
        reached = [e for e, a in zip(entry['epoch'], accuracy) if a >= 60]
        assert entry['epochs_to_target'] == (reached[0] if reached else None)
        # The printed table carries the same numbers.
        assert entry['label'] in printed
        for value in accuracy:
            assert '{:.2f}'.format(value) in printed


def test_figure6_and_lr_from_config(runs, tmp_path, capsys):
    # A copy of a run whose log lacks "lr": eq. (17) from its config.
    run = tmp_path / 'nolr'
    run.mkdir()
    log = read_log(runs['kfac32'])
    for entry in log:
        del entry['lr']
    (run / 'log').write_text(json.dumps(log))
    with open(os.path.join(runs['kfac32'], 'config.json')) as f:
        (run / 'config.json').write_text(f.read())
    out = tmp_path / 'out' / 'fig.png'
    assert curves.main([str(run), '--out', str(out)]) == 0
    data = read_json(str(tmp_path / 'out' / 'fig.json'))
    assert data['runs'][0]['lr']['source'] == 'config (eq. 17)'
    # lr 0.02, p_decay 3, e_start 1, e_end 4: 0.02 ((4 - x) / 3)^3, its
    # mean over epoch 2 (x from 1 to 2) as the log's lr is an epoch's mean:
    # 0.02 (3^4 - 2^4) / (4 · 27)
    assert data['runs'][0]['lr']['lr'][1] == pytest.approx(
        0.02 * 65 / 108, rel=1e-4)
    # an SGD run's config holds K-FAC's schedule, not its own: none drawn
    sgd = tmp_path / 'sgd_nolr'
    shutil.copytree(runs['sgd32'], str(sgd))
    log = read_log(str(sgd))
    for entry in log:
        del entry['lr']
    (sgd / 'log').write_text(json.dumps(log))
    result = curves.analyse([str(sgd)], 60.0, 3)
    assert result['runs'][0]['lr'] == {'epoch': [], 'lr': [],
                                       'source': 'none'}
    out6 = tmp_path / 'fig6.png'
    assert curves.main([runs['kfac32'], runs['kfac64_diag'], '--figure',
                        '6', '--labels', 'no approx', 'diag', '--target',
                        '0.5', '--out', str(out6)]) == 0
    assert_picture(str(out6))
    data6 = read_json(str(tmp_path / 'fig6.json'))
    assert data6['target_percent'] == 50
    assert [r['label'] for r in data6['runs']] == ['no approx', 'diag']
    assert data6['runs'][0]['lr'] is None
    assert 'Figure 6' in capsys.readouterr().out


def test_runs_of_one_config_told_apart_by_their_directories(runs, tmp_path):
    """Two runs of one config (another seed, say) would both be 'K-FAC
    BS=32': the directory's name, or its last components, is added."""
    seed2 = tmp_path / 'seed2'
    shutil.copytree(runs['kfac32'], str(seed2))
    again = tmp_path / 'again' / 'kfac32'
    shutil.copytree(runs['kfac32'], str(again))
    result = curves.analyse([runs['kfac32'], str(seed2), runs['sgd32']],
                            60.0, 6)
    assert [r['label'] for r in result['runs']] == [
        'K-FAC BS=32 (kfac32)', 'K-FAC BS=32 (seed2)', 'SGD BS=32']
    result = curves.analyse([runs['kfac32'], str(again)], 60.0, 6)
    parent = os.path.basename(os.path.dirname(runs['kfac32']))
    assert [r['label'] for r in result['runs']] == [
        'K-FAC BS=32 ({}/kfac32)'.format(parent), 'K-FAC BS=32 (again/kfac32)']
    result = curves.analyse([runs['kfac32'], str(seed2)], 60.0, 6,
                            ['first', 'second'])
    assert [r['label'] for r in result['runs']] == ['first', 'second']


def test_bad_inputs_are_clear_errors(runs, tmp_path, capsys):
    empty = tmp_path / 'empty'
    empty.mkdir()
    other = tmp_path / 'other'
    other.mkdir()
    (other / 'log').write_text('{"loss": [1, 2, 3]}')
    noacc = tmp_path / 'noacc'
    noacc.mkdir()
    (noacc / 'log').write_text(json.dumps(
        [{'epoch': 1, 'iteration': 10, 'main/loss': 1.0}]))
    cases = [([str(empty)], 'no Chainer LogReport file "log"'),
             ([str(other)], 'not a Chainer LogReport log'),
             ([str(noacc)], 'no "validation/main/accuracy"'),
             ([str(tmp_path / 'missing')], 'not a run directory'),
             ([runs['kfac32'], '--labels', 'a', 'b'], '2 labels for 1 runs')]
    outdir = tmp_path / 'out'
    outdir.mkdir()
    for argv, message in cases:
        assert curves.main(argv + ['--out', str(outdir / 'f.png')]) == 2
        assert message in capsys.readouterr().err
    assert no_outputs(outdir)


def test_epochs_whose_accuracy_is_not_finite_are_gaps(runs, tmp_path,
                                                      capsys):
    """A NaN or an infinite accuracy in a log is drawn as a gap: it is not
    the best and does not reach the target; the table names the epochs."""
    run = tmp_path / 'nan'
    shutil.copytree(runs['kfac32'], str(run))
    log = read_log(str(run))
    log[0]['validation/main/accuracy'] = float('nan')
    log[1]['validation/main/accuracy'] = float('inf')
    (run / 'log').write_text(json.dumps(log))
    out = tmp_path / 'fig.png'
    assert curves.main([str(run), '--target', '0.99', '--out',
                        str(out)]) == 0
    printed = capsys.readouterr().out
    entry = read_json(str(tmp_path / 'fig.json'))['runs'][0]
    finite = 100 * log[2]['validation/main/accuracy']
    assert entry['best_percent'] == pytest.approx(finite)
    assert entry['epochs_to_target'] == (log[2]['epoch'] if finite >= 99
                                         else None)
    assert entry['non_finite_epochs'] == [log[0]['epoch'], log[1]['epoch']]
    assert 'not finite at epoch(s) 1, 2' in printed


@pytest.mark.parametrize('target', ['-5', 'nan', '150', '0'])
def test_a_target_out_of_range_is_refused(runs, tmp_path, capsys, target):
    assert curves.main([runs['kfac32'], '--target=' + target, '--out',
                        str(tmp_path / 'f.png')]) == 2
    assert 'a top-1 accuracy in (0, 100]' in capsys.readouterr().err
    assert no_outputs(tmp_path)


def test_an_output_that_cannot_be_written_is_a_clear_error(
        runs, tmp_path, capsys, monkeypatch):
    """--out a directory, or under a file: refused before any work. A write
    that fails on the way (a full disk, a folder the process may not
    write): one line naming --out, exit 2, and no file left, temporary or
    not."""
    folder = tmp_path / 'isdir.png'
    folder.mkdir()
    afile = tmp_path / 'afile'
    afile.write_text('x')
    for out, message in ((folder, 'is a directory'),
                         (afile / 'f.png', 'is a file, not a folder')):
        assert curves.main([runs['kfac32'], '--out', str(out)]) == 2
        assert message in capsys.readouterr().err
    assert sorted(os.listdir(str(tmp_path))) == ['afile', 'isdir.png']
    from matplotlib.figure import Figure

    def full(self, path, **kwargs):
        with open(path, 'w') as f:
            f.write('half')
        raise OSError(28, 'No space left on device')
    monkeypatch.setattr(Figure, 'savefig', full)
    out = tmp_path / 'new' / 'f.png'
    assert curves.main([runs['kfac32'], '--out', str(out)]) == 2
    assert 'cannot write: No space left on device' in \
        capsys.readouterr().err
    assert os.listdir(str(tmp_path / 'new')) == []


@pytest.mark.parametrize('key, value', [
    ('epoch', '2'), ('epoch', None), ('validation/main/accuracy', 'n/a'),
    ('validation/main/accuracy', [0.8]), ('lr', True)])
def test_a_log_value_that_is_not_a_number_is_refused(runs, tmp_path, capsys,
                                                     key, value):
    """A log edited by hand: a string epoch wrote the PNG and JSON, then
    failed formatting the table with a traceback; the others failed in
    float()'s words. Refused naming the log, the entry and the key."""
    run = tmp_path / 'edited'
    shutil.copytree(runs['kfac32'], str(run))
    log = read_log(str(run))
    log[1][key] = value
    (run / 'log').write_text(json.dumps(log))
    outdir = tmp_path / 'out'
    assert curves.main([str(run), '--out', str(outdir / 'f.png')]) == 2
    err = capsys.readouterr().err
    assert '{}: entry 2'.format(run / 'log') in err
    assert '{} is {!r}, not a number'.format(key, value) in err
    assert not outdir.exists() or no_outputs(outdir)


@pytest.mark.parametrize('name', ['time_to_accuracy', 'summary'])
def test_an_output_never_replaces_a_file_a_run_wrote(runs, tmp_path, capsys,
                                                    name):
    """``--out run/time_to_accuracy.png`` replaced the run's
    ``time_to_accuracy.json`` with the figure's data (the demo's
    ``summary.json`` the same)."""
    run = tmp_path / 'run'
    shutil.copytree(runs['kfac32'], str(run))
    kept = run / (name + '.json')
    kept.write_text('{"written": "by the run"}\n')
    assert curves.main([str(run), '--out', str(run / (name + '.png'))]) == 2
    assert 'a file a run wrote' in capsys.readouterr().err
    assert kept.read_text() == '{"written": "by the run"}\n'
    assert not (run / (name + '.png')).exists()


@pytest.mark.parametrize('edit, message', [
    ('percent', 'is 91.2, not a fraction in [0, 1] (a percentage?)'),
    ('order', 'the epochs are not increasing (3, 1, 2)'),
    ('repeated', 'the epochs are not increasing (1, 1, 2'),
])
def test_a_log_that_cannot_be_a_run_is_refused(runs, tmp_path, capsys, edit,
                                               message):
    """Accuracy in percent (plotted as 9120 %), epochs out of order or
    repeated (a line doubling back): drawn before, without a word."""
    run = tmp_path / 'edited'
    shutil.copytree(runs['kfac32'], str(run))
    log = read_log(str(run))[:3]
    if edit == 'percent':
        log[1]['validation/main/accuracy'] = 91.2
    elif edit == 'order':
        log = [log[2], log[0], log[1]]
    else:
        log = [log[0]] + log
    (run / 'log').write_text(json.dumps(log))
    out = tmp_path / 'out' / 'f.png'
    assert curves.main([str(run), '--out', str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
