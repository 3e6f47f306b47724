import chainer
import chainer.functions as F
import numpy as np
from chainer import gradient_check

from models import (SoftLabelClassifier, SmallResNet, soft_label_accuracy,
                    soft_label_cross_entropy)


def logits_and_labels(dtype=np.float32, n=5, k=4, seed=0):
    rng = np.random.RandomState(seed)
    y = rng.randn(n, k).astype(dtype)
    t_int = rng.randint(0, k, size=n).astype(np.int32)
    soft = rng.rand(n, k).astype(dtype)
    soft /= soft.sum(axis=1, keepdims=True)
    return y, t_int, soft


def test_int_labels_equal_softmax_cross_entropy():
    y, t, _ = logits_and_labels()
    expected = F.softmax_cross_entropy(y, t).array
    assert soft_label_cross_entropy(y, t).array == expected


def test_one_hot_equals_softmax_cross_entropy():
    y, t, _ = logits_and_labels()
    one_hot = np.eye(4, dtype=np.float32)[t]
    np.testing.assert_allclose(soft_label_cross_entropy(y, one_hot).array,
                               F.softmax_cross_entropy(y, t).array,
                               rtol=1e-6)


def test_soft_labels_against_numpy():
    y, _, soft = logits_and_labels(np.float64)
    z = y - y.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    expected = -(soft * log_p).sum(axis=1).mean()
    np.testing.assert_allclose(soft_label_cross_entropy(y, soft).array,
                               expected, rtol=1e-12)


def test_soft_label_gradient():
    y, _, soft = logits_and_labels(np.float64)
    gradient_check.check_backward(
        lambda y: soft_label_cross_entropy(y, soft), y, None,
        dtype=np.float64, atol=1e-7, rtol=1e-7)


def test_accuracy_uses_argmax_of_soft_labels():
    y = np.array([[2., 0., 0.], [0., 3., 0.], [0., 0., 1.]], np.float32)
    soft = np.array([[.6, .4, 0.], [.3, .3, .4], [0., .2, .8]], np.float32)
    assert soft_label_accuracy(y, soft).array == np.float32(2 / 3)
    assert soft_label_accuracy(y, np.array([0, 1, 0], np.int32)).array \
        == np.float32(2 / 3)


def test_classifier_reports_loss_and_accuracy():
    model = SoftLabelClassifier(SmallResNet(depth=8, width=4, n_class=4))
    rng = np.random.RandomState(0)
    x = rng.randn(3, 3, 16, 16).astype(np.float32)
    soft = rng.dirichlet(np.ones(4), size=3).astype(np.float32)
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)
    observation = {}
    with reporter.scope(observation):
        loss = model(x, soft)
    assert float(observation['main/loss'].array) == float(loss.array)
    expected = soft_label_cross_entropy(model.y, soft).array
    assert loss.array == expected
    assert 'main/accuracy' in observation
    # The loss reaches the weights: the classifier's gradient is that of
    # the loss written out on the predictor's logits (Chainer fills a
    # gradient with NaN until a backward pass writes it: clear first).
    model.cleargrads()
    loss.backward()
    got = model.predictor.fc.W.grad.copy()
    model.cleargrads()
    soft_label_cross_entropy(model.predictor(x), soft).backward()
    expected = model.predictor.fc.W.grad
    assert np.isfinite(expected).all() and abs(expected).max() > 0
    np.testing.assert_array_equal(got, expected)   # the same operations
