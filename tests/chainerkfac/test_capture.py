"""chainerkfac.capture: what a K-FAC optimizer's function hook keeps of
the backward passes it sees. Until its first update it records the graph
(eq. 20 'auto', the registration table), but only of the passes that reach
its own parameters: an optimizer set up and not used (still alive, as
objects in a reference cycle are until the collector runs) keeps nothing
of another model's passes, nor the activations they hold."""
import gc
import weakref

import numpy

import chainer.functions as F
import chainer.links as L

from tests.chainerkfac import helpers


def net():
    return helpers.ConvNet(bn=True)


def backward(model, x, t):
    loss = F.softmax_cross_entropy(model(x), t)
    loss.backward()
    return weakref.ref(loss.creator_node)


def test_an_unused_optimizer_keeps_nothing_of_another_models_passes():
    x, t = helpers.data(n=4, shape=(2, 5, 5))
    unused_model = net()
    unused = helpers.kfac(weight_rescale='auto').setup(unused_model)
    gc.collect()
    capture = unused.estimator.capture_hook
    assert capture.record_graph and capture.installed
    other = net()
    nodes = [backward(other, x, t) for _ in range(3)]
    assert unused.estimator.graph == []
    gc.collect()
    assert all(node() is None for node in nodes)   # the activations went
    # Its own model's pass is recorded whole, the loss side included
    # (held weakly until the pass reached the first K-FAC layer).
    backward(unused_model, x, t)
    recorded = [type(n.function).__name__ for n in unused.estimator.graph]
    assert recorded[0] == 'SoftmaxCrossEntropy'
    assert {'LinearFunction', 'BatchNormalization',
            'Convolution2DFunction'} <= set(recorded)


def test_the_recorded_graph_lets_the_first_update_decide_eq_20():
    """The same first update as before the change: eq. 20 'auto' decided
    from the graph (the convolution before BN is scale-invariant)."""
    x, t = helpers.data(n=4, shape=(2, 5, 5))
    model = L.Classifier(net())
    optimizer = helpers.kfac(weight_rescale='auto').setup(model)
    optimizer.update(model, x, t)
    assert optimizer.rescale.decided
    assert optimizer.estimator.graph == []      # dropped after the decision
    assert not optimizer.estimator.capture_hook.record_graph
    assert numpy.isfinite(float(model(x, t).array))


def test_an_idle_optimizer_keeps_one_pass_of_each_graph():
    """A K-FAC set up and never stepped while its model trains with
    another optimizer (a notebook's earlier cell): it keeps the first pass
    of the model's graph and the open one, not every step's (the memory of
    every step's activations grew without bound)."""
    import chainer
    x, t = helpers.data(n=4, shape=(2, 5, 5))
    model = L.Classifier(net())
    idle = helpers.kfac(weight_rescale='auto').setup(model)
    sgd = chainer.optimizers.MomentumSGD(lr=0.01).setup(model)
    nodes, lengths = [], []
    for _ in range(6):
        model.cleargrads()
        loss = model(x, t)
        loss.backward()
        nodes.append(weakref.ref(loss.creator_node))
        del loss
        sgd.update()
        lengths.append(len(idle.estimator.graph))
    gc.collect()
    one_pass = lengths[0]
    assert one_pass > 0 and lengths[1:] == [2 * one_pass] * 5
    assert nodes[0]() is not None           # the first pass, kept
    assert [n() for n in nodes[1:-1]] == [None] * 4
