"""The worker's numerics figure (`xla_worker.max_relative`)."""

from __future__ import annotations

import pytest

from partir_torch.backends.xla_worker import REL_FLOOR, max_relative


def test_a_tensor_that_stays_about_zero_is_compared_against_the_floor_not_its_own_noise():
    # a key bias: zero gradient in exact arithmetic, fp32 noise of 6e-12 in both runs, differing by as much
    assert max_relative([(6.2e-12, 6.5e-12), (1e-9, 1.0)]) == pytest.approx(6.2e-12 / REL_FLOOR)
    assert max_relative([(6.2e-12, 6.5e-12)]) < 1e-5
    # a tensor of real size keeps its own scale: 1e-4 off on values of 1e-3 is 10 % off
    assert max_relative([(1e-4, 1e-3), (0.0, 5.0)]) == pytest.approx(0.1)
    assert max_relative([]) == 0.0
