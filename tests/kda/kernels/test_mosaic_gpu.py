"""The Mosaic GPU kernel path (recurrence kernel; preparation kernel for bounded gates) against
the token-by-token oracle, and the preparation kernel against the plain-JAX preparation.

On CPU the kernels run in Mosaic GPU interpret mode (simulated Hopper: TMA, barriers, wgmma, with
race detection) at small shapes, and are lowered for Hopper to check layouts and shapes at K = 128.
On a GPU (`gpu` marker) they run for real at the shapes the dispatcher hands them, and so does the
Triton path (`kda.kernels.triton.op`), whose GPU tests are these, parametrized over both paths.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import kda
import kda.api
from experiments.harness import relative_error
from kda.chunked import prepare_chunks
from kda.kernels.mosaic_gpu import op as mosaic_gpu
from kda.kernels.mosaic_gpu.common import recurrence_operands
from kda.kernels.mosaic_gpu.prepare import prepare_chunks_kernel
from kda.kernels.mosaic_gpu.tiles import COMPILER_PARAMS, scanned_cumulative_sum
from kda.kernels.triton import op as triton_path
from tests.kda.calls import jitted_run, loss_and_grads, run
from tests.kda.inputs import bf16_inputs
from tests.kda.kernels.hopper import (HOPPER, TWO_PROGRAMS_PER_SM, interpreted_on_simulated_hopper,
                                      lowering_for_hopper_within)
from tests.kda.kernels.preparation import preparation_options, with_unit_keys
from tests.kda.tolerances import BF16_TOLERANCE, assert_within_bf16_tolerances


@pytest.mark.slow
@pytest.mark.parametrize("gate,lower_bound,length,heads,initial_state,segments", [
    # (Both kernels on one value head per q/k head: the forward of
    # `test_interpreted_kernel_gradients_match_reference_without_initial_state`; the preparation
    # kernel without segment ids, in
    # `test_interpreted_preparation_without_segment_ids_is_one_document`.)
    # Four chunks: the pipeline refills its buffers (races there show only from the third chunk);
    # a padded tail; grouped value heads.
    ("softplus", None, 200, (1, 2), False, True),
    # Both kernels with documents, a padded tail and grouped value heads.
    ("lower_bound", -5.0, 150, (1, 2), True, True),
])
def test_interpreted_kernel_matches_reference(kernel_on_any_backend, gate, lower_bound, length,
                                              heads, initial_state, segments):
    inputs = bf16_inputs(0, 1, length, *heads, 64, gate=gate, initial_state=initial_state,
                         segments=segments)
    o_ref, state_ref = jitted_run("reference", inputs)
    with interpreted_on_simulated_hopper():
        o, state = run(mosaic_gpu.NAME, inputs, gate_lower_bound=lower_bound)
    assert o.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    assert relative_error(o, o_ref) <= BF16_TOLERANCE["o"]
    assert relative_error(state, state_ref) <= BF16_TOLERANCE["state"]


@pytest.mark.slow
def test_interpreted_kernel_gradients_match_reference_without_initial_state(
        kernel_on_any_backend):
    """Without an initial state the recurrence kernel starts from zeros it does not read, and
    the backward gives the missing state no cotangent. (With one, and both kernels forward:
    `tests/kda/kernels/test_mosaic_gpu_backward.py`'s gradient tests.)"""
    inputs = bf16_inputs(1, 1, 128, 1, 1, 64, initial_state=False, segments=True)
    expected = loss_and_grads("reference", inputs, None)
    with interpreted_on_simulated_hopper():
        actual = loss_and_grads(mosaic_gpu.NAME, inputs, -5.0)
    assert_within_bf16_tolerances(actual, expected)


def assert_preparation_matches_plain_jax(inputs, dim, prepare_kernel=prepare_chunks_kernel):
    """Every operand the recurrence kernel reads, from a preparation kernel and from
    `prepare_chunks`."""
    args = [inputs[name] for name in ("q", "k", "v", "g", "beta")]
    options = preparation_options(inputs, dim)
    expected = jax.jit(lambda *xs: recurrence_operands(prepare_chunks(*xs, chunk_size=64,
                                                                      **options)))(*args)
    actual = jax.jit(lambda *xs: prepare_kernel(*xs, **options))(*args)
    for name, got, want in zip(expected._fields, actual, expected):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        if not jnp.any(want):  # chunk_decay when every chunk starts a document
            np.testing.assert_array_equal(got, want, err_msg=name)
            continue
        # bf16 wgmma operands: the scores, W and U carry bf16 rounding (about 2e-3).
        assert relative_error(got, want) <= BF16_TOLERANCE["o"], name


@pytest.mark.slow
@pytest.mark.parametrize("dim,batch,length,heads,use_qk_l2norm,saturated,save_for_backward", [
    # Four chunks, a padded tail, grouped value heads; the residuals written too (their values
    # are checked where the backward reads them, `tests/kda/kernels/test_prepare_backward.py`).
    (64, 1, 200, (1, 2), True, False, True),
    (128, 2, 64, (1, 1), False, False, False),  # two batch rows of their own documents
    (64, 1, 128, (1, 1), True, True, False),  # g = L everywhere: the tile factors reach e^37.5
])
def test_interpreted_preparation_matches_plain_jax(dim, batch, length, heads, use_qk_l2norm,
                                                   saturated, save_for_backward):
    inputs = bf16_inputs(9, batch, length, *heads, dim, segments=True)
    if saturated:
        inputs["g"] = jnp.full_like(inputs["g"], -5.0)
    if not use_qk_l2norm:
        inputs = with_unit_keys(inputs)

    def prepare_kernel(*args, **options):  # the operands, whether or not residuals come too
        prepared = prepare_chunks_kernel(*args, save_for_backward=save_for_backward, **options)
        return prepared[0] if save_for_backward else prepared

    with interpreted_on_simulated_hopper():
        assert_preparation_matches_plain_jax(inputs, dim, prepare_kernel)


@pytest.mark.slow
def test_interpreted_preparation_without_segment_ids_is_one_document():
    """Without segment ids the kernel reads no document index and its masks are constants: every
    output and residual as with segment ids that never change (no document starts). Two chunks
    of two batch rows: the document index is read per program."""
    inputs = bf16_inputs(4, 2, 128, 1, 1, 64, segments=False)
    args = [inputs[name] for name in ("q", "k", "v", "g", "beta")]
    options = preparation_options(inputs, 64)

    def prepared(segment_ids):
        return jax.tree.leaves(jax.jit(lambda *xs: prepare_chunks_kernel(
            *xs, **{**options, "segment_ids": segment_ids}, save_for_backward=True))(*args))

    with interpreted_on_simulated_hopper():
        without, one_document = prepared(None), prepared(jnp.zeros((2, 128), jnp.int32))
    for got, want in zip(without, one_document):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("save_for_backward", [False, True])
def test_preparation_without_segment_ids_lowers_for_hopper(save_for_backward):
    inputs = bf16_inputs(2, 1, 128, 1, 1, 128, segments=False)
    args = [inputs[name] for name in ("q", "k", "v", "g", "beta")]
    preparation = jax.jit(lambda *xs: prepare_chunks_kernel(
        *xs, save_for_backward=save_for_backward, **preparation_options(inputs, 128)))
    with jax.sharding.use_abstract_mesh(HOPPER):
        lowered = preparation.trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("gate_lower_bound", [None, -5.0])
def test_kernel_lowers_for_hopper(dim, gate_lower_bound):
    """Mosaic GPU's layout inference, wgmma and TMA checks run at lowering, with no GPU."""
    inputs = bf16_inputs(2, 2, 200, 2, 4, dim, initial_state=True, segments=True)
    use_qk_l2norm = inputs.pop("use_qk_l2norm")
    kernel_path = jax.jit(lambda x: mosaic_gpu.mosaic_gpu_kda(
        **x, scale=dim**-0.5, output_final_state=True, use_qk_l2norm=use_qk_l2norm,
        gate_lower_bound=gate_lower_bound))
    with jax.sharding.use_abstract_mesh(HOPPER):
        lowered = kernel_path.trace(inputs).lower(lowering_platforms=("cuda",))
    # Bounded gates: the preparation kernel and the recurrence kernel.
    assert lowered.as_text().count("mosaic_gpu") >= (1 if gate_lower_bound is None else 2)


@pytest.mark.parametrize("save_for_backward", [False, True])
@pytest.mark.parametrize("dim", [64, 128])
def test_preparation_kernel_fits_two_programs_per_sm(dim, save_for_backward):
    """Two programs an SM overlap one's TMA traffic and waits with the other's math; Mosaic GPU
    checks the kernel's shared memory (scratch, reduction scratch, alignment) as it lowers."""
    inputs = bf16_inputs(2, 1, 128, 1, 1, dim, segments=True)
    args = [inputs[name] for name in ("q", "k", "v", "g", "beta")]
    options = preparation_options(inputs, dim)
    preparation = jax.jit(lambda *xs: prepare_chunks_kernel(
        *xs, save_for_backward=save_for_backward, **options))
    with lowering_for_hopper_within(TWO_PROGRAMS_PER_SM):
        preparation.trace(*args).lower(lowering_platforms=("cuda",))


def scanned_in_a_kernel(x):
    """`scanned_cumulative_sum` of float32 x [64, 128] in a one-program kernel."""

    def kernel(x_gmem, out_gmem):
        def body(x_smem, barrier):
            plgpu.copy_gmem_to_smem(x_gmem, x_smem, barrier)
            plgpu.barrier_wait(barrier)
            scanned_cumulative_sum(x_smem)
            plgpu.copy_smem_to_gmem(x_smem, out_gmem)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(body, plgpu.SMEM(x.shape, jnp.float32), plgpu.Barrier())

    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(x.shape, jnp.float32),
                        compiler_params=COMPILER_PARAMS)(x)


