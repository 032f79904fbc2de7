"""Sequence parallelism for the KDA recurrence and its reversed (backward) recurrence
(`kda.kernels.mosaic_gpu.sequence_parallel`).

The scheme in plain JAX (segments run by `chunk_recurrence`, or by a float32 scan of the reversed
recurrence) must equal the unsplit recurrence (or its `jax.vjp`) to float32 rounding; the combine
must equal a sequential loop over segments; the kernels on P segments (interpret mode on a
simulated Hopper, with race detection) must equal the kernels on one and the plain-JAX recurrence
within fla's bf16 bars; on a Hopper GPU the whole forward (preparation kernel, then the
sequence-parallel recurrence) and the recurrence's VJP must match the oracles on long single
sequences.

Inputs use slow gates (g / 100, in (-0.05, 0)) wherever the combine is under test: with the
default gates in (-5, 0) the state is forgotten within a chunk or two, so segments started from
zero would already be almost right and a broken combine would go unnoticed.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.harness import relative_error
from kda.chunked import (CHUNK_SIZE, ChunkedInputs, chunk_recurrence, chunks_to_tokens,
                         prepare_chunks)
from kda.common import einsum
from kda.kernels.mosaic_gpu import sequence_parallel
from kda.kernels.mosaic_gpu.common import recurrence_operands
from kda.kernels.mosaic_gpu.prepare import prepare_chunks_kernel
from kda.kernels.mosaic_gpu.sequence_parallel import (choose_num_segments, combine_segments,
                                                      recurrence_in_segments,
                                                      reversed_recurrence_in_segments,
                                                      sequence_parallel_recurrence,
                                                      sequence_parallel_reversed_recurrence,
                                                      split_into_segments)
from tests.kda.calls import run
from tests.kda.inputs import make_inputs
from tests.kda.kernels.hopper import HOPPER, interpreted_on_simulated_hopper
from tests.kda.kernels.recurrences import (abstract_operands, jitted_vjp, kernel_recurrence,
                                           plain_recurrence)
from tests.kda.tolerances import BF16_TOLERANCE, F32_TOLERANCE, GRADIENT_TOLERANCE

SLOW_GATE_FACTOR = 0.01


def slow_gate_inputs(seed, length, value_heads, key_dim, value_dim, *, dtype=jnp.float32,
                     **options):
    """`make_inputs` (one batch row, q/k heads = value heads) with gates in (-0.05, 0)."""
    inputs = make_inputs(seed, 1, length, value_heads, value_heads, key_dim, value_dim,
                         dtype=dtype, **options)
    return {**inputs, "g": inputs["g"] * SLOW_GATE_FACTOR}


def chunks_of(inputs):
    """The plain-JAX preparation (float32 `ChunkedInputs`) and the initial state (zeros if none)."""
    q, k, v, g, beta = (inputs[name] for name in ("q", "k", "v", "g", "beta"))
    chunks = jax.jit(lambda *xs, segment_ids: prepare_chunks(
        *xs, scale=q.shape[-1] ** -0.5, segment_ids=segment_ids,
        use_qk_l2norm=inputs["use_qk_l2norm"], gate_lower_bound=None,
        chunk_size=CHUNK_SIZE))(q, k, v, g, beta, segment_ids=inputs.get("segment_ids"))
    batch, _, heads, value_dim = v.shape
    state = inputs.get("initial_state")
    if state is None:
        state = jnp.zeros((batch, heads, q.shape[-1], value_dim), jnp.float32)
    return chunks, state


# The combine and the scheme in plain JAX.


@functools.cache
def slow_gate_chunks(segments: bool):
    """Float32 `ChunkedInputs` (N = 8, HV = 2, K = 32, V = 16) and an initial state, prepared once;
    tests take the first n chunks (a shorter sequence)."""
    return chunks_of(slow_gate_inputs(1, 8 * CHUNK_SIZE - 17, 2, 32, 16, initial_state=True,
                                      segments=segments))


def first_chunks(chunks, num_chunks):
    return jax.tree.map(lambda x: x[:, :, :num_chunks], chunks)


def sequential_combine(transitions, offsets, initial_state):
    """`combine_segments` by a loop over segments: S_{p+1} = A_p S_p + b_p."""
    state, entering = initial_state, []
    for p in range(transitions.shape[2]):
        entering.append(state)
        state = jnp.einsum("bhij,bhjv->bhiv", transitions[:, :, p], state,
                           precision=jax.lax.Precision.HIGHEST) + offsets[:, :, p]
    return jnp.stack(entering, axis=2), state


@pytest.mark.parametrize("num_segments", [1, 2, 3, 8])
def test_combine_matches_a_sequential_loop(num_segments):
    key_dim, value_dim = 16, 8
    keys = jax.random.split(jax.random.PRNGKey(num_segments), 3)
    # Transitions of spectral norm about 1, like products of (I - beta k k^T) diag(decay).
    transitions = jax.random.normal(keys[0], (2, 3, num_segments, key_dim, key_dim)) / (
        2 * key_dim**0.5)
    offsets = jax.random.normal(keys[1], (2, 3, num_segments, key_dim, value_dim))
    initial_state = jax.random.normal(keys[2], (2, 3, key_dim, value_dim))
    entering, final_state = jax.jit(combine_segments)(transitions, offsets, initial_state)
    expected_entering, expected_final = jax.jit(sequential_combine)(transitions, offsets,
                                                                    initial_state)
    assert entering.shape == expected_entering.shape
    assert relative_error(entering, expected_entering) <= F32_TOLERANCE
    assert relative_error(final_state, expected_final) <= F32_TOLERANCE


def test_split_pads_with_inert_chunks_and_extends_u_with_zero_columns():
    chunks = first_chunks(slow_gate_chunks(False)[0], 5)
    segments = split_into_segments(chunks, 3)  # N = 5 -> 3 segments of 2 chunks, 1 inert
    assert segments.W.shape == (1, 6, 2, CHUNK_SIZE, 32)
    assert segments.U.shape == (1, 6, 2, CHUNK_SIZE, 16 + 32)
    assert segments.chunk_decay.shape == (1, 6, 2, 32)
    # Head 1's segment 1 holds chunks 2 and 3; its last segment (row 5) chunk 4 and the padding.
    np.testing.assert_array_equal(segments.W[0, 4], chunks.W[0, 1, 2:4])
    np.testing.assert_array_equal(segments.U[0, 5, 0, :, :16], chunks.U[0, 1, 4])
    np.testing.assert_array_equal(segments.U[..., 16:], 0.0)
    for name in ("W", "U", "q_from_state", "k_to_state", "Aqk"):
        np.testing.assert_array_equal(getattr(segments, name)[0, 5, 1], 0.0, err_msg=name)
    np.testing.assert_array_equal(segments.chunk_decay[0, 5, 1], 1.0)


def test_slow_gates_carry_the_state_across_segments():
    """Without the combine (every segment from zero) the outputs and state would be far off."""
    chunks, state = slow_gate_chunks(False)
    o, final_state = jax.jit(chunk_recurrence, static_argnums=2)(chunks, state, jnp.float32)
    segments = split_into_segments(chunks, 4)
    segments = segments._replace(U=segments.U[..., :16])  # the plain columns only
    o_from_zero, states_from_zero = jax.jit(chunk_recurrence, static_argnums=2)(
        segments, jnp.zeros((1, 8, 32, 16)), jnp.float32)
    assert relative_error(o_from_zero.reshape(o.shape), o) > 0.1
    assert relative_error(states_from_zero[:, 3::4], final_state) > 0.05


# (number of chunks N, segments P), with an initial state or not, with documents or not.
SEGMENT_CASES = st.tuples(
    st.sampled_from([(1, 1), (3, 2), (4, 4), (8, 3), (8, 2), (7, 5)]), st.booleans(),
    st.booleans())


def segment_case(case):
    """(chunks, state, P) of a drawn `SEGMENT_CASES` case: the first N slow-gate chunks."""
    (num_chunks, num_segments), initial_state, documents = case
    chunks, state = slow_gate_chunks(documents)
    chunks = first_chunks(chunks, num_chunks)
    return chunks, (state if initial_state else jnp.zeros_like(state)), num_segments


@pytest.mark.slow
@settings(deadline=None, max_examples=10)
@given(case=SEGMENT_CASES)
def test_segments_in_plain_jax_equal_the_whole_recurrence(case):
    chunks, state, num_segments = segment_case(case)
    o_whole, state_whole = jax.jit(chunk_recurrence, static_argnums=2)(chunks, state,
                                                                       jnp.float32)
    o, final_state = jax.jit(lambda c, s: recurrence_in_segments(
        chunk_recurrence, c, s, jnp.float32, num_segments=num_segments))(chunks, state)
    assert o.shape == o_whole.shape and final_state.shape == state_whole.shape
    assert relative_error(o, o_whole) <= F32_TOLERANCE
    assert relative_error(final_state, state_whole) <= F32_TOLERANCE


def reversed_scan(chunks, d_o, d_final_state):
    """The reversed recurrence by a float32 scan over chunks, on `ChunkedInputs` (the oracle):
    `(d_states [B, HV, N, K, V]: dS_{n+1}, d_v_new [B, HV, N, C, V], dS_0 [B, HV, K, V])`."""

    def step(d_state, chunk):
        w, q_from_state, k_to_state, aqk, decay, d_o = chunk
        d_v_new = (einsum("...ij,...iv->...jv", aqk, d_o)
                   + einsum("...ck,...kv->...cv", k_to_state, d_state))
        d_entering = (decay[..., None] * d_state + einsum("...ck,...cv->...kv", q_from_state, d_o)
                      - einsum("...ck,...cv->...kv", w, d_v_new))
        return d_entering, (d_state, d_v_new)

    per_chunk = (chunks.W, chunks.q_from_state, chunks.k_to_state, chunks.Aqk, chunks.chunk_decay,
                 d_o)
    d_initial_state, (d_states, d_v_new) = jax.lax.scan(
        step, d_final_state, tuple(jnp.moveaxis(x, 2, 0) for x in per_chunk), reverse=True)
    return jnp.moveaxis(d_states, 0, 2), jnp.moveaxis(d_v_new, 0, 2), d_initial_state


def random_cotangents(chunks, seed, dtype=jnp.float32):
    """Random cotangents of the recurrence's outputs: (d_o [B, HV, N, C, V] in dtype,
    d_final_state float32 [B, HV, K, V])."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 2)
    batch, heads, _, _, key_dim = chunks.W.shape
    return (jax.random.normal(keys[0], chunks.U.shape).astype(dtype),
            jax.random.normal(keys[1], (batch, heads, key_dim, chunks.U.shape[-1])))


