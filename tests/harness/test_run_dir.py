"""Claiming a run directory: an earlier run's files refused, or removed
with ``--overwrite`` (only the run's files: a user's notes and a ``--mean``
input stay); a run that continues its own snapshot keeps them; a snapshot
``--overwrite`` would remove before reading it is refused."""
import os

import pytest

from harness import run_dir
from tests.harness import OneProcess
from tests.harness.damage import truncate
from tests.harness.test_resume import write_snapshot


EARLIER = ['bad_images.txt', 'config.json', 'fisher_diff.jsonl', 'log',
           'mean.npy', 'model_final.npz', 'snapshot_step_1.rank0',
           'snapshot_step_2.rank0', 'superseded_20261127-120000',
           'time_to_accuracy.json']


@pytest.fixture
def out(tmp_path):
    for name in EARLIER + ['notes.txt', '.snapshot_step_3.rank0.tmp',
                           '.model_final.npz.tmp']:
        if name.startswith('superseded_'):     # set aside by a resume
            (tmp_path / name).mkdir()
            (tmp_path / name / 'model_final.npz').write_text('x')
        else:
            (tmp_path / name).write_text('x')
    write_snapshot(str(tmp_path / 'snapshot_step_2.rank0'), 1)
    return str(tmp_path)


def claim(out, **kwargs):
    options = dict(overwrite=False, mean_is_output=True)
    options.update(kwargs)
    lock = run_dir.claim(OneProcess, out, **options)
    assert sorted(os.listdir(out)).count('run.lock') == 1
    lock.release()


def test_earlier_run_refused_naming_its_files(out):
    with pytest.raises(OSError) as info:
        claim(out)
    message = str(info.value)
    assert 'holds the files of an earlier run' in message
    assert 'bad_images.txt, config.json, fisher_diff.jsonl' in message
    assert '--resume latest' in message and '--overwrite' in message
    assert sorted(os.listdir(out)) == sorted(
        EARLIER + ['notes.txt', '.snapshot_step_3.rank0.tmp',
                   '.model_final.npz.tmp'])


def test_earlier_run_without_a_snapshot_not_offered_resume(tmp_path):
    """A run that failed before its first snapshot (a truncated image)
    left config.json and mean.npy: --resume latest would find nothing."""
    for name in ('config.json', 'mean.npy', '.snapshot_step_3.rank0.tmp'):
        (tmp_path / name).write_text('x')
    with pytest.raises(OSError) as info:
        claim(str(tmp_path))
    message = str(info.value)
    assert 'left no snapshot (config.json, mean.npy)' in message
    assert '--resume latest' not in message and '--overwrite' in message


@pytest.mark.parametrize('how', ['truncated', 'a process missing'])
def test_earlier_run_with_only_incomplete_snapshots_not_offered_resume(
        out, how):
    """Its one whole snapshot cut short (a copy that stopped), or written
    by two processes of which one file is gone: --resume latest would find
    none, so it is not offered."""
    if how == 'truncated':
        truncate(os.path.join(out, 'snapshot_step_2.rank0'))
    else:
        write_snapshot(os.path.join(out, 'snapshot_step_2.rank0'), 2)
    with pytest.raises(OSError) as info:
        claim(out)
    message = str(info.value)
    assert 'snapshots are all incomplete' in message
    assert 'config.json' in message
    assert '--resume latest would find none' in message
    assert '--overwrite' in message and 'continue it with' not in message
    assert 'notes.txt' in os.listdir(out)


def test_overwrite_removes_the_run_files_only(out):
    claim(out, overwrite=True, mean_is_output=False)
    assert sorted(os.listdir(out)) == ['mean.npy', 'notes.txt']


def test_a_run_continuing_its_own_snapshot_keeps_the_files(out):
    claim(out, source=os.path.join(out, 'snapshot_step_2.rank0'),
          continues=True)
    assert 'log' in os.listdir(out)


def test_overwrite_would_remove_the_source_refused(out):
    for continues in (True, False):
        with pytest.raises(OSError, match='would remove'):
            claim(out, overwrite=True, continues=continues,
                  source=os.path.join(out, 'snapshot_step_2'))
    assert 'log' in os.listdir(out)


