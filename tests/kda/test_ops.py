"""The chunked KDA op against the token-by-token oracle, and the oracle against calculus."""

import chex
import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kda
from experiments.harness import relative_error
from kda.common import prepare_qk, prepare_qk_vjp
from tests.kda.calls import jitted_run, loss_and_grads, run
from tests.kda.inputs import make_inputs
from tests.kda.tolerances import BF16_TOLERANCE, F32_TOLERANCE, assert_within_bf16_tolerances


@pytest.mark.slow
@settings(deadline=None, max_examples=8)
@given(
    seed=st.integers(0, 2**16),
    batch=st.sampled_from([1, 2]),
    length=st.sampled_from([1, 37, 64, 130]),
    heads=st.sampled_from([(1, 1), (2, 2), (1, 2), (2, 4)]),
    dims=st.sampled_from([(16, 16), (32, 16)]),
    gate=st.sampled_from(["lower_bound", "softplus"]),
    bounded_path=st.booleans(),
    initial_state=st.booleans(),
    segments=st.booleans(),
)
def test_chunked_matches_reference_in_float32(seed, batch, length, heads, dims, gate,
                                              bounded_path, initial_state, segments):
    inputs = make_inputs(seed, batch, length, *heads, *dims, gate=gate,
                         initial_state=initial_state, segments=segments)
    lower_bound = -5.0 if gate == "lower_bound" and bounded_path else None
    # Eagerly: each example has shapes of its own, and eager dispatch compiles each operation
    # once for all examples of its shape where `jitted_run` would compile every example whole.
    o_ref, state_ref = run("reference", inputs)
    o, state = run("chunked", inputs, gate_lower_bound=lower_bound)
    assert relative_error(o, o_ref) <= F32_TOLERANCE
    assert relative_error(state, state_ref) <= F32_TOLERANCE


@pytest.mark.parametrize("gate_lower_bound", [None, -5.0])
def test_chunk_sizes_agree(gate_lower_bound):
    inputs = make_inputs(0, 2, 100, 2, 2, 32, 32, initial_state=True, segments=True)
    use_qk_l2norm = inputs.pop("use_qk_l2norm")

    def chunked(chunk_size):
        return jax.jit(lambda x: kda.chunk_kda(
            **x, scale=32**-0.5, output_final_state=True, use_qk_l2norm=use_qk_l2norm,
            gate_lower_bound=gate_lower_bound, chunk_size=chunk_size))(inputs)

    o64, s64 = chunked(64)
    for chunk_size in (16, 32):
        o, s = chunked(chunk_size)
        assert relative_error(o, o64) <= F32_TOLERANCE
        assert relative_error(s, s64) <= F32_TOLERANCE


@pytest.mark.parametrize("gate,lower_bound", [("lower_bound", -5.0), ("softplus", None)])
def test_bfloat16_within_fla_tolerances(gate, lower_bound):
    inputs = make_inputs(3, 2, 200, 2, 4, 64, 64, gate=gate, dtype=jnp.bfloat16,
                         initial_state=True, segments=True)
    expected = loss_and_grads("reference", inputs, None)
    actual = loss_and_grads("chunked", inputs, lower_bound)
    assert actual["o"].dtype == jnp.bfloat16 and actual["state"].dtype == jnp.float32
    assert_within_bf16_tolerances(actual, expected)


@pytest.mark.parametrize("gate,lower_bound", [("lower_bound", -5.0), ("softplus", None)])
def test_chunked_gradients_match_reference_in_float32(gate, lower_bound):
    inputs = make_inputs(4, 1, 80, 1, 2, 16, 16, gate=gate, initial_state=True, segments=True)
    expected = loss_and_grads("reference", inputs, None)
    actual = loss_and_grads("chunked", inputs, lower_bound)
    for name in expected:
        assert relative_error(actual[name], expected[name]) <= 1e-4, name


def test_reference_gradients_match_finite_differences():
    names = ("q", "k", "v", "g", "beta", "initial_state")
    with jax.enable_x64(True):
        inputs = make_inputs(5, 1, 6, 1, 2, 4, 3, gate="softplus", initial_state=True,
                             segments=True)
        inputs = {n: x.astype(jnp.float64) if n in names else x for n, x in inputs.items()}
        names = ("q", "k", "v", "g", "beta", "initial_state")

        def loss(*args):
            o, state = kda.kda_reference(**{**inputs, **dict(zip(names, args))}, scale=0.5,
                                         output_final_state=True)
            return jnp.sum(jnp.sin(o)) + jnp.sum(state**2)

        jax.test_util.check_grads(loss, [inputs[n] for n in names], order=1, modes=["rev"],
                                  atol=1e-6, rtol=1e-6, eps=1e-6)


