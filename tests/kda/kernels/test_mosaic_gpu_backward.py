"""The backward of the Mosaic GPU kernel path: the forward kernel's saved residuals, the reversed
recurrence kernel and the recurrence's VJP against `jax.vjp` of the plain-JAX recurrence, and
gradients through `kda_attention(impl="mosaic_gpu")` against the token-by-token oracle.

On CPU the kernels run in Mosaic GPU interpret mode (simulated Hopper, race detection) at small
shapes and are lowered for Hopper at K = V = 128; on a Hopper GPU (`gpu` marker) they run for
real at the shapes training hands them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda
from experiments.harness import relative_error
from kda.chunked import CHUNK_SIZE, ChunkedInputs, prepare_chunks
from kda.kernels.mosaic_gpu import op as mosaic_gpu
from kda.kernels.mosaic_gpu.common import RecurrenceResiduals, recurrence_operands
from kda.kernels.mosaic_gpu.prepare_backward import ROUNDED_COTANGENTS
from kda.kernels.mosaic_gpu.recurrence import (BLOCK_V, NARROW_BLOCK_V, choose_block_v,
                                               run_recurrence)
from kda.kernels.mosaic_gpu.reversed_recurrence import (recurrence_cotangents,
                                                        run_reversed_recurrence)
from kda.kernels.mosaic_gpu.sequence_parallel import sequence_parallel_reversed_recurrence
from tests.kda.calls import loss_and_grads
from tests.kda.inputs import bf16_inputs
from tests.kda.kernels.hopper import HOPPER, interpreted_on_simulated_hopper
from tests.kda.kernels.recurrences import (abstract_operands, jitted_vjp, kernel_recurrence,
                                           plain_recurrence)
from tests.kda.tolerances import BF16_TOLERANCE, GRADIENT_TOLERANCE, assert_within_bf16_tolerances


def prepared_chunks(seed, batch, length, heads, value_heads, dim, *, gate="lower_bound",
                    segments=False):
    """float32 `ChunkedInputs` from the plain-JAX preparation, an initial state, and random
    cotangents (d_o in bf16, as the kernel path's outputs) of the recurrence's two results."""
    inputs = bf16_inputs(seed, batch, length, heads, value_heads, dim, gate=gate,
                         initial_state=True, segments=segments)
    prepare = jax.jit(lambda q, k, v, g, beta, segment_ids: prepare_chunks(
        q, k, v, g, beta, scale=dim**-0.5, segment_ids=segment_ids, use_qk_l2norm=True,
        gate_lower_bound=None, chunk_size=CHUNK_SIZE))
    chunks = prepare(*(inputs[name] for name in ("q", "k", "v", "g", "beta")),
                     inputs.get("segment_ids"))
    keys = jax.random.split(jax.random.PRNGKey(seed + 1000), 2)
    d_o = jax.random.normal(keys[0], chunks.U.shape).astype(jnp.bfloat16)
    d_final_state = jax.random.normal(keys[1], inputs["initial_state"].shape)
    return chunks, inputs["initial_state"], (d_o, d_final_state)


def chunk_slice(chunks: ChunkedInputs, start, stop) -> ChunkedInputs:
    return ChunkedInputs(*(x[:, :, start:stop] for x in chunks))


def plain_state_cotangents(chunks, initial_state, cotangents):
    """dS_{n+1} for every chunk n [B, HV, N, K, V], each from `jax.vjp` of the plain-JAX
    recurrence over the chunks after n, started from the state the chunks up to n leave."""
    d_o, d_final_state = cotangents
    num_chunks = chunks.W.shape[2]
    d_states = []
    for n in range(num_chunks - 1):
        _, state = plain_recurrence(chunk_slice(chunks, 0, n + 1), initial_state)
        _, vjp = jax.vjp(plain_recurrence, chunk_slice(chunks, n + 1, num_chunks), state)
        d_states.append(vjp((d_o[:, :, n + 1:], d_final_state))[1])
    return jnp.stack([*d_states, d_final_state], axis=2)


@pytest.mark.slow
@pytest.mark.parametrize("length,value_heads,segments", [
    (256, 2, True),  # four chunks: the pipeline refills its buffers; documents
    (200, 1, False),  # a padded tail
])
def test_interpreted_forward_saves_what_it_used(length, value_heads, segments):
    chunks, initial_state, _ = prepared_chunks(0, 1, length, 1, value_heads, 64,
                                               segments=segments)
    operands = recurrence_operands(chunks)
    with interpreted_on_simulated_hopper():
        o, final_state = run_recurrence(operands, initial_state, jnp.bfloat16)
        o_saving, final_state_saving, (states, v_new) = run_recurrence(
            operands, initial_state, jnp.bfloat16, save_for_backward=True)
    np.testing.assert_array_equal(o_saving, o)
    np.testing.assert_array_equal(final_state_saving, final_state)
    assert states.dtype == v_new.dtype == jnp.bfloat16

    def entering_states_and_v_new(chunks):
        num_chunks = chunks.W.shape[2]
        entering = [initial_state] + [plain_recurrence(chunk_slice(chunks, 0, n), initial_state)[1]
                                      for n in range(1, num_chunks)]
        entering = jnp.stack(entering, axis=2)
        return entering, chunks.U - jnp.einsum("bhnck,bhnkv->bhncv", chunks.W, entering)

    expected_states, expected_v_new = jax.jit(entering_states_and_v_new)(chunks)
    assert relative_error(states, expected_states) <= BF16_TOLERANCE["state"]
    assert relative_error(v_new, expected_v_new) <= BF16_TOLERANCE["o"]


@pytest.mark.slow
@pytest.mark.parametrize("save_for_backward,token_major", [(False, True), (True, False)])
def test_interpreted_narrow_state_tiles_give_what_the_wide_ones_give(save_for_backward,
                                                                     token_major):
    """32 state columns a program (`NARROW_BLOCK_V`, 64-byte swizzles): every output, saved
    residual included, as with 64 columns; the columns do not mix.

    The bf16 results are bit-identical. The float32 final state is compared to float32 rounding:
    on some CPUs XLA compiles the interpreted products of the two widths differently (seen: at
    most 1.8e-7 apart, at 3% of the entries, already after one chunk; a column mixed in would be
    off by O(1)). On a Hopper GPU they agree to the bit
    (`test_gpu_narrow_state_tiles_give_what_the_wide_ones_give`)."""
    chunks, initial_state, _ = prepared_chunks(9, 1, 256, 1, 2, 64, segments=True)
    operands = recurrence_operands(chunks)

    def results(block_v):
        return jax.tree.leaves(run_recurrence(
            operands, initial_state, jnp.bfloat16, save_for_backward=save_for_backward,
            token_major=token_major, block_v=block_v))

    with interpreted_on_simulated_hopper():
        wide, narrow = results(BLOCK_V), results(NARROW_BLOCK_V)
    assert len(narrow) == (4 if save_for_backward else 2)
    for x, want in zip(narrow, wide):
        if x.dtype == jnp.float32:
            np.testing.assert_allclose(x, want, rtol=1e-6, atol=0)
        else:
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(want, np.float32))


def test_narrow_state_tiles_lower_for_hopper():
    """At K = V = 128 the 64-byte swizzles of W, q_from_state, k_to_state^T and Aqk pair with the
    [K, 32] state's and V_new's in wgmma, with and without the saved residuals."""
    operands, state = abstract_operands(batch=1, heads=2, num_chunks=4, dim=128)
    for save_for_backward in (False, True):
        recurrence = jax.jit(lambda ops, s: run_recurrence(
            ops, s, jnp.bfloat16, save_for_backward=save_for_backward, token_major=True,
            block_v=NARROW_BLOCK_V))
        with jax.sharding.use_abstract_mesh(HOPPER):
            lowered = recurrence.trace(operands, state).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("batch_heads,value_dim,expected", [
    (16, 128, NARROW_BLOCK_V),  # 1x32768x16: 32 programs of 64 columns on 132 SMs
    (32, 128, NARROW_BLOCK_V),  # 2x8192x16: 64 programs; 128 of 32 columns still one wave
    (128, 128, BLOCK_V),  # 8x2048x16: 256 programs already
    (33, 128, NARROW_BLOCK_V), (34, 128, BLOCK_V),  # 132 SMs: 132 and 136 programs of 32
])
def test_narrow_state_tiles_where_twice_the_programs_fit_one_wave(batch_heads, value_dim,
                                                                    expected):
    assert choose_block_v(batch_heads, value_dim, num_sms=132) == expected


@pytest.mark.slow
def test_interpreted_reversed_kernel_matches_plain_jax():
    chunks, initial_state, cotangents = prepared_chunks(1, 1, 256, 1, 2, 64, segments=True)
    d_chunks, d_initial_state = jitted_vjp(plain_recurrence)(chunks, initial_state, cotangents)
    with interpreted_on_simulated_hopper():
        d_states, d_v_new, d_initial = run_reversed_recurrence(
            recurrence_operands(chunks)._replace(U=None), *cotangents)
    assert d_states.dtype == jnp.bfloat16
    assert d_v_new.dtype == d_initial.dtype == jnp.float32
    expected_d_states = jax.jit(plain_state_cotangents)(chunks, initial_state, cotangents)
    assert relative_error(d_states, expected_d_states) <= GRADIENT_TOLERANCE
    assert relative_error(d_v_new, d_chunks.U) <= GRADIENT_TOLERANCE  # dU = dV_new
    assert relative_error(d_initial, d_initial_state) <= GRADIENT_TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("num_segments", [1, 2])
def test_interpreted_reversed_kernel_bf16_d_v_new_is_float32_rounded(num_segments):
    """Asked for dV_new in bf16 (written so by the kernel at P = 1, rounded after the float32
    corrections at P = 2), the reversed recurrence gives the float32 dV_new rounded, bit for bit,
    and the same dS."""
    chunks, _, cotangents = prepared_chunks(1, 1, 256, 1, 2, 64, segments=True)
    operands = recurrence_operands(chunks)._replace(U=None)

    def reversed_recurrence(d_v_new_dtype):
        with interpreted_on_simulated_hopper():
            return jax.jit(lambda ops, d_o, d_s: sequence_parallel_reversed_recurrence(
                ops, d_o, d_s, num_segments=num_segments, d_v_new_dtype=d_v_new_dtype))(
                    operands, *cotangents)

    d_states, d_v_new, d_initial = reversed_recurrence(jnp.float32)
    d_states_rounded, d_v_new_rounded, d_initial_rounded = reversed_recurrence(jnp.bfloat16)
    assert d_v_new.dtype == jnp.float32 and d_v_new_rounded.dtype == jnp.bfloat16
    np.testing.assert_array_equal(d_v_new_rounded, d_v_new.astype(jnp.bfloat16))
    np.testing.assert_array_equal(d_states_rounded, d_states)
    np.testing.assert_array_equal(d_initial_rounded, d_initial)


def test_recurrence_cotangents_in_bf16_are_the_float32_ones_rounded():
    """The cotangents the preparation-backward kernels round come out of the parallel products
    rounded once from their float32 sums (bit for bit on CPU; a GPU's GEMMs may pick another
    summation order for a bf16 output), the others unchanged."""
    batch, heads, num_chunks, dim = 1, 2, 3, 64
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    residuals = RecurrenceResiduals(
        states=jax.random.normal(keys[0], (batch, heads, num_chunks, dim, dim), jnp.bfloat16),
        v_new=jax.random.normal(keys[1], (batch, heads, num_chunks, CHUNK_SIZE, dim),
                                jnp.bfloat16))
    d_o = jax.random.normal(keys[2], (batch, heads, num_chunks, CHUNK_SIZE, dim), jnp.bfloat16)
    d_states = jax.random.normal(keys[3], (batch, heads, num_chunks, dim, dim), jnp.bfloat16)
    d_v_new = jax.random.normal(keys[4], (batch, heads, num_chunks, CHUNK_SIZE, dim))
    cotangents = jax.jit(recurrence_cotangents, static_argnums=4)
    with jax.default_device(jax.devices("cpu")[0]):
        full = cotangents(residuals, d_o, d_states, d_v_new, ())
        rounded = cotangents(residuals, d_o, d_states, d_v_new.astype(jnp.bfloat16),
                             ROUNDED_COTANGENTS)
    for name, x, want in zip(ChunkedInputs._fields, rounded, full):
        assert want.dtype == jnp.float32, name
        if name in ROUNDED_COTANGENTS:
            assert x.dtype == jnp.bfloat16, name
            want = want.astype(jnp.bfloat16)
        np.testing.assert_array_equal(x, want, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("length,heads,gate,segments", [
    (256, (1, 2), "lower_bound", True),  # four chunks, documents, grouped value heads
    (150, (2, 2), "softplus", False),  # a padded tail
])
def test_interpreted_recurrence_vjp_matches_plain_jax(length, heads, gate, segments):
    chunks, initial_state, cotangents = prepared_chunks(2, 1, length, *heads, 64, gate=gate,
                                                        segments=segments)
    expected_chunks, expected_initial = jitted_vjp(plain_recurrence)(chunks, initial_state,
                                                                     cotangents)
    with interpreted_on_simulated_hopper():
        actual_chunks, actual_initial = jitted_vjp(kernel_recurrence)(chunks, initial_state,
                                                                      cotangents)
    for name, actual, expected in zip(ChunkedInputs._fields, actual_chunks, expected_chunks):
        assert actual.shape == expected.shape and actual.dtype == jnp.float32, name
        assert relative_error(actual, expected) <= GRADIENT_TOLERANCE, name
    assert relative_error(actual_initial, expected_initial) <= GRADIENT_TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("gate,lower_bound,length,heads,segments", [
    # Both kernels forward; the recurrence kernels and the plain-JAX preparation VJP backward.
    ("lower_bound", -5.0, 200, (1, 2), True),
    # Plain-JAX preparation; the recurrence kernels forward and backward.
    ("softplus", None, 256, (1, 1), True),
])
def test_interpreted_gradients_match_reference(kernel_on_any_backend, gate, lower_bound, length,
                                               heads, segments):
    inputs = bf16_inputs(3, 1, length, *heads, 64, gate=gate, initial_state=True,
                         segments=segments)
    expected = loss_and_grads("reference", inputs, None)
    with interpreted_on_simulated_hopper():
        actual = loss_and_grads(mosaic_gpu.NAME, inputs, lower_bound)
    assert_within_bf16_tolerances(actual, expected)


@functools.cache
def _gradient_lowered_for_hopper(gate_lower_bound, layers) -> str:
    """The text of the gradient of `layers` KDA calls of one shape (K = V = 128), summed, lowered
    for Hopper (once a module: two tests read the one layer's with bounded gates)."""
    dim = 128
    inputs = bf16_inputs(4, 2, 200, 2, 4, dim, initial_state=True, segments=True)
    use_qk_l2norm = inputs.pop("use_qk_l2norm")
    differentiable = {name: inputs.pop(name) for name in ("q", "k", "v", "g", "beta",
                                                          "initial_state")}

    def loss(differentiable):
        total = 0.0
        for _ in range(layers):
            o, state = mosaic_gpu.mosaic_gpu_kda(
                **differentiable, **inputs, scale=dim**-0.5, output_final_state=True,
                use_qk_l2norm=use_qk_l2norm, gate_lower_bound=gate_lower_bound)
            total = total + jnp.sum(o.astype(jnp.float32)) + jnp.sum(state)
        return total

    with jax.sharding.use_abstract_mesh(HOPPER):
        lowered = jax.jit(jax.grad(loss)).trace(differentiable).lower(
            lowering_platforms=("cuda",))
    return lowered.as_text()


@pytest.mark.parametrize("gate_lower_bound", [None, -5.0])
def test_backward_lowers_for_hopper(gate_lower_bound):
    """The gradient's kernels (forward saving residuals, reversed recurrence) at K = V = 128."""
    text = _gradient_lowered_for_hopper(gate_lower_bound, 1)
    # Bounded gates: preparation, recurrence and reversed recurrence; otherwise the last two.
    assert text.count("_reversed_recurrence_kernel") >= 1
    assert text.count("mosaic_gpu") >= (2 if gate_lower_bound is None else 3)


@pytest.mark.slow
@pytest.mark.usefixtures("kernel_on_any_backend")
def test_bounded_backward_reads_the_cotangent_of_o_token_major():
    """At T a multiple of 64, d_o [B, T, HV, V] reaches both kernels of the recurrence's VJP as
    it is: no transpose to chunk-major [B, HV, N, 64, V] in XLA."""
    batch, length, heads, value_heads, dim = 2, 4 * CHUNK_SIZE, 2, 4, 128
    inputs = bf16_inputs(4, batch, length, heads, value_heads, dim, initial_state=True)
    use_qk_l2norm = inputs.pop("use_qk_l2norm")

    def loss(q, k, v, g, beta, initial_state):
        o, state = kda.kda_attention(
            q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
            use_qk_l2norm=use_qk_l2norm, gate_lower_bound=-5.0, impl=mosaic_gpu.NAME)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(state)

    names = ("q", "k", "v", "g", "beta", "initial_state")
    with jax.sharding.use_abstract_mesh(HOPPER):
        text = jax.jit(jax.grad(loss, argnums=tuple(range(6)))).trace(
            *(inputs[name] for name in names)).lower(lowering_platforms=("cuda",)).as_text()
    assert "_reversed_recurrence_kernel" in text and "_cotangents_kernel" in text
    chunk_major = f"tensor<{batch}x{value_heads}x{length // CHUNK_SIZE}x{CHUNK_SIZE}x{dim}xbf16>"
    transposes = [line for line in text.splitlines() if "stablehlo.transpose" in line]
    assert not [line for line in transposes if f"-> {chunk_major}" in line]


def test_identical_layers_share_each_lowered_kernel():
    """Two KDA layers of one shape lower each of their kernels once, as one layer does
    (`kda.kernels.mosaic_gpu.common.lowered_once`): lowering a copy at every call site dominated
    the `1b` training step's lowering (`benchmarks/train_h200.md`)."""
    one, two = (_gradient_lowered_for_hopper(-5.0, layers) for layers in (1, 2))
    assert two.count("mosaic_gpu_v2") == one.count("mosaic_gpu_v2") >= 3


# On the GPU: real shapes. The recurrence's VJP against the plain-JAX one, and gradients where
# `tests/kda/kernels/test_mosaic_gpu.py` does not already check them (T = 65536: against the
# chunked op, float32-exact, since the oracle's per-token scan would be too slow to differentiate).


@pytest.mark.gpu
@pytest.mark.parametrize("gate,segments", [("lower_bound", False), ("softplus", True)])
def test_gpu_recurrence_vjp_matches_plain_jax(gate, segments):
    chunks, initial_state, cotangents = prepared_chunks(5, 2, 8192, 16, 16, 128, gate=gate,
                                                        segments=segments)
    expected_chunks, expected_initial = jitted_vjp(plain_recurrence)(chunks, initial_state,
                                                                     cotangents)
    actual_chunks, actual_initial = jitted_vjp(kernel_recurrence)(chunks, initial_state,
                                                                  cotangents)
    for name, actual, expected in zip(ChunkedInputs._fields, actual_chunks, expected_chunks):
        assert relative_error(actual, expected) <= GRADIENT_TOLERANCE, name
    assert relative_error(actual_initial, expected_initial) <= GRADIENT_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_gradients_long_sequence(dim):
    inputs = bf16_inputs(7, 1, 65536, 2, 2, dim, initial_state=True, segments=True)
    expected = loss_and_grads("chunked", inputs, None)
    actual = loss_and_grads(mosaic_gpu.NAME, inputs, -5.0)
    assert_within_bf16_tolerances(actual, expected)


@pytest.mark.gpu
def test_gpu_narrow_state_tiles_give_what_the_wide_ones_give():
    """On a Hopper GPU the two tile widths agree to the bit, the float32 final state included."""
    chunks, initial_state, _ = prepared_chunks(11, 2, 8192, 16, 16, 128)
    operands = recurrence_operands(chunks)

    def results(block_v):
        return jax.tree.leaves(run_recurrence(operands, initial_state, jnp.bfloat16,
                                              save_for_backward=True, token_major=True,
                                              block_v=block_v))

    for x, want in zip(results(NARROW_BLOCK_V), results(BLOCK_V)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(want, np.float32))