@pytest.mark.slow  # about 10 s: interpret mode runs the 64 rows' two-sums one by one
def test_interpreted_scanned_cumulative_sum_is_float32_accurate():
    """Within an ulp of the exact sums everywhere (a plain float32 scan is off by up to 3.5 ulp
    on these gates: its rounding errors add up)."""
    g = -5.0 * jax.random.uniform(jax.random.PRNGKey(0), (64, 128), jnp.float32)
    with interpreted_on_simulated_hopper():
        G = np.asarray(jax.jit(scanned_in_a_kernel)(g))
    exact = np.cumsum(np.asarray(g, np.float64), axis=0)
    assert np.all(np.abs(G - exact) <= np.spacing(np.abs(exact).astype(np.float32)))


def test_scanned_cumulative_sum_refuses_other_widths():
    with pytest.raises(ValueError, match=r"x_smem must be \[64, 128\] .* got \(64, 64\)"):
        jax.jit(scanned_in_a_kernel).trace(jnp.zeros((64, 64), jnp.float32))


def test_unsupported_head_sizes_are_refused():
    inputs = bf16_inputs(3, 1, 64, 1, 1, 32)
    with pytest.raises(ValueError, match=r"K and V in \(64, 128\), got K=32, V=32"):
        mosaic_gpu.mosaic_gpu_kda(**inputs, scale=0.2)