@pytest.mark.slow
@settings(deadline=None, max_examples=10)
@given(case=SEGMENT_CASES)
def test_reversed_segments_in_plain_jax_equal_the_whole_vjp(case):
    chunks, state, num_segments = segment_case(case)
    cotangents = random_cotangents(chunks, seed=chunks.W.shape[2])
    d_chunks, d_initial_whole = jitted_vjp(
        lambda c, s: chunk_recurrence(c, s, jnp.float32))(chunks, state, cotangents)
    d_states_whole, d_v_new_whole, d_initial_scan = jax.jit(reversed_scan)(chunks, *cotangents)
    # The oracle is the VJP: dU = dV_new, and dS_0.
    assert relative_error(d_v_new_whole, d_chunks.U) <= F32_TOLERANCE
    assert relative_error(d_initial_scan, d_initial_whole) <= F32_TOLERANCE
    d_states, d_v_new, d_initial = jax.jit(lambda c, d_o, d_s: reversed_recurrence_in_segments(
        reversed_scan, c, d_o, d_s, num_segments=num_segments))(chunks, *cotangents)
    assert d_states.shape == d_states_whole.shape and d_v_new.shape == d_v_new_whole.shape
    assert relative_error(d_states, d_states_whole) <= F32_TOLERANCE
    assert relative_error(d_v_new, d_v_new_whole) <= F32_TOLERANCE
    assert relative_error(d_initial, d_initial_whole) <= F32_TOLERANCE


