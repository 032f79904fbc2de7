"""MoEConfig.token_chunk: the Stable LatentMoE layer's per-token part, run chunk by chunk along T,
equals the whole layer (outputs, RouterStats, every gradient), on one device and expert parallel,
and its backward pass keeps far fewer temporaries.

The remat policies (`models.lm.REMAT`) over the chunked layer are tested in
tests/models/test_moe_token_chunks.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe.config import MoEConfig
from moe.experts import StableLatentMoE

D_MODEL = 16
CFG = MoEConfig(
    num_experts=8,
    top_k=2,
    expert_hidden=12,
    latent_dim=8,
    shared_hidden=24,
    latent_norm=True,
    balancing="aux_loss",  # the aux loss's gradient reaches the router
    aux_loss_weight=0.1,
    gmm_backend="xla",
)
LENGTH = 64
# Padding inside row 0 (positions 30-35) and at its end (58-63).
SEGMENT_IDS = jnp.array([[1] * 30 + [0] * 6 + [2] * 22 + [0] * 6, [1] * LENGTH])


def make_layer(token_chunk=None, dtype=jnp.float32):
    """The same parameters whatever token_chunk and dtype (float32 parameters); a router bias
    that changes the routing."""
    layer = StableLatentMoE(D_MODEL, dataclasses.replace(CFG, token_chunk=token_chunk),
                            dtype=dtype, rngs=nnx.Rngs(0))
    layer.router_bias[...] = jnp.linspace(-0.1, 0.1, CFG.num_experts)
    return layer


def run(layer):
    """y [B, T, D], RouterStats, d loss / d x and d loss / d params (flat {path: array}) for
    loss = sum(y * cotangent) + aux_loss."""
    x = jax.random.normal(jax.random.key(1), (2, LENGTH, D_MODEL))
    cotangent = jax.random.normal(jax.random.key(2), (2, LENGTH, D_MODEL))

    def loss(layer, x):
        y, stats = layer(x, SEGMENT_IDS)
        return jnp.sum(y.astype(jnp.float32) * cotangent) + stats.aux_loss, (y, stats)

    grad_fn = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (_, (y, stats)), (d_layer, d_x) = nnx.jit(grad_fn)(layer, x)
    d_params = {path: value[...] for path, value in nnx.to_flat_state(d_layer)}
    return y, stats, d_x, d_params


@pytest.fixture(scope="module")
def whole():
    """The unchunked float32 layer's results."""
    return run(make_layer())


def assert_gradients_close(got, want, **tolerance):
    _, _, d_x, d_params = got
    np.testing.assert_allclose(d_x, want[2], **tolerance)
    assert d_params.keys() == want[3].keys()
    for path, d_param in d_params.items():
        np.testing.assert_allclose(d_param, want[3][path], err_msg=str(path), **tolerance)


@pytest.mark.slow
def test_chunked_layer_equals_the_whole_layer(whole):
    # 64 positions in chunks of 5: the last chunk padded (chunks that divide T: the bf16 and the
    # expert-parallel tests).
    y, stats, *_ = got = run(make_layer(5))
    np.testing.assert_allclose(y, whole[0], rtol=1e-5, atol=1e-6)
    # The routing and its statistics are computed on all tokens, as without chunks.
    for field, want in whole[1]._asdict().items():
        np.testing.assert_array_equal(getattr(stats, field), want, err_msg=field)
    assert_gradients_close(got, whole, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_bfloat16_chunks_are_as_precise_as_the_whole_layer(whole):
    """64 chunks of one position in bf16: within the bf16 bars of the unchunked bf16 layer, and
    the expert-weight gradients (summed over the chunks) as close to float32's as its own."""
    chunked, unchunked = run(make_layer(1, jnp.bfloat16)), run(make_layer(None, jnp.bfloat16))
    assert chunked[0].dtype == jnp.bfloat16
    np.testing.assert_allclose(chunked[0].astype(jnp.float32), unchunked[0].astype(jnp.float32),
                               rtol=0.05, atol=0.05)
    assert_gradients_close(chunked, unchunked, rtol=0.05, atol=0.05)

    def error(result, path):
        want = np.asarray(whole[3][path])
        return np.linalg.norm(np.asarray(result[3][path]) - want) / np.linalg.norm(want)

    for path in [("expert_w_in",), ("expert_w_out",)]:
        assert error(chunked, path) <= 1.1 * error(unchunked, path), path


def expert_mesh():
    return jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.mark.slow
def test_chunked_expert_parallel_layer_equals_the_whole_layer(whole):
    # Four chunks of 2 x 16 tokens, each split over the 8 devices.
    with jax.set_mesh(expert_mesh()):
        y, stats, *_ = got = run(make_layer(16))
    np.testing.assert_allclose(y, whole[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(stats.expert_ids, whole[1].expert_ids)
    np.testing.assert_array_equal(stats.load, whole[1].load)
    assert float(stats.dropped) == 0.0
    assert_gradients_close(got, whole, rtol=1e-4, atol=1e-5)


def test_expert_parallel_chunks_must_split_over_the_mesh():
    with jax.set_mesh(expert_mesh()), pytest.raises(ValueError, match="MoEConfig.token_chunk=5"):
        jax.eval_shape(lambda x: make_layer(5)(x), jnp.ones((2, LENGTH, D_MODEL)))


@pytest.mark.slow
def test_chunked_backward_keeps_a_fraction_of_the_temporaries():
    """XLA's temporaries of the layer's gradient at 4096 tokens, whole and in 16 chunks."""
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=64, latent_dim=64, shared_hidden=64,
                    latent_norm=True, gmm_backend="xla")
    x = jax.ShapeDtypeStruct((1, 4096, 64), jnp.bfloat16)

    def temporaries(token_chunk):
        layer = StableLatentMoE(64, dataclasses.replace(cfg, token_chunk=token_chunk),
                                rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

        def loss(params, x):
            y, _ = nnx.merge(graphdef, params, rest)(x)
            return jnp.sum(y.astype(jnp.float32))

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    whole_bytes, chunked_bytes = temporaries(None), temporaries(256)
    print(f"gradient temporaries: whole {whole_bytes / 2**20:.1f} MiB, "
          f"16 chunks {chunked_bytes / 2**20:.1f} MiB")
    assert chunked_bytes < 0.25 * whole_bytes