def test_source_elsewhere_with_overwrite_clears_here(out, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp('other')
    (elsewhere / 'snapshot_step_2.rank0').write_text('x')
    claim(out, overwrite=True, continues=True,
          source=str(elsewhere / 'snapshot_step_2.rank0'))
    assert sorted(os.listdir(out)) == ['notes.txt']


def test_label_names_the_variants_as_figure_6_does():
    import types
    cfg = types.SimpleNamespace(global_batch_size=64, bn_fisher='diag',
                                refresh_interval_a=20, refresh_interval_g=1,
                                refresh_interval_f=1)
    assert run_dir.label_of('kfac', cfg) == 'K-FAC bs64 stale diag'
    assert run_dir.label_of('sgd', cfg) == 'SGD bs64'


def _diff_lines(steps):
    import json
    return ''.join(json.dumps({'step': s, 'iteration': 3 * s, 'A': {}}) +
                   '\n' for s in steps)


def test_continuing_drops_a_cut_off_last_diff_line(tmp_path, caplog):
    """A killed run's last fisher_diff.jsonl line cut off (a full disk, a
    node lost): written after the snapshot, it is dropped with a warning;
    the lines before the snapshot's step stay."""
    import json
    path = tmp_path / run_dir.FISHER_DIFF_FILE
    path.write_text(_diff_lines(range(5)) + '{"step": 5, "iter')
    with caplog.at_level('WARNING'):
        run_dir.continue_run_files(str(tmp_path), str(tmp_path), 3, None)
    assert [json.loads(line)['step']
            for line in path.read_text().splitlines()] == [0, 1, 2]
    assert 'fisher_diff.jsonl:6: an unfinished last line' in caplog.text


def test_continuing_names_a_damaged_diff_line(tmp_path):
    path = tmp_path / run_dir.FISHER_DIFF_FILE
    text = _diff_lines(range(5)).splitlines(True)
    text[1] = 'garbage\n'
    path.write_text(''.join(text))
    with pytest.raises(ValueError, match=r'fisher_diff\.jsonl:2: not a '
                       'fisher_diff record'):
        run_dir.continue_run_files(str(tmp_path), str(tmp_path), 3, None)
    assert path.read_text() == ''.join(text)       # left as it was


def test_config_changes_name_each_value_a_resume_changes(tmp_path):
    """A resume prints what it changes of the run's config.json (it is
    rewritten with the resumed run's settings); keys an earlier version
    did not record are no change."""
    import config as config_module
    cfg = config_module.load(os.path.join(
        os.path.dirname(__file__), '..', '..', 'config', 'demo.json'))
    facts = {'n_processes': 2, 'acc_iters': 4, 'label': 'K-FAC bs256'}
    out = str(tmp_path)
    assert run_dir.read_config(out) is None                  # no file
    assert run_dir.config_changes(cfg, None, facts) == []
    run_dir.write_run_config(cfg, out, facts)
    old = run_dir.read_config(out)
    assert run_dir.config_changes(cfg, old, facts) == []
    longer = config_module.from_dict(
        dict(config_module.to_dict(cfg), epochs=cfg.epochs + 5))
    assert run_dir.config_changes(longer, old, dict(
        facts, n_processes=1, acc_iters=8)) == [
        'epochs: {} → {}'.format(cfg.epochs, cfg.epochs + 5),
        'run.acc_iters: 4 → 8', 'run.n_processes: 2 → 1']
    # a baseline's own settings (config.json's lr is K-FAC's); a record
    # of an earlier version without them says nothing about them
    assert run_dir.config_changes(cfg, old, dict(
        facts, baseline={'lr': 5.0})) == []
    run_dir.write_run_config(cfg, out, dict(facts, baseline={'lr': 0.1}))
    assert run_dir.config_changes(cfg, run_dir.read_config(out), dict(
        facts, baseline={'lr': 5.0})) == ['run.baseline.lr: 0.1 → 5.0']
    # what shapes the data stream (a resume with another --seed, --resize
    # or --no-augment said nothing)
    stream = {'seed': 7, 'crop_size': 224, 'resize': 256, 'augment': True}
    recorded = run_dir.run_facts('kfac', 2, 4, 32, 'small', 8, 8, 100, 10,
                                 10, 'x', stream=stream)
    run_dir.write_run_config(cfg, out, recorded)
    assert run_dir.config_changes(cfg, run_dir.read_config(out), dict(
        recorded, stream=dict(stream, seed=0, augment=False))) == [
        'run.stream.augment: true → false', 'run.stream.seed: 7 → 0']
    for damaged in ('{not json', '[1, 2]'):
        (tmp_path / 'config.json').write_text(damaged)
        assert run_dir.read_config(out) is None

def test_a_resume_sets_aside_what_a_run_left_past_its_snapshot(tmp_path):
    """Resuming step 2 of a run that reached step 8: its snapshots of
    steps 3-8 and model_final.npz go aside, so that --resume latest after
    the next stop finds the continued run's snapshot, not step 8."""
    from harness import resume
    out = str(tmp_path)
    for step in (2, 5, 8):
        for rank in (0, 1):
            write_snapshot(str(tmp_path / 'snapshot_step_{}.rank{}'.format(
                step, rank)), 2)
    (tmp_path / 'model_final.npz').write_bytes(b'x')
    (tmp_path / 'notes.txt').write_text('mine')
    (tmp_path / 'log').write_text('[the replaced run]')
    # resuming the newest snapshot (a finished run extended) moves nothing
    assert run_dir.set_aside_later(out, 8, '20261127-120000') is None
    aside, moved = run_dir.set_aside_later(out, 2, '20261127-120000')
    assert aside == os.path.join(out, 'superseded_20261127-120000')
    assert moved == ['model_final.npz', 'snapshot_step_5.rank0',
                     'snapshot_step_5.rank1', 'snapshot_step_8.rank0',
                     'snapshot_step_8.rank1']
    assert sorted(os.listdir(aside)) == sorted(moved + ['log'])
    assert sorted(os.listdir(out)) == [
        'log', 'notes.txt', 'snapshot_step_2.rank0', 'snapshot_step_2.rank1',
        'superseded_20261127-120000']
    assert resume.latest_snapshot(out, say=None)[0].endswith(
        'snapshot_step_2')
    assert run_dir.set_aside_later(out, 2, 'again') is None
    # twice in one second: a directory of its own
    write_snapshot(str(tmp_path / 'snapshot_step_3.rank0'), 2)
    again, _ = run_dir.set_aside_later(out, 2, '20261127-120000')
    assert again == aside + '-2'
    # a user's file that merely starts so is not a run's
    (tmp_path / 'superseded_plan.txt').write_text('mine')
    files, _ = run_dir.earlier_run_files(out)
    assert 'superseded_plan.txt' not in files
    assert 'superseded_20261127-120000-2' in files