def test_kernel_is_chosen_only_on_hopper_for_bf16_heads_of_64_or_128(monkeypatch):
    assert mosaic_gpu.NAME in kda.available_implementations()
    supported = kda.KDACall(
        batch=2, seq_len=8192, num_heads=16, num_value_heads=16, key_dim=128, value_dim=128,
        dtype=jnp.bfloat16, has_initial_state=True, output_final_state=True,
        has_segment_ids=True, use_qk_l2norm=True, gate_lower_bound=None, backend="gpu")
    monkeypatch.setattr(mosaic_gpu, "_on_hopper", lambda: True)
    assert mosaic_gpu.supports(supported)
    assert mosaic_gpu.supports(supported.__class__(**{**vars(supported), "key_dim": 64,
                                                      "value_dim": 64}))
    for change in ({"backend": "cpu"}, {"dtype": jnp.float32}, {"key_dim": 64},
                   {"key_dim": 32, "value_dim": 32}, {"key_dim": 256, "value_dim": 256}):
        assert not mosaic_gpu.supports(supported.__class__(**{**vars(supported), **change}))
    monkeypatch.setattr(mosaic_gpu, "_on_hopper", lambda: False)
    assert not mosaic_gpu.supports(supported)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU fallback")
def test_on_cpu_auto_falls_back_and_asking_by_name_is_refused():
    inputs = bf16_inputs(4, 1, 70, 2, 2, 64)
    np.testing.assert_array_equal(jitted_run("auto", inputs)[0], jitted_run("chunked", inputs)[0])
    with pytest.raises(ValueError, match=r"impl='mosaic_gpu' does not support this call"):
        run(mosaic_gpu.NAME, inputs)


# On the GPU: real shapes, against the oracle (or the chunked op where the oracle's per-token
# scan would be too slow to differentiate).


# Both kernel paths: Mosaic GPU (Hopper) and Triton (any NVIDIA GPU from Ampere on, with
# jax-triton installed; `tests/kda/kernels/test_triton.py::test_gpu_triton_path_is_available` says
# why not).
KERNEL_PREPARATIONS = {mosaic_gpu.NAME: prepare_chunks_kernel,
                       triton_path.NAME: triton_path.prepare_chunks_kernel}
every_kernel = pytest.mark.parametrize("impl", list(KERNEL_PREPARATIONS))


