"""core.norms: RMSNorm against its formula, its float32 arithmetic and its output dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.norms import RMSNorm, rms_norm


def test_rms_norm_is_its_formula_in_float32():
    x = jax.random.normal(jax.random.key(0), (3, 5, 8)) * 7.0
    gain = jax.random.uniform(jax.random.key(1), (8,), minval=0.5, maxval=2.0)
    x64, gain64 = np.asarray(x, np.float64), np.asarray(gain, np.float64)
    expected = x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + 1e-6) * gain64
    np.testing.assert_allclose(rms_norm(x, gain, 1e-6), expected, rtol=1e-5)


def test_rms_norm_casts_to_the_input_or_the_asked_dtype():
    x = jax.random.normal(jax.random.key(0), (4, 16), jnp.bfloat16) * 300.0
    gain = jnp.ones(16)
    assert rms_norm(x, gain, 1e-5).dtype == jnp.bfloat16
    full = rms_norm(x, gain, 1e-5, dtype=jnp.float32)
    assert full.dtype == jnp.float32
    # The sum of squares is taken in float32: bf16 squares of ~300 would lose the mean's digits.
    x32 = np.asarray(x, np.float32)
    expected = x32 / np.sqrt(np.mean(x32**2, axis=-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(full, expected, rtol=1e-6)


def test_rms_norm_module_is_the_function_with_its_gain():
    norm = RMSNorm(8, eps=1e-5, axis_name="embed", dtype=jnp.bfloat16)
    norm.scale[...] = jnp.arange(1.0, 9.0)
    x = jax.random.normal(jax.random.key(2), (2, 8))
    out = norm(x)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, rms_norm(x, jnp.arange(1.0, 9.0), 1e-5, dtype=jnp.bfloat16))
    assert nnx.state(norm, nnx.Param)["scale"].get_metadata()["out_sharding"] == ("embed",)
