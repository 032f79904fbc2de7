"""The chunked KDA op against the token-by-token oracle, and the oracle against calculus."""

import chex
import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest

import kda
from experiments.harness import relative_error
from kda.common import prepare_qk, prepare_qk_vjp
from tests.kda.calls import jitted_run, loss_and_grads, run
from tests.kda.inputs import make_inputs
from tests.kda.tolerances import BF16_TOLERANCE, F32_TOLERANCE, assert_within_bf16_tolerances


# (seed, batch, length, (H, HV), (K, V), gate, gate_lower_bound, initial state, documents):
# together every value of each: T of one token, part of a chunk, whole chunks, several chunks
# with a padded tail; one q/k head per value head or shared by two; K = V, K < V and K > V; both
# gate forms, the bounded path and the unbounded one (also for the lower-bound gate); with and
# without an initial state and packed documents. The first two share their compiled programs
# with `test_packed_documents_equal_separate_runs` and `test_splitting_a_sequence_...` below.
MATCH_CASES = {
    "T=128 GVA softplus documents": (7, 1, 128, (1, 2), (16, 16), "softplus", None, True, True),
    "T=150 K<V": (6, 2, 150, (2, 2), (16, 32), "lower_bound", None, True, False),
    "T=1": (11, 1, 1, (1, 1), (16, 16), "softplus", None, False, False),
    "T=37 bounded documents": (12, 2, 37, (2, 4), (32, 16), "lower_bound", -5.0, False, True),
    "T=130 GVA bounded documents": (14, 2, 130, (1, 2), (32, 16), "lower_bound", -5.0, True,
                                    True),
}


def match_inputs(case):
    """`make_inputs` of a `MATCH_CASES` case, and the chunked op's options: its gate_lower_bound
    where it has one (no option otherwise, as the tests that share its programs call it)."""
    seed, batch, length, heads, dims, gate, lower_bound, initial_state, segments = (
        MATCH_CASES[case])
    inputs = make_inputs(seed, batch, length, *heads, *dims, gate=gate,
                         initial_state=initial_state, segments=segments)
    return inputs, {} if lower_bound is None else {"gate_lower_bound": lower_bound}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MATCH_CASES))
def test_chunked_matches_reference_in_float32(case):
    inputs, options = match_inputs(case)
    o_ref, state_ref = jitted_run("reference", inputs)
    o, state = jitted_run("chunked", inputs, **options)
    assert relative_error(o, o_ref) <= F32_TOLERANCE
    assert relative_error(state, state_ref) <= F32_TOLERANCE


# Each path on a case above with an initial state and documents over several chunks: its 64-token
# chunks are the program that test compiles.
@pytest.mark.parametrize("case", ["T=128 GVA softplus documents", "T=130 GVA bounded documents"])
def test_chunk_sizes_agree(case):
    inputs, options = match_inputs(case)
    o64, s64 = jitted_run("chunked", inputs, **options)
    use_qk_l2norm = inputs.pop("use_qk_l2norm")
    for chunk_size in (16, 32):
        o, s = jax.jit(lambda x: kda.chunk_kda(
            **x, scale=x["q"].shape[-1] ** -0.5, output_final_state=True,
            use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, **options))(inputs)
        assert relative_error(o, o64) <= F32_TOLERANCE, chunk_size
        assert relative_error(s, s64) <= F32_TOLERANCE, chunk_size


def gradient_inputs(dtype, gate="lower_bound"):
    """The gradient tests' inputs (initial state, documents): float32 [B=1, T=80, H=1, HV=2,
    K=V=16]; bf16 [B=2, T=200, H=2, HV=4, K=V=64]."""
    if dtype == jnp.float32:
        return make_inputs(4, 1, 80, 1, 2, 16, 16, gate=gate, initial_state=True, segments=True)
    return make_inputs(3, 2, 200, 2, 4, 64, 64, gate=gate, dtype=jnp.bfloat16,
                       initial_state=True, segments=True)


