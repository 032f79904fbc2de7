"""The error bars the KDA tests hold outputs and gradients to, and the assertion that applies them.

Errors are `experiments.harness.relative_error` (L2: ||actual - expected|| / ||expected||, fla's
relative RMSE). float32 paths agree with the oracle to `F32_TOLERANCE`; bf16 paths to fla's bf16
bars (`BF16_TOLERANCE`, by output or gradient name). `bf16_ulp` is for element-wise checks of
kernels that compute what their oracle computes and round it to bf16 once.
"""

import numpy as np

from experiments.harness import relative_error

F32_TOLERANCE = 1e-5
# fla's bf16 bars (relative RMSE): outputs and state, dq/dk/dv/dh0, dg/dbeta.
BF16_TOLERANCE = {"o": 5e-3, "state": 5e-3, "q": 8e-3, "k": 8e-3, "v": 8e-3,
                  "initial_state": 8e-3, "g": 2e-2, "beta": 2e-2}
# fla's bar for first-order gradients in bf16 (dq, dk, dv, dh0), for every recurrence cotangent.
GRADIENT_TOLERANCE = BF16_TOLERANCE["q"]


def assert_within_bf16_tolerances(actual, expected):
    """Every output and gradient of `tests.kda.calls.loss_and_grads` within fla's bf16 bars, and
    the same ones (an initial state's gradient only where the call had one)."""
    assert actual.keys() == expected.keys()
    for name in expected:
        assert relative_error(actual[name], expected[name]) <= BF16_TOLERANCE[name], name


def bf16_ulp(x):
    """The spacing of bf16 numbers (8 significant bits) at each element of bf16 x, in float32."""
    magnitude = np.abs(np.asarray(x, np.float32))
    tiniest = np.float32(2.0**-133)  # bf16's smallest subnormal
    return np.where(magnitude > 0, 2.0 ** (np.floor(np.log2(np.maximum(magnitude, tiniest))) - 7),
                    tiniest)
