import numpy as np
import pytest

from augment import RunningMixup, running_mixup_streams


def batches(seed=0):
    rng = np.random.RandomState(seed)
    xs = [rng.rand(3, 2, 4, 4).astype(np.float32) for _ in range(3)]
    ts = [rng.randint(0, 5, size=3).astype(np.int32) for _ in range(3)]
    return xs, ts


def test_running_mixup_against_hand_computation():
    xs, ts = batches()
    mixup = RunningMixup(alpha=0.4, n_class=5, seed=123)
    # The λ sequence: the first batch draws none, then one per step.
    lam = np.random.default_rng(123).beta(0.4, 0.4, size=2)
    eye = np.eye(5, dtype=np.float64)

    x0, y0 = mixup(xs[0], ts[0])
    np.testing.assert_array_equal(x0, xs[0])  # first batch unmixed
    np.testing.assert_array_equal(y0, eye[ts[0]])
    assert mixup.last_lambda == 1.0
    assert x0 is not xs[0]

    x1, y1 = mixup(xs[1], ts[1])
    x1_hand = lam[0] * xs[1] + (1 - lam[0]) * xs[0]
    y1_hand = lam[0] * eye[ts[1]] + (1 - lam[0]) * eye[ts[0]]
    np.testing.assert_allclose(x1, x1_hand, rtol=1e-6)
    np.testing.assert_allclose(y1, y1_hand, rtol=1e-6)
    assert mixup.last_lambda == lam[0]

    # The partner is the previous *virtual* batch, not the raw one.
    x2, y2 = mixup(xs[2], ts[2])
    x2_hand = lam[1] * xs[2] + (1 - lam[1]) * x1_hand
    y2_hand = lam[1] * eye[ts[2]] + (1 - lam[1]) * y1_hand
    np.testing.assert_allclose(x2, x2_hand, rtol=1e-5)
    np.testing.assert_allclose(y2, y2_hand, rtol=1e-6)
    assert x2.dtype == np.float32 and y2.dtype == np.float32
    assert y2.shape == (3, 5)
    np.testing.assert_allclose(y2.sum(axis=1), 1, rtol=1e-6)


def test_partner_survives_later_in_place_augmentation():
    xs, ts = batches()
    mixup = RunningMixup(alpha=1.0, n_class=5, seed=0)
    reference = RunningMixup(alpha=1.0, n_class=5, seed=0)
    x0, y0 = mixup(xs[0], ts[0])
    reference(xs[0], ts[0])
    x0[...] = 0  # e.g. random erasing in place
    y0[...] = 0
    x1, y1 = mixup(xs[1], ts[1])
    r1, s1 = reference(xs[1], ts[1])
    np.testing.assert_array_equal(x1, r1)
    np.testing.assert_array_equal(y1, s1)


def test_inputs_not_mutated_and_soft_labels_accepted():
    xs, ts = batches()
    x_before = xs[1].copy()
    soft = np.full((3, 5), 0.2, dtype=np.float32)
    mixup = RunningMixup(alpha=1.0, n_class=5, seed=0)
    mixup(xs[0], ts[0])
    _, y = mixup(xs[1], soft)
    np.testing.assert_array_equal(xs[1], x_before)
    np.testing.assert_allclose(y.sum(axis=1), 1, rtol=1e-6)


def test_reset_starts_a_new_stream():
    xs, ts = batches()
    mixup = RunningMixup(alpha=1.0, n_class=5, seed=0)
    mixup(xs[0], ts[0])
    mixup.reset()
    assert mixup.last_lambda is None
    x, _ = mixup(xs[1], ts[1])
    np.testing.assert_array_equal(x, xs[1])


def test_errors():
    xs, ts = batches()
    with pytest.raises(ValueError, match='positive'):
        RunningMixup(alpha=0, n_class=5)
    mixup = RunningMixup(alpha=1.0, n_class=5)
    with pytest.raises(ValueError, match=r'\[0, 5\)'):
        mixup(xs[0], np.array([0, 5, 1], np.int32))
    mixup(xs[0], ts[0])
    with pytest.raises(ValueError, match='reset'):
        mixup(xs[1][:2], ts[1][:2])


def test_streams_are_independent():
    xs, ts = batches()
    streams = running_mixup_streams(2, alpha=1.0, n_class=5, seed=7)
    for stream in streams:
        stream(xs[0], ts[0])
    a, _ = streams[0](xs[1], ts[1])
    b, _ = streams[1](xs[1], ts[1])
    assert streams[0].last_lambda != streams[1].last_lambda
    assert not np.array_equal(a, b)