@functools.cache
def referenceloss_and_grads(*case, **options):
    """The oracle's loss and gradients on `bf16_inputs(*case, **options)`, computed once for both
    kernel paths (at 2 x 8192 the per-token scan's gradient dominates a GPU test's time)."""
    return loss_and_grads("reference", bf16_inputs(*case, **options), None)


@pytest.mark.gpu
@every_kernel
@pytest.mark.parametrize("gate,lower_bound", [("lower_bound", -5.0), ("softplus", None)])
def test_gpu_kernel_matches_reference(impl, gate, lower_bound):
    case = (5, 2, 8192, 16, 16, 128)
    inputs = bf16_inputs(*case, gate=gate, initial_state=True)
    expected = referenceloss_and_grads(*case, gate=gate, initial_state=True)
    actual = loss_and_grads(impl, inputs, lower_bound)
    assert_within_bf16_tolerances(actual, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("initial_state", [True, False])
@pytest.mark.parametrize("gate,lower_bound", [("lower_bound", -5.0), ("softplus", None)])
def test_gpu_forward_of_many_heads_matches_reference(gate, lower_bound, initial_state):
    """The forward alone (no residuals saved) at 8x2048x16x128, where the recurrence's programs
    of 64 columns take two waves; without an initial state the recurrence starts from zeros in
    registers (none is written or read)."""
    inputs = bf16_inputs(7, 8, 2048, 16, 16, 128, gate=gate, initial_state=initial_state)
    o_ref, state_ref = run("reference", inputs)
    o, state = run(mosaic_gpu.NAME, inputs, gate_lower_bound=lower_bound)
    assert relative_error(o, o_ref) <= BF16_TOLERANCE["o"]
    assert relative_error(state, state_ref) <= BF16_TOLERANCE["state"]


@pytest.mark.gpu
@every_kernel
@pytest.mark.parametrize("gate,lower_bound", [("lower_bound", -5.0), ("softplus", None)])
def test_gpu_kernel_packed_documents_and_grouped_heads(impl, gate, lower_bound):
    case = (6, 2, 8192, 8, 16, 128)
    inputs = bf16_inputs(*case, gate=gate, initial_state=True, segments=True)
    expected = referenceloss_and_grads(*case, gate=gate, initial_state=True, segments=True)
    actual = loss_and_grads(impl, inputs, lower_bound)
    assert_within_bf16_tolerances(actual, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("gate,lower_bound", [("lower_bound", -5.0), ("softplus", None)])
def test_gpu_gradients_without_an_initial_state(gate, lower_bound):
    """No initial state: the recurrence starts from zeros in registers and the state gets no
    cotangent (packed documents and grouped heads, as the model calls it)."""
    case = (12, 2, 2048, 8, 16, 128)
    inputs = bf16_inputs(*case, gate=gate, segments=True)
    expected = loss_and_grads("reference", inputs, None)
    actual = loss_and_grads(mosaic_gpu.NAME, inputs, lower_bound)
    assert "initial_state" not in actual
    assert_within_bf16_tolerances(actual, expected)


@pytest.mark.gpu
@every_kernel
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_preparation_matches_plain_jax(impl, dim):
    inputs = bf16_inputs(10, 2, 4100, 4, 16, dim, segments=True)
    assert_preparation_matches_plain_jax(inputs, dim, KERNEL_PREPARATIONS[impl])


@pytest.mark.gpu
@every_kernel
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_kernel_long_sequence(impl, dim):
    inputs = bf16_inputs(7, 1, 65536, 2, 2, dim, initial_state=True)
    o_ref, state_ref = run("reference", inputs)
    o, state = run(impl, inputs, gate_lower_bound=-5.0)
    assert relative_error(o, o_ref) <= BF16_TOLERANCE["o"]
    assert relative_error(state, state_ref) <= BF16_TOLERANCE["state"]


@pytest.mark.gpu
def test_gpu_auto_dispatches_bf16_calls_to_the_kernel(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs["gate_lower_bound"])
        return mosaic_gpu.mosaic_gpu_kda(*args, **kwargs)

    monkeypatch.setattr(kda.api, "_KERNELS", [
        kda.api.Implementation(mosaic_gpu.NAME, spy, mosaic_gpu.supports)])
    inputs = bf16_inputs(8, 1, 256, 2, 2, 128)
    run("auto", inputs, gate_lower_bound=-5.0)
    run("auto", {**inputs, "v": inputs["v"].astype(jnp.float32),
                 "q": inputs["q"].astype(jnp.float32), "k": inputs["k"].astype(jnp.float32)})
    assert calls == [-5.0]  # the float32 call fell back to the chunked op
