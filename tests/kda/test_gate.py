"""Both decay-gate parameterisations against their formulas, their ranges and their errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda.gate import lower_bound_gate, softplus_gate


def _raw(seed=0, shape=(2, 5, 3, 4)):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    f = 4.0 * jax.random.normal(keys[0], shape)
    A_log = jax.random.normal(keys[1], shape[2:3])
    dt_bias = jax.random.normal(keys[2], shape[2:])
    return f, A_log, dt_bias


def test_lower_bound_gate_formula_and_range():
    f, A_log, dt_bias = _raw()
    g = lower_bound_gate(f.astype(jnp.bfloat16), A_log, dt_bias, lower_bound=-3.0)
    u = np.asarray(f.astype(jnp.bfloat16), np.float64) + np.asarray(dt_bias, np.float64)
    rate = np.exp(np.asarray(A_log, np.float64))[:, None]
    expected = -3.0 / (1.0 + np.exp(-rate * u))
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, expected, rtol=1e-6)
    assert bool(((g > -3.0) & (g <= 0.0)).all())


def test_softplus_gate_formula_and_sign():
    f, A_log, dt_bias = _raw(1)
    g = softplus_gate(f, A_log, dt_bias)
    u = np.asarray(f, np.float64) + np.asarray(dt_bias, np.float64)
    expected = -np.exp(np.asarray(A_log, np.float64))[:, None] * np.logaddexp(0.0, u)
    np.testing.assert_allclose(g, expected, rtol=1e-6)
    assert bool((g < 0.0).all())


@pytest.mark.parametrize("bound", [-5.0001, -7.0, 0.0, 0.5])
def test_lower_bound_outside_the_tile_bound_is_refused(bound):
    with pytest.raises(ValueError, match=r"lower_bound must lie in \[-5.0, 0\).*e\^80"):
        lower_bound_gate(*_raw(), lower_bound=bound)


@pytest.mark.parametrize("bound", [-5.0, -1.0, -1e-3])
def test_lower_bounds_in_range_are_accepted(bound):
    assert float(lower_bound_gate(*_raw(), lower_bound=bound).min()) > bound


def test_gate_shape_errors_name_the_argument():
    f, A_log, dt_bias = _raw()
    with pytest.raises(ValueError, match=r"f must have rank 4"):
        softplus_gate(f[0], A_log, dt_bias)
    with pytest.raises(ValueError, match=r"A_log must have shape \[H\] = \(3,\)"):
        softplus_gate(f, A_log[:2], dt_bias)
    with pytest.raises(ValueError, match=r"dt_bias must have shape \[H, K\] = \(3, 4\)"):
        lower_bound_gate(f, A_log, dt_bias.T)