def test_reference_in_rematerialised_blocks_equals_the_plain_scan(monkeypatch):
    """Past `KEPT_STATES_MAX_BYTES` the oracle scans blocks of tokens whose states its gradient
    recomputes: the output, final state and every gradient are the plain scan's, to the bit
    (T = 150 pads the last block; documents restart inside blocks)."""
    inputs = make_inputs(7, 2, 150, 1, 2, 16, 16, gate="softplus", initial_state=True,
                         segments=True)
    plain = loss_and_grads("reference", inputs, None)
    monkeypatch.setattr(kda.reference, "KEPT_STATES_MAX_BYTES", 0)
    blocked = loss_and_grads("reference", inputs, None)
    assert blocked.keys() == plain.keys()
    for name in plain:
        np.testing.assert_array_equal(blocked[name], plain[name], err_msg=name)


def time_slice(inputs, start, stop, initial_state=None):
    """The inputs of tokens [start, stop), continuing from `initial_state`."""
    sliced = {n: inputs[n][:, start:stop] for n in ("q", "k", "v", "g", "beta", "segment_ids")
              if n in inputs}
    return {**sliced, "initial_state": initial_state, "use_qk_l2norm": inputs["use_qk_l2norm"]}


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_splitting_a_sequence_and_carrying_the_state_equals_the_whole(impl):
    inputs = make_inputs(6, 2, 150, 2, 2, 16, 32, initial_state=True)
    o_whole, state_whole = jitted_run(impl, inputs)
    o1, state1 = jitted_run(impl, time_slice(inputs, 0, 70, inputs["initial_state"]))
    o2, state2 = jitted_run(impl, time_slice(inputs, 70, 150, state1))
    assert relative_error(jnp.concatenate([o1, o2], axis=1), o_whole) <= F32_TOLERANCE
    assert relative_error(state2, state_whole) <= F32_TOLERANCE


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_packed_documents_equal_separate_runs(impl):
    lengths = (15, 70, 43)  # crosses chunk boundaries and starts mid-chunk
    inputs = make_inputs(7, 1, sum(lengths), 1, 2, 16, 16, gate="softplus", initial_state=True)
    segment_ids = jnp.repeat(jnp.arange(len(lengths)), np.array(lengths))[None]
    o_packed, state_packed = jitted_run(impl, {**inputs, "segment_ids": segment_ids})
    bounds = np.cumsum((0,) + lengths)
    # Only the first document continues the initial state; the others start from zero.
    separate = [jitted_run(impl, time_slice(inputs, start, stop,
                                            inputs["initial_state"] if start == 0 else None))
                for start, stop in zip(bounds[:-1], bounds[1:])]
    assert relative_error(o_packed, jnp.concatenate([o for o, _ in separate], axis=1)) <= (
        F32_TOLERANCE)
    assert relative_error(state_packed, separate[-1][1]) <= F32_TOLERANCE


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_extreme_gates_stay_finite_and_exact(dtype):
    base = make_inputs(8, 1, 300, 2, 2, 32, 32, dtype=dtype, initial_state=True)
    saturated = {**base, "g": jnp.full_like(base["g"], -5.0)}
    huge = {**base, "g": -1000.0 * jax.random.uniform(jax.random.PRNGKey(0), base["g"].shape)}
    for inputs, lower_bound in ((saturated, -5.0), (huge, None)):
        grads = loss_and_grads("chunked", inputs, lower_bound)
        chex.assert_tree_all_finite(grads)
        o_ref, state_ref = jitted_run("reference", inputs)
        assert relative_error(grads["o"], o_ref) <= (F32_TOLERANCE if dtype == jnp.float32
                                                     else BF16_TOLERANCE["o"])
        assert relative_error(grads["state"], state_ref) <= F32_TOLERANCE


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_future_tokens_never_change_past_outputs(lower_bound):
    inputs = make_inputs(9, 1, 128, 1, 1, 16, 16)
    o, _ = jitted_run("chunked", inputs, gate_lower_bound=lower_bound)
    changed = {n: x.at[:, 70:].set(x[:, 70:] * 0.5) if n in ("q", "k", "v", "g", "beta") else x
               for n, x in inputs.items()}
    o_changed, _ = jitted_run("chunked", changed, gate_lower_bound=lower_bound)
    np.testing.assert_array_equal(o[:, :70], o_changed[:, :70])
    assert not np.array_equal(o[:, 70:], o_changed[:, 70:])


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
@pytest.mark.parametrize("heads,value_heads", [(2, 2), (1, 3)])
def test_prepare_qk_vjp_equals_autodiff(use_qk_l2norm, heads, value_heads):
    """The kernels' explicit VJP of the q/k preparation (L2 norm, scale, grouped value heads)."""
    keys = jax.random.split(jax.random.PRNGKey(5), 4)
    q, k = (jax.random.normal(key, (2, 40, heads, 64)) * 3.0 for key in keys[:2])
    d_q, d_k = (jax.random.normal(key, (2, 40, value_heads, 64)) for key in keys[2:])
    options = dict(scale=0.125, use_qk_l2norm=use_qk_l2norm)
    _, vjp = jax.vjp(lambda q, k: prepare_qk(q, k, num_value_heads=value_heads, **options), q, k)
    for actual, expected in zip(prepare_qk_vjp(q, k, d_q, d_k, **options), vjp((d_q, d_k))):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())
