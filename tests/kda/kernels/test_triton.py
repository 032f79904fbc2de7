"""The Triton path (`impl="triton"`, jax-triton): its dispatch and launch contracts on CPU (its GPU
tests against the oracle are those of `tests/kda/kernels/test_mosaic_gpu.py`, run for both kernel
paths).

Triton kernels run only on a GPU here (jax-triton needs a CUDA jaxlib); on CPU these tests check
that `import kda` needs neither triton nor jax-triton, that the path is refused with a clear error,
and that the kernels' calls have the shapes of the plain-JAX operands they replace.
"""

import sys

import jax
import jax.numpy as jnp
import pytest

import kda
from kda.chunked import prepare_chunks
from kda.kernels.mosaic_gpu.common import recurrence_operands
from kda.kernels.triton import op as triton_path
from tests.kda.calls import run
from tests.kda.inputs import bf16_inputs
from tests.kda.kernels.preparation import preparation_options

SUPPORTED_CALL = kda.KDACall(
    batch=2, seq_len=8192, num_heads=16, num_value_heads=16, key_dim=128, value_dim=128,
    dtype=jnp.bfloat16, has_initial_state=True, output_final_state=True, has_segment_ids=True,
    use_qk_l2norm=True, gate_lower_bound=-5.0, backend="gpu")


def test_import_kda_needs_neither_triton_nor_jax_triton():
    assert triton_path.NAME in kda.available_implementations()
    assert "triton" not in sys.modules and "jax_triton" not in sys.modules


def test_auto_never_chooses_triton(monkeypatch):
    monkeypatch.setattr(triton_path, "_on_ampere_or_later", lambda: True)
    monkeypatch.setattr(triton_path, "_jax_triton_importable", lambda: True)
    assert triton_path.supports(SUPPORTED_CALL)
    assert kda.api._choose("auto", SUPPORTED_CALL).name != triton_path.NAME
    assert kda.api._choose(triton_path.NAME, SUPPORTED_CALL).name == triton_path.NAME


def test_triton_only_for_bf16_heads_of_64_or_128_on_ampere_or_later(monkeypatch):
    monkeypatch.setattr(triton_path, "_on_ampere_or_later", lambda: True)
    monkeypatch.setattr(triton_path, "_jax_triton_importable", lambda: True)
    assert triton_path.supports(SUPPORTED_CALL)
    with_dims = lambda d: SUPPORTED_CALL.__class__(  # noqa: E731
        **{**vars(SUPPORTED_CALL), "key_dim": d, "value_dim": d})
    assert triton_path.supports(with_dims(64))
    for change in ({"backend": "cpu"}, {"dtype": jnp.float32}, {"key_dim": 64},
                   {"key_dim": 32, "value_dim": 32}, {"key_dim": 256, "value_dim": 256}):
        assert not triton_path.supports(SUPPORTED_CALL.__class__(**{**vars(SUPPORTED_CALL),
                                                                    **change}))
    monkeypatch.setattr(triton_path, "_jax_triton_importable", lambda: False)
    assert not triton_path.supports(SUPPORTED_CALL)
    monkeypatch.setattr(triton_path, "_jax_triton_importable", lambda: True)
    monkeypatch.setattr(triton_path, "_on_ampere_or_later", lambda: False)
    assert not triton_path.supports(SUPPORTED_CALL)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU refusal")
def test_on_cpu_asking_for_triton_is_refused():
    inputs = bf16_inputs(4, 1, 70, 2, 2, 64)
    with pytest.raises(ValueError, match=r"impl='triton' does not support this call"):
        run(triton_path.NAME, inputs)


def test_unsupported_head_sizes_are_refused():
    inputs = bf16_inputs(3, 1, 64, 1, 1, 32)
    inputs.pop("use_qk_l2norm")
    with pytest.raises(ValueError, match=r"K and V in \(64, 128\), got K=32, V=32"):
        triton_path.triton_kda(**inputs, scale=0.2)


@pytest.mark.parametrize("dim", [64, 128])
def test_kernel_launches_have_the_plain_jax_operands_shapes(dim):
    """Outputs, grids and constants of the three launches (no triton needed to build them)."""
    inputs = bf16_inputs(2, 2, 200, 1, 2, dim, initial_state=True, segments=True)
    args = [inputs[name] for name in ("q", "k", "v", "g", "beta")]
    options = preparation_options(inputs, dim)
    expected = jax.eval_shape(lambda *xs: recurrence_operands(
        prepare_chunks(*xs, chunk_size=64, **options)), *args)
    as_spec = lambda x: (x.shape, x.dtype)  # noqa: E731
    scores, solve = triton_path.preparation_launches(*args, **options)
    assert (scores.kernel, solve.kernel) == ("scores_kernel", "solve_kernel")
    assert scores.grid == solve.grid == (4, 2 * 2)
    assert scores.constants["T"] == 200 and solve.constants["NUM_CHUNKS"] == 4
    assert [x.dtype for x in scores.inputs] == [jnp.bfloat16] * 2 + [jnp.float32] * 2 + [
        jnp.int32]
    # q_from_state, k_to_state^T, Aqk, chunk_decay, then N = beta Akk (bf16 like Aqk).
    assert list(map(as_spec, scores.out_shape)) == [as_spec(expected[i]) for i in (2, 3, 4, 5, 4)]
    assert list(map(as_spec, solve.out_shape)) == [as_spec(expected.W), as_spec(expected.U)]

    recurrence = triton_path.recurrence_launch(expected, inputs["initial_state"], jnp.bfloat16)
    assert recurrence.kernel == "recurrence_kernel"
    assert recurrence.grid == (dim // triton_path.BLOCK_V, 2 * 2)
    assert list(map(as_spec, recurrence.out_shape)) == [
        ((2, 2, 4, 64, dim), jnp.bfloat16), ((2, 2, dim, dim), jnp.float32)]


# On the GPU, the Triton path runs the GPU tests of `tests/kda/kernels/test_mosaic_gpu.py`
# (parametrized over both kernel paths); this one says why they would be refused.


@pytest.mark.gpu
def test_gpu_triton_path_is_available():
    """Says why the tests below would be refused: the path needs jax-triton on an Ampere+ GPU."""
    assert triton_path._on_ampere_or_later(), "the GPU's compute capability is below 8.0"
    assert triton_path._jax_triton_importable(), (
        "jax-triton is not importable: pip install --no-deps "
        ".whl/jax_triton-0.3.1-py3-none-any.whl")