# Choosing P: the cost model of the module docstring on 132 SMs.


@pytest.mark.parametrize("batch_heads,num_chunks,dim,expected", [
    (16, 512, 128, 1),  # P = 2 measured slower than unsplit (`benchmarks/kda_h200.md`)
    (16, 1024, 128, 1),  # P = 2 would save 512 steps for more time in the extra passes
    (8, 1024, 128, 1),  # P = 4 would save 768 steps for as much time in the extra passes
    (4, 1024, 128, 8),  # 16 programs; P = 8: 128 programs, N/8 steps (half the estimated time)
    (2, 1024, 128, 16),  # 4 programs; P = 16: 128
    (1, 1024, 128, 32),
    (1, 256, 128, 16),  # segments of MIN_SEGMENT_CHUNKS at most 16 of them
    (32, 1024, 128, 1),  # 64 programs: P = 2 needs 2 waves of N/2, no gain
    (128, 32, 128, 1),  # 256 programs: the SMs are full
    (16, 24, 128, 1),  # too short for two segments of MIN_SEGMENT_CHUNKS
])
def test_segments_are_chosen_where_the_estimate_pays(batch_heads, num_chunks, dim, expected):
    assert choose_num_segments(batch_heads, num_chunks, dim, dim, num_sms=132) == expected


