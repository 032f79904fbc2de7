"""Gates that break their promise, and non-finite inputs.

* Erasing gates (-1e8, -inf) on the unbounded path: the chunked op against the oracle, forward
  and gradients, scattered and in long runs (a run swamps the small gates after it unless the
  cumulative sum leaves the erasing gates out).
* `check_inputs`: a gate below the bound, above 0 or NaN raises, eagerly and inside `jit` and
  `grad`, naming the argument, the bound and the worst gate; valid gates pass silently.
* Non-finite inputs stay causal: NaN reaches only the outputs of later tokens of the same document
  (and the final state when that document is the row's last), in every implementation.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kda
from experiments.harness import relative_error
from kda.layer import KDA, KDAConfig
from tests.kda.calls import jitted_run, loss_and_grads, run
from tests.kda.inputs import make_inputs
from tests.kda.tolerances import F32_TOLERANCE

# The bar of the chunked op's float32 gradients against the oracle's (tests/kda/test_ops.py).
F32_GRADIENT_TOLERANCE = 1e-4
LENGTH = 200  # four chunks of 64, the last one padded
# Documents of the NaN tests: [0, 90), [90, 150), [150, 200); token 100 lies in chunk 1
# (tokens 64-127), which also holds the end of the first document.
DOCUMENT_STARTS = (0, 90, 150)
BAD_TOKEN = 100
RUN_RAISES = (ValueError, jax.errors.JaxRuntimeError)  # eager / under jit


def erasing_inputs(value, layout, seed=0):
    """Softplus-gate inputs [B=2, T=200, H=1, HV=2, K=V=16] (initial state, packed documents)
    with `value` written into some gates.

    layout "scattered": 5% of the (token, head, channel) entries at random;
    layout "runs": the first 48 tokens of every chunk in half the channels, every other gate
    scaled down 100-fold (long memory), so that what follows a run must be exact in float32.
    Returns (inputs, erased mask [B, T, HV, K]).
    """
    inputs = make_inputs(seed, 2, LENGTH, 1, 2, 16, 16, gate="softplus", initial_state=True,
                         segments=True)
    g = inputs["g"]
    if layout == "scattered":
        erased = jax.random.uniform(jax.random.PRNGKey(seed + 1), g.shape) < 0.05
    else:
        g = g * 0.01
        early = (jnp.arange(LENGTH) % 64) < 48
        erased = jnp.broadcast_to(early[None, :, None, None] & (jnp.arange(16) < 8), g.shape)
    return {**inputs, "g": jnp.where(erased, value, g)}, erased


@functools.cache
def _direct_program(op, options):
    """`op(**arrays, use_qk_l2norm=True, **options)` at scale K^-0.5 under `jit`: one program for
    every call of these options and shapes (eagerly, every operation compiles alone)."""
    return jax.jit(lambda arrays: op(**arrays, use_qk_l2norm=True, output_final_state=True,
                                     scale=arrays["q"].shape[-1] ** -0.5, **dict(options)))


def chunked(inputs, **options):
    """`kda.chunk_kda` called directly (not through `kda_attention`), under `jit`:
    (o [B, T, HV, V], final_state [B, HV, K, V])."""
    return _direct_program(kda.chunk_kda, tuple(sorted(options.items())))(_arrays(inputs))


def oracle(inputs):
    """`kda.kda_reference` called directly, under `jit`: (o [B, T, HV, V],
    final_state [B, HV, K, V])."""
    return _direct_program(kda.kda_reference, ())(_arrays(inputs))


@pytest.mark.parametrize("layout", ["scattered", "runs"])
@pytest.mark.parametrize("value", [-1e8, -jnp.inf])
def test_chunked_op_is_exact_for_erasing_gates(value, layout):
    inputs, _ = erasing_inputs(value, layout)
    (o, state), (o_ref, state_ref) = chunked(inputs), oracle(inputs)
    chex.assert_tree_all_finite((o, state, o_ref, state_ref))
    assert relative_error(o, o_ref) <= F32_TOLERANCE
    assert relative_error(state, state_ref) <= F32_TOLERANCE


@pytest.mark.slow
def test_erasing_gates_at_every_chunk_size():
    inputs, _ = erasing_inputs(-jnp.inf, "runs")
    o_ref, state_ref = oracle(inputs)
    for chunk_size in (16, 32):
        o, state = chunked(inputs, chunk_size=chunk_size)
        assert relative_error(o, o_ref) <= F32_TOLERANCE, chunk_size
        assert relative_error(state, state_ref) <= F32_TOLERANCE, chunk_size


@pytest.mark.slow
@pytest.mark.parametrize("value", [-1e8, -jnp.inf])
def test_chunked_gradients_are_finite_and_exact_for_erasing_gates(value):
    inputs, erased = erasing_inputs(value, "scattered")
    expected = loss_and_grads("reference", inputs, None)
    actual = loss_and_grads("chunked", inputs, None)
    chex.assert_tree_all_finite(actual)
    for name in expected:
        assert relative_error(actual[name], expected[name]) <= F32_GRADIENT_TOLERANCE, name
    # exp(g) is 0 there and so is its derivative: an erasing gate gets no gradient.
    np.testing.assert_array_equal(np.where(erased, actual["g"], 0.0), 0.0)
    np.testing.assert_array_equal(np.where(erased, expected["g"], 0.0), 0.0)


def small_inputs(gate="lower_bound"):
    """Inputs [B=1, T=40, H=1, HV=2, K=V=8] (initial state, packed documents); the lower-bound
    gate's g lies in (-5, 0), the softplus gate's has a -inf at token 9."""
    inputs = make_inputs(2, 1, 40, 1, 2, 8, 8, gate=gate, initial_state=True, segments=True)
    if gate == "softplus":
        inputs["g"] = inputs["g"].at[0, 9, 1, :4].set(-jnp.inf)
    return inputs


# The check runs in `kda_attention` before any implementation; the oracle compiles fastest.
CHECKED_IMPL = "reference"


@functools.cache
def _output_program(options):
    """`kda_attention`'s output under `jit`, one program for every call with these options."""
    return jax.jit(lambda x: run(CHECKED_IMPL, {**x, "use_qk_l2norm": True}, **dict(options))[0])