@pytest.mark.slow
@pytest.mark.parametrize("gate,lower_bound", [("lower_bound", -5.0), ("softplus", None)])
def test_bfloat16_within_fla_tolerances(gate, lower_bound):
    inputs = gradient_inputs(jnp.bfloat16, gate)
    expected = loss_and_grads("reference", inputs, None)
    actual = loss_and_grads("chunked", inputs, lower_bound)
    assert actual["o"].dtype == jnp.bfloat16 and actual["state"].dtype == jnp.float32
    assert_within_bf16_tolerances(actual, expected)


@pytest.mark.slow
@pytest.mark.parametrize("gate,lower_bound", [("lower_bound", -5.0), ("softplus", None)])
def test_chunked_gradients_match_reference_in_float32(gate, lower_bound):
    inputs = gradient_inputs(jnp.float32, gate)
    expected = loss_and_grads("reference", inputs, None)
    actual = loss_and_grads("chunked", inputs, lower_bound)
    for name in expected:
        assert relative_error(actual[name], expected[name]) <= 1e-4, name


@pytest.mark.slow
def test_reference_gradients_match_finite_differences():
    names = ("q", "k", "v", "g", "beta", "initial_state")
    with jax.enable_x64(True):
        inputs = make_inputs(5, 1, 6, 1, 2, 4, 3, gate="softplus", initial_state=True,
                             segments=True)
        inputs = {n: x.astype(jnp.float64) if n in names else x for n, x in inputs.items()}
        names = ("q", "k", "v", "g", "beta", "initial_state")

        @jax.jit  # one program for every evaluation of check_grads (and one for its VJP)
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
    # Two halves of 75 tokens, split inside a chunk: one program for both.
    o1, state1 = jitted_run(impl, time_slice(inputs, 0, 75, inputs["initial_state"]))
    o2, state2 = jitted_run(impl, time_slice(inputs, 75, 150, state1))
    assert relative_error(jnp.concatenate([o1, o2], axis=1), o_whole) <= F32_TOLERANCE
    assert relative_error(state2, state_whole) <= F32_TOLERANCE


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_packed_documents_equal_separate_runs(impl):
    # The second document starts mid-chunk and crosses a chunk boundary; the last two, which
    # start from zero, are alike (one program for both).
    lengths = (30, 49, 49)
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
    """Gates saturated at the bound and gates down to -1000, on the gradient tests' inputs (their
    documents, 44 and 136 tokens the longest, span chunk boundaries), and so with the chunked
    gradients those tests compiled: the documents are constants of those programs."""
    base = gradient_inputs(dtype)
    saturated = {**base, "g": jnp.full_like(base["g"], -5.0)}
    huge = {**base, "g": -1000.0 * jax.random.uniform(jax.random.PRNGKey(0), base["g"].shape)}
    for inputs, lower_bound in ((saturated, -5.0), (huge, None)):
        grads = loss_and_grads("chunked", inputs, lower_bound)
        chex.assert_tree_all_finite(grads)
        o_ref, state_ref = jitted_run("reference", inputs)
        assert relative_error(grads["o"], o_ref) <= (F32_TOLERANCE if dtype == jnp.float32
                                                     else BF16_TOLERANCE["o"])
        assert relative_error(grads["state"], state_ref) <= F32_TOLERANCE


# Each path, on the inputs (and so the programs) of a case above.
@pytest.mark.parametrize("case", ["T=128 GVA softplus documents", "T=130 GVA bounded documents"])
def test_future_tokens_never_change_past_outputs(case):
    inputs, options = match_inputs(case)
    o, _ = jitted_run("chunked", inputs, **options)
    changed = {n: x.at[:, 70:].set(x[:, 70:] * 0.5) if n in ("q", "k", "v", "g", "beta") else x
               for n, x in inputs.items()}
    o_changed, _ = jitted_run("chunked", changed, **options)
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