def test_segment_counts_outside_one_to_n_are_refused():
    chunks, state = slow_gate_chunks(False)
    operands = recurrence_operands(first_chunks(chunks, 2))
    for num_segments in (0, 3):
        with pytest.raises(ValueError, match=r"num_segments must be between 1 and the number of "
                                             r"chunks N = 2, got"):
            sequence_parallel_recurrence(operands, state, jnp.bfloat16,
                                         num_segments=num_segments)


# The kernel on segments.


def test_sequence_parallel_kernel_lowers_for_hopper():
    """Float32 outputs and V + K = 256 value columns pass Mosaic GPU's checks at K = V = 128."""
    operands, state = abstract_operands(batch=1, heads=2, num_chunks=4, dim=128)
    recurrence = jax.jit(lambda ops, s: sequence_parallel_recurrence(ops, s, jnp.bfloat16,
                                                                     num_segments=2))
    with jax.sharding.use_abstract_mesh(HOPPER):
        lowered = recurrence.trace(operands, state).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.slow
@pytest.mark.parametrize("num_chunks,num_segments,segments,save_for_backward", [
    (8, 2, True, False),  # documents
    (7, 4, False, True),  # N not a multiple of P: one inert chunk; a padded tail; residuals
])
def test_interpreted_kernel_on_segments_matches_one_segment_and_plain_jax(
        num_chunks, num_segments, segments, save_for_backward):
    inputs = slow_gate_inputs(4, num_chunks * CHUNK_SIZE - 5, 2, 64, 64, dtype=jnp.bfloat16,
                              initial_state=True, segments=segments)
    chunks, state = chunks_of(inputs)
    operands = recurrence_operands(chunks)
    o_plain, state_plain = jax.jit(chunk_recurrence, static_argnums=2)(chunks, state,
                                                                         jnp.bfloat16)

    def kernel(p):
        return jax.jit(lambda ops, s: sequence_parallel_recurrence(
            ops, s, jnp.bfloat16, num_segments=p, save_for_backward=save_for_backward))(
                operands, state)

    with interpreted_on_simulated_hopper():
        o_one, state_one, *residuals_one = kernel(1)
    with interpreted_on_simulated_hopper():
        o, final_state, *residuals = kernel(num_segments)
    assert o.dtype == jnp.bfloat16 and final_state.dtype == jnp.float32
    for expected_o, expected_state in ((o_one, state_one), (o_plain, state_plain)):
        assert relative_error(o, expected_o) <= BF16_TOLERANCE["o"]
        assert relative_error(final_state, expected_state) <= BF16_TOLERANCE["state"]
    # The backward's inputs: entering states and V_new, as the unsplit kernel saves them.
    for saved, expected in zip(residuals, residuals_one):
        for name, x, want in zip(expected._fields, saved, expected):
            assert x.shape == want.shape and x.dtype == want.dtype, name
            assert relative_error(x, want) <= BF16_TOLERANCE["state"], name


@pytest.mark.slow
@pytest.mark.parametrize("num_segments", [1, 2])
def test_interpreted_token_major_output_is_the_chunk_output_transposed(num_segments):
    """`token_major`: the kernel's own token-row stores (P = 1) or the transpose after the
    combine (P = 2) give exactly the [B, HV, N, C, V] output in [B, N C, HV, V]."""
    inputs = slow_gate_inputs(5, 4 * CHUNK_SIZE, 2, 64, 64, dtype=jnp.bfloat16,
                              initial_state=True)
    chunks, state = chunks_of(inputs)
    operands = recurrence_operands(chunks)

    def kernel(token_major):
        return jax.jit(lambda ops, s: sequence_parallel_recurrence(
            ops, s, jnp.bfloat16, num_segments=num_segments, token_major=token_major))(
                operands, state)

    with interpreted_on_simulated_hopper():
        o, final_state = kernel(token_major=False)
    with interpreted_on_simulated_hopper():
        o_token_major, final_state_token_major = kernel(token_major=True)
    batch, heads, num_chunks, chunk, value_dim = o.shape
    assert o_token_major.shape == (batch, num_chunks * chunk, heads, value_dim)
    np.testing.assert_array_equal(np.asarray(o_token_major, np.float32),
                                  np.asarray(chunks_to_tokens(o), np.float32))
    np.testing.assert_array_equal(final_state_token_major, final_state)