@functools.cache
def _gradient_program(options):
    """The gradient of sum(o) with respect to g under `jit`, one program for these options."""

    def loss(g, x):
        return jnp.sum(run(CHECKED_IMPL, {**x, "g": g, "use_qk_l2norm": True},
                           **dict(options))[0])

    return jax.jit(jax.grad(loss))


def _arrays(inputs):
    assert inputs["use_qk_l2norm"] is True  # as the programs above take it
    return {n: x for n, x in inputs.items() if n != "use_qk_l2norm"}


def jitted_output(inputs, **options):
    """`kda_attention`'s output under `jit`, waited for (a callback's error arrives here)."""
    call = _output_program(tuple(sorted(options.items())))
    return jax.block_until_ready(call(_arrays(inputs)))


def jitted_gradient(inputs, **options):
    """The gradient of sum(o) with respect to g under `jit`, waited for."""
    arrays = _arrays(inputs)
    call = _gradient_program(tuple(sorted(options.items())))
    return jax.block_until_ready(call(arrays.pop("g"), arrays))


@pytest.mark.parametrize("bad_gate,message", [
    (-8.25, r"g breaks the promise gate_lower_bound=-5: its most negative gate is -8\.25.*"
            r"Pass gate_lower_bound=None.*clamp: jnp\.maximum\(g, -5\)"),
    (-jnp.inf, r"g breaks the promise gate_lower_bound=-5: its most negative gate is -inf"),
    (0.5, r"g must be a log-decay <= 0, but its largest gate is 0\.5"),
    (jnp.nan, r"g has 1 NaN gates"),
])
def test_check_inputs_raises_when_a_gate_breaks_the_promise(bad_gate, message):
    inputs = small_inputs()
    inputs = {**inputs, "g": inputs["g"].at[0, 30, 1, 3].set(bad_gate)}
    options = dict(gate_lower_bound=-5.0, check_inputs=True)
    with pytest.raises(ValueError, match=message):
        run(CHECKED_IMPL, inputs, **options)
    with pytest.raises(RUN_RAISES, match=message):
        jitted_output(inputs, **options)
    with pytest.raises(RUN_RAISES, match=message):
        jitted_gradient(inputs, **options)


def test_check_inputs_is_silent_for_gates_that_keep_the_promise():
    # -inf is allowed without a bound (it erases), and so is a gate at the bound itself.
    bounded = small_inputs()
    bounded["g"] = bounded["g"].at[0, 3].set(-5.0)
    for inputs, lower_bound in ((bounded, -5.0), (small_inputs("softplus"), None)):
        options = dict(gate_lower_bound=lower_bound)
        checked = jitted_output(inputs, check_inputs=True, **options)
        np.testing.assert_array_equal(checked, jitted_output(inputs, **options))
        chex.assert_tree_all_finite(jitted_gradient(inputs, check_inputs=True, **options))


def test_layer_config_turns_the_check_on():
    cfg = KDAConfig(num_heads=2, head_dim=16, gate="softplus", check_inputs=True,
                    impl=CHECKED_IMPL)
    layer = KDA(24, cfg, rngs=nnx.Rngs(0))
    forward = nnx.jit(lambda layer, x: layer(x))
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 40, 24))
    chex.assert_tree_all_finite(forward(layer, x))
    with pytest.raises(RUN_RAISES, match=r"g has \d+ NaN gates"):
        jax.block_until_ready(forward(layer, x.at[0, 7, 0].set(jnp.nan)))
    with pytest.raises(ValueError, match=r"KDAConfig.check_inputs must be a bool"):
        KDAConfig(num_heads=2, head_dim=16, check_inputs="yes")


