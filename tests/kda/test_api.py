"""`kda_attention`: input validation, and how the dispatcher chooses an implementation."""

import chex
import jax
import jax.numpy as jnp
import pytest

import kda
import kda.api
from tests.kda.inputs import make_inputs


@pytest.fixture
def inputs():
    return make_inputs(0, 2, 10, 2, 4, 8, 6, initial_state=True, segments=True)


@pytest.mark.parametrize("name,bad,message", [
    ("q", jnp.zeros((2, 10, 8)), r"q must have rank 4 \[B, T, H, K\], got shape \(2, 10, 8\)"),
    ("k", jnp.zeros((2, 10, 2, 4)), r"k must have the shape of q \[B, T, H, K\] = \(2, 10, 2, 8\)"),
    ("v", jnp.zeros((2, 10, 3, 6)), r"v must have shape \[B, T, HV, V\].*multiple of H = 2"),
    ("g", jnp.zeros((2, 10, 2, 8)), r"g must have shape \[B, T, HV, K\] = \(2, 10, 4, 8\)"),
    ("beta", jnp.zeros((2, 10, 4, 1)), r"beta must have shape \[B, T, HV\] = \(2, 10, 4\)"),
    ("initial_state", jnp.zeros((2, 4, 6, 8)),
     r"initial_state must have shape \[B, HV, K, V\] = \(2, 4, 8, 6\)"),
    ("segment_ids", jnp.zeros((2, 9), jnp.int32), r"segment_ids must have shape \[B, T\]"),
    ("initial_state", jnp.zeros((2, 4, 8, 6), jnp.bfloat16), r"initial_state must be float32"),
    ("segment_ids", jnp.zeros((2, 10)), r"segment_ids must be an integer array"),
    ("v", jnp.zeros((2, 10, 4, 6), jnp.bfloat16), r"q, k and v must share one dtype"),
    ("beta", jnp.zeros((2, 10, 4), jnp.int32), r"beta must be a floating-point array"),
])
def test_bad_inputs_name_the_argument_and_expected_shape(inputs, name, bad, message):
    with pytest.raises(ValueError, match=message):
        kda.kda_attention(**{**inputs, name: bad})


def test_bad_options_are_refused(inputs):
    with pytest.raises(ValueError, match=r"gate_lower_bound must lie in \[-5.0, 0\)"):
        kda.kda_attention(**inputs, gate_lower_bound=-6.0)
    with pytest.raises(ValueError, match=r"impl must be one of \['auto', 'reference', 'chunked'"):
        kda.kda_attention(**inputs, impl="flash")


def traced(inputs, **options):
    """`kda.kda_attention(**inputs, **options)` traced, not run: the outputs' shapes and dtypes
    (`jax.ShapeDtypeStruct`s), after the same validation and choice of implementation."""
    arrays = {n: x for n, x in inputs.items() if isinstance(x, jax.Array)}
    return jax.eval_shape(
        lambda x: kda.kda_attention(**{**inputs, **x}, **options), arrays)


def test_outputs_have_the_documented_dtypes_and_shapes(inputs):
    bf16 = {n: inputs[n].astype(jnp.bfloat16) for n in ("q", "k", "v")}
    o, state = traced({**inputs, **bf16}, output_final_state=True)
    chex.assert_shape(o, (2, 10, 4, 6))
    chex.assert_type(o, jnp.bfloat16)
    chex.assert_shape(state, (2, 4, 8, 6))
    chex.assert_type(state, jnp.float32)
    assert traced(inputs)[1] is None


def test_auto_uses_a_kernel_only_for_calls_it_supports(inputs, monkeypatch):
    monkeypatch.setattr(kda.api, "_KERNELS", [])
    calls = []

    def kernel(*args, **kwargs):
        calls.append(kwargs["gate_lower_bound"])
        return kda.chunk_kda(*args, **kwargs)

    kda.register_kernel("bounded_only", kernel,
                        supports=lambda call: call.gate_lower_bound is not None)
    assert "bounded_only" in kda.available_implementations()
    traced(inputs, gate_lower_bound=-5.0)
    traced(inputs)  # unbounded gate: falls back to the chunked op
    assert calls == [-5.0]
    with pytest.raises(ValueError, match=r"impl='bounded_only' does not support this call"):
        traced(inputs, impl="bounded_only")
    with pytest.raises(ValueError, match=r"reserved"):
        kda.register_kernel("chunked", kernel, supports=lambda call: True)
