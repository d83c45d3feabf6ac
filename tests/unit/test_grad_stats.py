"""The global gradient statistics in one read of the gradients: the sum of squares over the counted
gradients, and non-finite values found in any gradient, counted or not."""

from types import SimpleNamespace

import torch

from megand.core.optimizer.grad_norm import grad_stats, read_grad_stats

TOPO = SimpleNamespace(device=torch.device("cpu"), world_size=1, tp_size=1, pp_size=1)


def _grads():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen) for n in (7, 300, 1)]


def test_sum_of_squares_over_the_counted_gradients():
    grads = _grads()
    stats = grad_stats(grads[:2], grads, TOPO, sharded=False)
    expected = sum(float((g.double() ** 2).sum()) for g in grads[:2])
    assert abs(float(stats[0]) - expected) <= 1e-6 * expected
    assert float(stats[1]) == 0
    norm, found_inf = read_grad_stats(stats)
    assert abs(norm - expected ** 0.5) <= 1e-6 * expected ** 0.5 and not found_inf


def test_non_finite_values_anywhere_are_found():
    for where, value in ((0, float("nan")), (1, float("inf")), (2, float("-inf"))):  # counted, counted, not counted
        grads = _grads()
        grads[where][0] = value
        norm, found_inf = read_grad_stats(grad_stats(grads[:2], grads, TOPO, sharded=False))
        assert found_inf, (where, value, norm)


def test_a_finite_gradient_whose_squares_overflow_is_not_finite():
    grads = _grads()
    grads[2][0] = 3e38  # finite, but its square is not
    assert read_grad_stats(grad_stats(grads[:2], grads, TOPO, sharded=False))[1]