@pytest.mark.slow
@pytest.mark.parametrize("num_segments", [1, 2])
def test_interpreted_reversed_kernel_reads_token_major_d_o_as_chunk_major(num_segments):
    """d_o given token-major, [B, N C, HV, V]: the kernel's reads of its token rows (P = 1) or the
    transpose before the split (P = 2) give exactly what the [B, HV, N, C, V] d_o gives."""
    inputs = slow_gate_inputs(6, 4 * CHUNK_SIZE, 2, 64, 64, dtype=jnp.bfloat16,
                              initial_state=True)
    chunks, _ = chunks_of(inputs)
    operands = recurrence_operands(chunks)._replace(U=None)
    d_o, d_final_state = random_cotangents(chunks, 7, jnp.bfloat16)

    def kernel(d_o):
        with interpreted_on_simulated_hopper():
            return jax.jit(lambda ops, d_o, d_s: sequence_parallel_reversed_recurrence(
                ops, d_o, d_s, num_segments=num_segments, d_v_new_dtype=jnp.bfloat16))(
                    operands, d_o, d_final_state)

    expected, actual = kernel(d_o), kernel(chunks_to_tokens(d_o))
    for name, x, want in zip(("d_states", "d_v_new", "d_initial"), actual, expected):
        assert x.shape == want.shape and x.dtype == want.dtype, name
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(want, np.float32),
                                      err_msg=name)


@pytest.mark.parametrize("num_segments,d_o_token_major", [(2, False), (1, True), (2, True)])
def test_sequence_parallel_reversed_kernel_lowers_for_hopper(num_segments, d_o_token_major):
    """V + K = 256 cotangent columns (P = 2), and the kernel's reads of a token-major d_o (P = 1),
    pass Mosaic GPU's checks at K = V = 128."""
    batch, heads, num_chunks, dim = 1, 2, 4, 128
    operands, d_final_state = abstract_operands(batch, heads, num_chunks, dim)
    operands = operands._replace(U=None)
    d_o = jax.ShapeDtypeStruct(
        (batch, num_chunks * CHUNK_SIZE, heads, dim) if d_o_token_major
        else (batch, heads, num_chunks, CHUNK_SIZE, dim), jnp.bfloat16)
    reversed_recurrence = jax.jit(lambda ops, d_o, d_s: sequence_parallel_reversed_recurrence(
        ops, d_o, d_s, num_segments=num_segments))
    with jax.sharding.use_abstract_mesh(HOPPER):
        lowered = reversed_recurrence.trace(operands, d_o, d_final_state).lower(
            lowering_platforms=("cuda",))
    assert "_reversed_recurrence_kernel" in lowered.as_text()


def test_vjp_splits_the_reversed_recurrence_as_the_forward():
    """At B * HV = 2, N = 32 both directions of the kernels' VJP take P = 2 on Hopper: both
    kernels run HV * 2 segment heads of N / 2 chunks with V + K value columns."""
    batch, heads, num_chunks, dim = 1, 2, 32, 128
    assert choose_num_segments(batch * heads, num_chunks, dim, dim, num_sms=132) == 2
    chunks = ChunkedInputs(**{
        name: jax.ShapeDtypeStruct((batch, heads, num_chunks, *shape), jnp.float32)
        for name, shape in dict(W=(CHUNK_SIZE, dim), U=(CHUNK_SIZE, dim),
                                q_from_state=(CHUNK_SIZE, dim), k_to_state=(CHUNK_SIZE, dim),
                                Aqk=(CHUNK_SIZE, CHUNK_SIZE), chunk_decay=(dim,)).items()})
    state = jax.ShapeDtypeStruct((batch, heads, dim, dim), jnp.float32)
    cotangents = (jax.ShapeDtypeStruct(chunks.U.shape, jnp.bfloat16), state)
    with jax.sharding.use_abstract_mesh(HOPPER):
        text = jitted_vjp(kernel_recurrence).trace(chunks, state, cotangents).lower(
            lowering_platforms=("cuda",)).as_text()
    segment_heads, segment_chunks = f"{batch}x{heads * 2}", num_chunks // 2
    per_chunk = f"{segment_heads}x{segment_chunks}x{{rows}}x{2 * dim}"
    ends = f"tensor<{segment_heads}x{dim}x{2 * dim}xf32>"
    forward_results = f"-> (tensor<{per_chunk.format(rows=CHUNK_SIZE)}xf32>, {ends}"  # o', ends
    reversed_results = (f"-> (tensor<{per_chunk.format(rows=dim)}xbf16>, "  # dS_{n+1}'
                        f"tensor<{per_chunk.format(rows=CHUNK_SIZE)}xf32>, {ends})")  # dV_new', dS'
    assert forward_results in text and reversed_results in text


