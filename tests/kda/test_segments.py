"""kda.segments: KDA in recomputed segments equals the whole-sequence op (outputs, final state,
gradients), restarts the state where a document begins at a segment boundary, and keeps the
backward's residuals of one segment instead of the whole sequence."""

import jax
import jax.numpy as jnp
import pytest

from experiments.harness import relative_error
from kda.segments import kda_attention_in_segments, segment_starts_document
from tests.kda.calls import jitted_run, run
from tests.kda.inputs import make_inputs


def in_segments(inputs, segment_tokens, impl="chunked", **options):
    return kda_attention_in_segments(**inputs, segment_tokens=segment_tokens,
                                     output_final_state=True, impl=impl, **options)


def documents_starting_at(length, starts):
    """segment ids [1, length] whose documents begin at `starts`."""
    positions = jnp.arange(length)
    return (positions[None, :, None] >= jnp.array(starts)[None, None, :]).sum(-1) * 5 + 1


def test_segment_starts_mark_documents_beginning_at_a_boundary():
    ids = jnp.concatenate([documents_starting_at(256, [64, 100]),
                           documents_starting_at(256, [128])])
    assert segment_starts_document(ids, 64).tolist() == [[False, False], [True, False],
                                                         [False, True], [False, False]]
    assert segment_starts_document(ids, 256).tolist() == [[False, False]]  # one segment


# Each gate path once, each with a document starting at a segment boundary (128 in both).
@pytest.mark.slow
@pytest.mark.parametrize("gate, lower_bound, segment_tokens", [("lower_bound", -5.0, 64),
                                                               ("softplus", None, 128)])
def test_segments_equal_the_whole_sequence_with_documents_at_boundaries(gate, lower_bound,
                                                                         segment_tokens):
    inputs = make_inputs(3, 2, 256, 2, 2, 16, 16, gate=gate, initial_state=True)
    # Row 0: documents begin at 128 and 192 (segment boundaries of 64 tokens; 128 also of 128)
    # and inside a segment at 40.
    inputs["segment_ids"] = jnp.concatenate([documents_starting_at(256, [40, 128, 192]),
                                             documents_starting_at(256, [130, 131, 250])])
    options = dict(gate_lower_bound=lower_bound)
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def outputs_and_gradients(fn):
        """(o, state) of fn and the gradients of a loss of them, in one compiled program."""
        def loss(differentiable):
            o, state = fn({**inputs, **differentiable})
            return jnp.sum(o * jnp.cos(o)) + jnp.sum(state ** 2), (o, state)

        gradients, outputs = jax.jit(jax.grad(loss, has_aux=True))(
            {name: inputs[name] for name in names})
        return outputs, gradients

    expected, want = outputs_and_gradients(lambda x: run("chunked", x, **options))
    actual, got = outputs_and_gradients(lambda x: in_segments(x, segment_tokens, **options))
    for name, got_output, want_output in zip(("o", "state"), actual, expected):
        assert relative_error(got_output, want_output) <= 1e-5, name
    for name in names:
        assert relative_error(got[name], want[name]) <= 1e-5, name


def test_without_documents_and_without_an_initial_state():
    """The segments' zero state and absent documents; each segment runs the oracle (the segments
    call it as they call the chunked op above, and it compiles faster)."""
    inputs = make_inputs(5, 1, 192, 1, 2, 16, 16)
    arrays = {name: x for name, x in inputs.items() if name != "use_qk_l2norm"}
    expected = jitted_run("reference", inputs)
    actual = jax.jit(lambda x: in_segments({**inputs, **x}, 64, impl="reference"))(arrays)
    for got, want in zip(actual, expected):
        assert relative_error(got, want) <= 1e-5


@pytest.mark.parametrize("segment_tokens", [0, 96, 100, 512, 64.0, True])
def test_segment_tokens_must_be_a_multiple_of_64_dividing_the_length(segment_tokens):
    inputs = make_inputs(0, 1, 256, 1, 1, 16, 16)
    with pytest.raises(ValueError, match="segment_tokens must be a positive multiple of 64"):
        in_segments(inputs, segment_tokens)


@pytest.mark.slow
def test_the_backward_keeps_one_segment_of_residuals():
    """Compiled temporary memory of the gradient: 8 segments need far less than one sequence."""
    inputs = make_inputs(0, 1, 4096, 2, 2, 32, 32)
    names = ("q", "k", "v", "g", "beta")

    def temp_bytes(fn):
        def loss(differentiable):
            return jnp.sum(fn({**inputs, **differentiable})[0])
        compiled = jax.jit(jax.grad(loss)).lower({n: inputs[n] for n in names}).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    whole = temp_bytes(lambda x: run("chunked", x, gate_lower_bound=-5.0))
    segmented = temp_bytes(lambda x: in_segments(x, 512, gate_lower_bound=-5.0))
    assert segmented < 0.5 * whole, (segmented, whole)
