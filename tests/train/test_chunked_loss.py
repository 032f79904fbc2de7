"""train.step.chunked_lm_head_nll: the LM head and the cross-entropy chunk by chunk equal the full
`lm_head_logits` + `cross_entropy` (values and gradients), in the training and evaluation steps
too, and never hold the [tokens, vocab] logits (XLA's memory analysis)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.harness import relative_error
from models.lm import lm_head_logits
from tests.train.toy_model import make_batch, split_state
from train.loop import TrainConfig
from train.step import (FAST_COMPILE_OPTIONS, chunked_lm_head_eval, chunked_lm_head_nll,
                        _forward_options, cross_entropy, make_eval_step, make_train_step)

B, T, D, V = 2, 16, 32, 300


def inputs(dtype):
    """hidden [B, T, D] in dtype, kernel [D, V] float32, targets [B, T], a 0/1 loss mask [B, T]."""
    keys = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(keys[0], (B, T, D)).astype(dtype)
    kernel = 0.2 * jax.random.normal(keys[1], (D, V))
    targets = jax.random.randint(keys[2], (B, T), 0, V)
    mask = (jax.random.uniform(keys[3], (B, T)) > 0.3).astype(jnp.float32)
    return hidden, kernel, targets, mask


def full_nll(hidden, kernel, targets):
    return cross_entropy(lm_head_logits(hidden, kernel), targets)


@functools.partial(jax.jit, static_argnums=0)
def nll_loss_and_grads(chunk_tokens, hidden, kernel, targets, mask):
    """The per-token NLL [B, T] of the chunked path with `chunk_tokens` (None: the full head and
    loss), the masked mean loss and its gradients w.r.t. hidden and kernel, as the step
    computes. One compiled program per path, chunk size, dtype and shape, shared by the tests."""
    def nll(hidden, kernel):
        if chunk_tokens is None:
            return full_nll(hidden, kernel, targets)
        return chunked_lm_head_nll(hidden, kernel, targets, chunk_tokens)

    def loss(hidden, kernel):
        return jnp.sum(nll(hidden, kernel) * mask) / jnp.sum(mask)

    return nll(hidden, kernel), *jax.value_and_grad(loss, argnums=(0, 1))(hidden, kernel)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [T, 4, 5, 40])
def test_chunked_nll_and_gradients_equal_the_full_head_and_loss(dtype, chunk_tokens):
    """One chunk of all T positions runs the full path's arithmetic: bit-identical. Other chunk
    sizes (dividing T, not dividing it, larger than T: padded) give XLA other shapes, whose
    kernels may round the float32 logits and sums differently by an ulp, and d kernel is summed
    chunk by chunk: the NLL within float32 rounding (rtol 1e-6, about ten ulps); the gradients,
    sums that cancel, within 1e-6 of their largest entry (`relative_error`, max norm), and bf16
    d hidden within one bf16 ulp of it (2^-8), where float32 rounding crossed a bf16 rounding
    boundary."""
    hidden, kernel, targets, mask = inputs(dtype)
    want_nll, want_loss, want_grads = nll_loss_and_grads(None, hidden, kernel, targets, mask)
    got_nll, got_loss, got_grads = nll_loss_and_grads(chunk_tokens, hidden, kernel, targets, mask)
    assert got_nll.shape == (B, T) and got_nll.dtype == jnp.float32
    for got, want in zip(got_grads, want_grads):
        assert got.dtype == want.dtype and got.shape == want.shape
    if chunk_tokens == T:
        for got, want in zip((got_nll, got_loss, *got_grads), (want_nll, want_loss, *want_grads)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        return
    np.testing.assert_allclose(got_nll, want_nll, rtol=1e-6)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    d_hidden_bar = 2.0 ** -8 if dtype == jnp.bfloat16 else 1e-6
    assert relative_error(got_grads[0], want_grads[0], norm="max") <= d_hidden_bar
    assert relative_error(got_grads[1], want_grads[1], norm="max") <= 1e-6


def test_chunked_nll_is_stable_at_large_logits():
    """Logits of a few hundred (exp overflows float32 past 88): still the full path's values and
    gradients, all finite (the log-normalizer subtracts each row's max)."""
    hidden, kernel, targets, mask = inputs(jnp.float32)
    hidden = 100.0 * hidden
    _, want_loss, want_grads = nll_loss_and_grads(None, hidden, kernel, targets, mask)
    _, got_loss, got_grads = nll_loss_and_grads(5, hidden, kernel, targets, mask)
    assert float(jnp.max(jnp.abs(lm_head_logits(hidden, kernel)))) > 200
    assert np.isfinite(float(got_loss))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert relative_error(got_grads, want_grads, norm="max") <= 1e-6


def test_chunked_eval_gives_the_nll_and_the_argmax_predictions():
    hidden, kernel, targets, _ = inputs(jnp.bfloat16)
    logits = lm_head_logits(hidden, kernel)
    nll, predictions = chunked_lm_head_eval(hidden, kernel, targets, 5)
    np.testing.assert_allclose(nll, cross_entropy(logits, targets), rtol=1e-6)
    assert predictions.dtype == jnp.int32
    np.testing.assert_array_equal(predictions, jnp.argmax(logits, -1))


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, None])
def test_bad_chunk_tokens_raise(bad):
    hidden, kernel, targets, _ = inputs(jnp.float32)
    with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
        chunked_lm_head_nll(hidden, kernel, targets, bad)
    if bad is not None:
        with pytest.raises(ValueError, match="TrainConfig.loss_chunk_tokens"):
            TrainConfig(loss_chunk_tokens=bad)