def packed_inputs(dtype=jnp.float32):
    """Inputs [B=2, T=200, H=1, HV=2, K=V=16] with the documents of `DOCUMENT_STARTS` in both
    rows and an initial state; q/k head 0 serves value heads 0 and 1."""
    inputs = make_inputs(5, 2, LENGTH, 1, 2, 16, 16, gate="softplus", dtype=dtype,
                         initial_state=True)
    segment_ids = np.searchsorted(np.array(DOCUMENT_STARTS), np.arange(LENGTH), side="right")
    return {**inputs, "segment_ids": jnp.broadcast_to(jnp.asarray(segment_ids), (2, LENGTH))}


def expected_nan_tokens(name, token, heads, document_end):
    """bool [B, T, HV]: the outputs a bad `name` at (row 0, `token`, `heads`) may reach."""
    mask = np.zeros((2, LENGTH, 2), bool)
    mask[0, token:token + 1 if name == "q" else document_end, heads] = True
    return mask


def with_nan(inputs, name, token, value=np.nan):
    """`inputs` with `value` at row 0, `token`, head 0, channel 0 of `name`."""
    x = inputs[name]
    index = (0, token, 0) if name == "beta" else (0, token, 0, 0)
    return {**inputs, name: x.at[index].set(value)}


@pytest.mark.parametrize("impl,lower_bound", [("chunked", None), ("chunked", -5.0),
                                              ("reference", None)])
@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_nan_reaches_only_later_tokens_of_its_document(name, impl, lower_bound):
    clean = packed_inputs()
    if lower_bound is not None:
        clean["g"] = jnp.maximum(clean["g"], lower_bound)
    inputs = with_nan(clean, name, BAD_TOKEN)
    o, state = jitted_run(impl, inputs, gate_lower_bound=lower_bound)
    heads = [0, 1] if name in ("q", "k") else [0]  # one q/k head serves both value heads
    expected = expected_nan_tokens(name, BAD_TOKEN, heads, DOCUMENT_STARTS[2])
    np.testing.assert_array_equal(np.isnan(o).any(-1), expected)
    assert np.isnan(o[expected]).all()  # a reached head's output is NaN in every channel
    # Everything else is what the clean inputs give (the bad token's document ends at 150, so
    # the final state, written by the third document, is clean too).
    o_clean, state_clean = jitted_run(impl, clean, gate_lower_bound=lower_bound)
    np.testing.assert_array_equal(np.where(expected[..., None], 0.0, o),
                                  np.where(expected[..., None], 0.0, o_clean))
    np.testing.assert_array_equal(state, state_clean)
    # The oracle itself, called directly, is finite wherever these outputs are.
    o_ref, _ = oracle(inputs)
    assert np.isfinite(np.asarray(o_ref)[~expected]).all()


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_minus_inf_gate_erases_without_a_bound_and_is_confined_with_one(lower_bound):
    clean = packed_inputs()
    clean["g"] = jnp.maximum(clean["g"], -5.0)
    o, state = jitted_run("chunked", with_nan(clean, "g", BAD_TOKEN, -np.inf),
                          gate_lower_bound=lower_bound)
    chex.assert_tree_all_finite(state)
    if lower_bound is None:  # an erasing gate: the oracle's finite result
        chex.assert_tree_all_finite(o)
    else:  # below the bound: a non-finite input, kept to what it reaches
        np.testing.assert_array_equal(np.isnan(o).any(-1),
                                      expected_nan_tokens("g", BAD_TOKEN, [0], DOCUMENT_STARTS[2]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_inf_in_the_last_document_spoils_only_its_heads_final_state(dtype):
    inputs = with_nan(packed_inputs(dtype), "v", 160, np.inf)
    o, state = jitted_run("chunked", inputs)
    np.testing.assert_array_equal(np.isnan(np.asarray(o, np.float32)).any(-1),
                                  expected_nan_tokens("v", 160, [0], LENGTH))
    assert o.dtype == dtype
    np.testing.assert_array_equal(np.isnan(state).all((2, 3)), [[True, False], [False, False]])
    assert np.isfinite(state[[0, 1, 1], [1, 0, 1]]).all()


def test_bad_initial_state_reaches_only_the_first_document():
    inputs = packed_inputs()
    inputs["initial_state"] = inputs["initial_state"].at[1, 0, 2, 3].set(jnp.nan)
    o, state = jitted_run("chunked", inputs)
    expected = np.zeros((2, LENGTH, 2), bool)
    expected[1, :DOCUMENT_STARTS[1], 0] = True
    np.testing.assert_array_equal(np.isnan(o).any(-1), expected)
    chex.assert_tree_all_finite(state)  # the last document never reads the initial state
    _, state = jitted_run("chunked", {**inputs, "segment_ids": None})
    np.testing.assert_array_equal(np.isnan(state).all((2, 3)), [[False, False], [True, False]])


def test_confinement_leaves_finite_inputs_bitwise_unchanged():
    inputs = packed_inputs()
    o, state = jitted_run("chunked", inputs)
    o_direct, state_direct = chunked(inputs)
    np.testing.assert_array_equal(o, o_direct)
    np.testing.assert_array_equal(state, state_direct)