@pytest.mark.slow
@pytest.mark.parametrize("seed,num_chunks,num_segments,segments", [
    # Documents cut at tokens 12, 150 and 161: the last segment has none, so the cotangent of
    # the final state reaches the first segment's last two chunks only through the combine.
    (19, 8, 2, True),
    (5, 7, 4, False),  # N not a multiple of P: one inert chunk
])
def test_interpreted_reversed_kernel_on_segments_matches_one_and_plain_jax(
        seed, num_chunks, num_segments, segments):
    inputs = slow_gate_inputs(seed, num_chunks * CHUNK_SIZE - 5, 2, 64, 64, dtype=jnp.bfloat16,
                              initial_state=True, segments=segments)
    chunks, state = chunks_of(inputs)
    cotangents = random_cotangents(chunks, num_chunks, jnp.bfloat16)
    d_chunks, d_initial_vjp = jitted_vjp(lambda c, s: chunk_recurrence(c, s, jnp.bfloat16))(
        chunks, state, cotangents)
    d_states_plain, _, _ = jax.jit(reversed_scan)(chunks, *cotangents)
    operands = recurrence_operands(chunks)._replace(U=None)

    def kernel(p):
        return jax.jit(lambda ops, d_o, d_s: sequence_parallel_reversed_recurrence(
            ops, d_o, d_s, num_segments=p))(operands, *cotangents)

    with interpreted_on_simulated_hopper():
        one = kernel(1)
    with interpreted_on_simulated_hopper():
        d_states, d_v_new, d_initial = kernel(num_segments)
    assert d_states.dtype == jnp.bfloat16
    assert d_v_new.dtype == d_initial.dtype == jnp.float32
    for name, x, want in zip(("d_states", "d_v_new", "d_initial"), (d_states, d_v_new, d_initial),
                             one):
        assert x.shape == want.shape, name
        assert relative_error(x, want) <= GRADIENT_TOLERANCE, name
    assert relative_error(d_states, d_states_plain) <= GRADIENT_TOLERANCE
    assert relative_error(d_v_new, d_chunks.U) <= GRADIENT_TOLERANCE  # dU = dV_new
    assert relative_error(d_initial, d_initial_vjp) <= GRADIENT_TOLERANCE


# On a Hopper GPU: long single sequences, the whole forward with bounded gates.


def sequence_parallel_forward(inputs, num_segments):
    """Preparation kernel, then the sequence-parallel recurrence: (o [B, T, HV, V], state)."""
    q, k, v, g, beta = (inputs[name] for name in ("q", "k", "v", "g", "beta"))
    batch, length, heads, value_dim = v.shape

    def forward(q, k, v, g, beta, initial_state):
        operands = prepare_chunks_kernel(q, k, v, g, beta, scale=q.shape[-1] ** -0.5,
                                         segment_ids=None, use_qk_l2norm=True,
                                         gate_lower_bound=-5.0)
        o, state = sequence_parallel_recurrence(operands, initial_state, v.dtype,
                                                num_segments=num_segments)
        return jnp.moveaxis(o, 1, 3).reshape(batch, -1, heads, value_dim)[:, :length], state

    return jax.jit(forward)(q, k, v, g, beta, inputs["initial_state"])


# Few heads, so that the cost model splits the sequence (on an H100 or H200, 132 SMs): at 16
# heads it does not, and these tests would check the unsplit path only.
LONG_HEADS, LONG_SEGMENTS = 4, 8


@pytest.mark.gpu
@pytest.mark.parametrize("length,gate_factor", [
    (65536, SLOW_GATE_FACTOR), (65536, 1.0), (32768, SLOW_GATE_FACTOR)])
