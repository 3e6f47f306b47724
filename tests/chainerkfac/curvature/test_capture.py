"""``extract`` listens to the library's one capture and hides its extra
passes from every other listener (``capture.unobserved``)."""
import numpy

import chainer.functions as F

from chainerkfac import capture
from chainerkfac import curvature
from tests.chainerkfac import helpers
from tests.chainerkfac.curvature import nets


class Listener:
    def __init__(self, param):
        self.routes = {id(param): ((object,), 'target')}
        self.seen = 0

    def on_backward(self, target, function, in_data, out_grad, pass_info):
        self.seen += 1


def test_unobserved_passes_reach_no_capture():
    model = nets.ConvPool()
    x, t = nets.data()
    listener = Listener(model.fc.W)
    hook = capture.BackwardCapture(listener)
    hook.install()
    try:
        with capture.unobserved():
            F.softmax_cross_entropy(model(x), t).backward()
        assert listener.seen == 0
        F.softmax_cross_entropy(model(x), t).backward()
        assert listener.seen == 1
    finally:
        hook.remove()


def test_extract_leaves_a_kfac_optimizer_as_a_plain_backward_does():
    """The optimizer sees extract's gradient pass (its gradient is the
    update's), never the extra passes."""
    x, t = nets.data()
    models = [nets.ConvPool(), nets.ConvPool()]
    optimizers = [helpers.kfac().setup(m) for m in models]
    curvature.extract(models[0], x, t, mc_samples=2, quantities=(
        'batch_grad', 'kflr', 'diag_ggn_mc', 'kfra'))
    models[1].cleargrads()
    F.softmax_cross_entropy(models[1](x), t).backward()
    for optimizer in optimizers:
        optimizer.update()
    for (path, p), (_, q) in zip(models[0].namedparams(),
                                 models[1].namedparams()):
        numpy.testing.assert_array_equal(p.array, q.array, err_msg=path)
    for a, b in zip(optimizers[0].blocks, optimizers[1].blocks):
        for name in a.factors:
            numpy.testing.assert_array_equal(helpers.dense(a.factors[name]),
                                             helpers.dense(b.factors[name]))
