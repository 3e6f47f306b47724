"""The seed's experiment scripts run end to end on tiny sizes and write
their PNG and JSON."""
import json

import pytest

from experiments.layer_parallel import convergence
from experiments.layer_parallel import kfac_training
from experiments.layer_parallel import training


def test_convergence_script(tmp_path):
    convergence.main(['--layers', '16,32', '--cases', 'peaks',
                      '--iterations', '5', '--batch', '10',
                      '--out', str(tmp_path)])
    with open(tmp_path / 'fig4_convergence.json') as f:
        result = json.load(f)
    runs = result['results']['peaks']['smooth']
    assert [run['layers'] for run in runs] == [16, 32]
    # Two levels, FCF: exact after 2 V-cycles (16 < (2·2 + 1)·4), where
    # the solve stops on a zero residual; 32 layers run the 5 iterations.
    assert runs[0]['state_iterations'] == 2 and runs[0]['state'][2] == 0
    assert len(runs[1]['state']) == 5
    assert (tmp_path / 'fig4_convergence.png').stat().st_size > 10000


@pytest.mark.slow
def test_training_script(tmp_path):
    """Under mpiexec -n 2; exact solves at 16 layers (2 V-cycles), so both
    runs take the same steps."""
    training.main(['--layers', '16', '--iterations', '6', '--eval-every',
                   '3', '--at-scale', '32:8', '--out', str(tmp_path)])
    with open(tmp_path / 'table2_training.json') as f:
        result = json.load(f)
    assert result['table']['validation_gap_points'] == 0
    assert [r['iteration'] for r in result['parallel']] == [0, 3, 6]
    assert (tmp_path / 'fig7_training.png').stat().st_size > 10000


@pytest.mark.slow
def test_kfac_training_script(tmp_path):
    """Under mpiexec -n 2 (two replicas of one layer group): both
    optimizers on both cases, K-FAC's blocks refreshed from the first
    step, the table's steps and accuracies from the histories."""
    kfac_training.main(['--cases', 'peaks,digits', '--layers', '8',
                        '--steps', '4', '--eval-every', '2',
                        '--digits-train', '20', '--processes', '2',
                        '--layer-procs', '1', '--targets', '0.0,1.0',
                        '--out', str(tmp_path)])
    with open(tmp_path / 'kfac_training.json') as f:
        result = json.load(f)
    # the study's K-FAC, not the library's defaults, and said so
    assert result['kfac_options'] == {
        'refresh_interval_a': 1, 'refresh_interval_g': 1,
        'refresh_interval_f': 1, 'kl_clip': None, 'low_rank': False}
    for case in ('peaks', 'digits'):
        runs = result['runs'][case]
        assert runs['kfac']['all_blocks_refreshed_at_step_0'] == 1
        for name in ('adam', 'kfac'):
            assert [r['step'] for r in runs[name]['history']] == [0, 2, 4]
            row = result['table'][case][name]
            assert row['steps_to'] == {'0.0': 0, '1.0': next(
                (r['step'] for r in runs[name]['history']
                 if r['validation'] >= 1.0), None)}
            assert row['final_validation'] == \
                runs[name]['history'][-1]['validation']
        # Same initial weights: the same accuracy before the first step.
        assert runs['adam']['history'][0] == runs['kfac']['history'][0]
    assert (tmp_path / 'fig_kfac_training.png').stat().st_size > 10000