def test_gpu_long_sequence_matches_reference(length, gate_factor):
    inputs = make_inputs(11, 1, length, LONG_HEADS, LONG_HEADS, 128, 128, dtype=jnp.bfloat16,
                         initial_state=True)
    inputs["g"] = inputs["g"] * gate_factor
    assert choose_num_segments(LONG_HEADS, length // CHUNK_SIZE, 128, 128) == LONG_SEGMENTS
    o_ref, state_ref = run("reference", inputs)
    o_one, state_one = sequence_parallel_forward(inputs, num_segments=1)
    for num_segments in (None, 16):
        o, state = sequence_parallel_forward(inputs, num_segments)
        for expected_o, expected_state in ((o_ref, state_ref), (o_one, state_one)):
            assert relative_error(o, expected_o) <= BF16_TOLERANCE["o"], num_segments
            assert relative_error(state, expected_state) <= BF16_TOLERANCE["state"], num_segments


@pytest.mark.gpu
def test_gpu_long_sequence_saves_what_the_unsplit_kernel_saves():
    inputs = make_inputs(12, 1, 65536, LONG_HEADS, LONG_HEADS, 128, 128, dtype=jnp.bfloat16,
                         initial_state=True)
    inputs["g"] = inputs["g"] * SLOW_GATE_FACTOR
    q, k, v, g, beta = (inputs[name] for name in ("q", "k", "v", "g", "beta"))
    operands = jax.jit(lambda *xs: prepare_chunks_kernel(
        *xs, scale=128**-0.5, segment_ids=None, use_qk_l2norm=True,
        gate_lower_bound=-5.0))(q, k, v, g, beta)

    def forward(num_segments):
        return jax.jit(lambda ops, s: sequence_parallel_recurrence(
            ops, s, jnp.bfloat16, num_segments=num_segments, save_for_backward=True))(
                operands, inputs["initial_state"])

    _, _, expected = forward(1)
    _, _, saved = forward(None)
    for name, x, want in zip(expected._fields, saved, expected):
        assert relative_error(x, want) <= BF16_TOLERANCE["state"], name


@pytest.mark.gpu
@pytest.mark.parametrize("gate_factor", [SLOW_GATE_FACTOR, 1.0])
def test_gpu_long_sequence_recurrence_vjp_matches_plain_jax(gate_factor):
    """The kernels' VJP at (1, 65536, 4, 128), where both directions split in P = 8 segments,
    against the plain-JAX VJP; the reversed kernel also at P = 16 and P = 1."""
    inputs = make_inputs(13, 1, 65536, LONG_HEADS, LONG_HEADS, 128, 128, dtype=jnp.bfloat16,
                         initial_state=True)
    inputs["g"] = inputs["g"] * gate_factor
    chunks, state = chunks_of(inputs)
    cotangents = random_cotangents(chunks, 13, jnp.bfloat16)
    assert choose_num_segments(LONG_HEADS, chunks.W.shape[2], 128, 128) == LONG_SEGMENTS
    expected_chunks, expected_initial = jitted_vjp(plain_recurrence)(chunks, state, cotangents)
    actual_chunks, actual_initial = jitted_vjp(kernel_recurrence)(chunks, state, cotangents)
    for name, actual, expected in zip(ChunkedInputs._fields, actual_chunks, expected_chunks):
        assert relative_error(actual, expected) <= GRADIENT_TOLERANCE, name
    assert relative_error(actual_initial, expected_initial) <= GRADIENT_TOLERANCE

    expected_d_states, _, _ = jax.jit(reversed_scan)(chunks, *cotangents)
    operands = recurrence_operands(chunks)._replace(U=None)
    for num_segments in (1, 16):
        d_states, d_v_new, d_initial = jax.jit(lambda ops, d_o, d_s: (
            sequence_parallel_reversed_recurrence(ops, d_o, d_s, num_segments=num_segments)))(
                operands, *cotangents)
        assert relative_error(d_states, expected_d_states) <= GRADIENT_TOLERANCE, num_segments
        assert relative_error(d_v_new, expected_chunks.U) <= GRADIENT_TOLERANCE, num_segments
        assert relative_error(d_initial, expected_initial) <= GRADIENT_TOLERANCE, num_segments


def test_sm_count_under_a_cpu_mesh_falls_back_to_the_devices():
    """A CPU mesh's abstract device has no core count: the count must not come back as None."""
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        assert sequence_parallel._multiprocessor_count() >= 1