def test_chunked_loss_asks_for_a_model_with_an_lm_head():
    class NoHead(nnx.Module):
        pass

    with pytest.raises(ValueError, match="loss_chunk_tokens=8 needs a model whose `lm_head`"):
        _forward_options(NoHead(), 8, {})
    assert _forward_options(NoHead(), None, {}) == {}


@pytest.mark.slow
def test_train_and_eval_steps_with_chunked_loss_equal_the_full_ones():
    """The toy model's step with loss_chunk_tokens=5 (16 positions: a padded last chunk) gives
    the full step's loss, gradient norm and updated parameters to float32 rounding, and its
    evaluation the same NLL and predictions."""
    graphdef, initial = split_state()
    batch = make_batch()
    results = {}
    for chunk in (None, 5):
        step = make_train_step(graphdef, loss_chunk_tokens=chunk,
                               compiler_options=FAST_COMPILE_OPTIONS)
        state, metrics = step(jax.tree.map(jnp.copy, initial), batch)
        evaluate = make_eval_step(graphdef, loss_chunk_tokens=chunk,
                                  compiler_options=FAST_COMPILE_OPTIONS)
        results[chunk] = state, metrics, evaluate(state, batch)
    (full_state, full_metrics, full_eval), (state, metrics, evaluation) = results.values()
    assert float(metrics["skipped"]) == 0.0
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(metrics[key], full_metrics[key], rtol=1e-6, err_msg=key)
    np.testing.assert_allclose(evaluation["nll"], full_eval["nll"], rtol=1e-6)
    assert float(evaluation["targets"]) == float(full_eval["targets"])
    np.testing.assert_array_equal(evaluation["predictions"], full_eval["predictions"])
    changed = 0
    for (path, got), (_, want), (_, before) in zip(*(jax.tree_util.tree_leaves_with_path(s)
                                                     for s in (state, full_state, initial))):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
        changed += bool(jnp.any(got != before))
    assert changed > 10  # the step updated the parameters it compared


def test_chunked_loss_never_holds_the_logits():
    """XLA's compiled memory analysis of loss and gradients at 8192 tokens and vocabulary 32768:
    the full path's temporaries exceed one float32 [tokens, vocab] array (1 GiB), the chunked
    path's (chunks of 512) stay under a tenth of it: its logits exist one chunk at a time."""
    hidden = jax.ShapeDtypeStruct((1, 8192, 64), jnp.bfloat16)
    kernel = jax.ShapeDtypeStruct((64, 32768), jnp.float32)
    targets = jax.ShapeDtypeStruct((1, 8192), jnp.int32)
    logits_bytes = 8192 * 32768 * 4

    def temporaries(nll_fn):
        loss = lambda h, k, t: jnp.sum(nll_fn(h, k, t))  # noqa: E731
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(
            hidden, kernel, targets).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temporaries(full_nll) > logits_bytes
    assert temporaries(lambda h, k, t: chunked_lm_head_nll(h, k, t, 512)) < logits_bytes / 10
