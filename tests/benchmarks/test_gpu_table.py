"""benchmarks/gpu_table.py on a CPU: the README's GPU table from
step_time results, by hand-made results whose figures are known."""
import json

import pytest

from benchmarks import gpu_table


def _row(batch, median, **extra):
    return dict({'model': 'resnet50', 'batch': batch, 'median_s': median,
                 'failed': {}}, **extra)


def _peer(median):
    return {'median_s': median}


def _write(path, **data):
    path.write_text(json.dumps(dict({'benchmark': 'step_time', 'gpu': True,
                                     'refresh_interval': 20}, **data)))
    return str(path)


def test_the_table_rests_only_on_what_ran_as_named(tmp_path, capsys):
    """Images/s are batch over median; a variant that failed (what it
    timed may be an eager step under a replayed name) and a graph never
    replayed are left out and said so; a later file fills only what the
    earlier ones lack; the amortised cycle is 1 refresh step and 19
    stale ones (with a recapture where the refresh dropped the graph)."""
    run = _write(
        tmp_path / 'b32.json',
        results=[_row(32, {'sgd': 0.1, 'sgd_graph': 0.02,
                           'kfac_stale_graph': 0.03,
                           'kfac_every_graph': 0.2, 'kfac_every': 0.4,
                           'kfac_low_rank': 0.5},
                      failed={'kfac_low_rank': 'kfac_low_rank (round 1): '
                              'OutOfMemoryError: Out of memory'},
                      refresh_cycle={'kfac_stale_graph': {
                          'recapture_s': 0.1}})],
        peer_pytorch=_peer({'sgd': 0.025, 'kfac_inverse': 0.4,
                            'kfac_inverse_stale': 0.04}))
    sweep = _write(
        tmp_path / 'sweep.json',
        sweep=[_row(32, {'sgd': 1.0, 'kfac_low_rank': 0.4},
                    peer_pytorch=_peer({'sgd': 1.0})),
               _row(64, {'sgd': 0.2, 'sgd_graph': 0.04},
                    not_replayed=['sgd_graph'],
                    peer_pytorch={'skipped': 'no PyTorch'}),
               {'model': 'resnet50', 'batch': 128, 'images_per_s': {},
                'failed': 'its process ended with exit status 1'}])
    points = gpu_table.merge([run, sweep])
    b32 = points[32]
    assert b32['ours']['sgd'] == pytest.approx(320)       # the first file
    assert b32['ours']['kfac_low_rank'] == pytest.approx(80)   # the 2nd
    assert b32['peer']['sgd'] == pytest.approx(1280)
    cycle = 0.2 + 0.1 + 19 * 0.03
    assert b32['ours'][gpu_table.step_time.REPLAYED_REFRESH] == \
        pytest.approx(32 * 20 / cycle)
    assert b32['peer']['kfac_inverse_stale_amortised'] == pytest.approx(
        32 * 20 / (0.4 + 19 * 0.04))
    assert any('kfac_low_rank (round 1): OutOfMemoryError' in d
               for d in b32['dropped'])
    assert 'sgd_graph' not in points[64]['ours']
    assert any('sgd_graph (never replayed)' in d
               for d in points[64]['dropped'])
    assert points[128]['ours'] == {}
    assert gpu_table.main([run, sweep]) == 0
    text = capsys.readouterr().out
    header, rule, sgd_row = text.splitlines()[:3]
    assert header.startswith('| images/s | ours, b32 | peer, b32 | ours, '
                             'b64')
    assert sgd_row.split(' | ')[1:3] == ['1600', '1280']
    assert '| – |' in text


def test_a_file_not_of_step_time_is_refused(tmp_path):
    path = tmp_path / 'other.json'
    path.write_text(json.dumps({'benchmark': 'kernel_profile'}))
    with pytest.raises(SystemExit, match='not a step_time --gpu result'):
        gpu_table.merge([str(path)])
