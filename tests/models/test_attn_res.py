"""Attention Residuals: the read formula, zero-init uniform averaging, K3's block bookkeeping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models import attn_res
from models.attn_res import (
    AttnResRead,
    ResidualStream,
    attn_res_read,
    num_seal_slots,
    seal_period,
    sublayer_input,
)


EPS = 1e-5


def random_stream(key, num_slots, num_sealed, shape=(2, 3, 8), dtype=jnp.float32):
    sealed_key, live_key = jax.random.split(key)
    sealed = jax.random.normal(sealed_key, (num_slots,) + shape) * 3.0
    sealed = sealed.at[num_sealed:].set(0.0)
    live = jax.random.normal(live_key, shape)
    return ResidualStream(sealed.astype(dtype), jnp.int32(num_sealed), live.astype(dtype))


@settings(deadline=None, max_examples=10)
@given(seed=st.integers(0, 2**16), num_sealed=st.sampled_from([0, 1, 3, 4]))
def test_zero_query_is_uniform_average_of_candidates(seed, num_sealed):
    stream = random_stream(jax.random.key(seed), 4, num_sealed)
    read = AttnResRead(8, eps=EPS)
    candidates = np.concatenate([stream.sealed[:num_sealed], stream.live[None]])
    np.testing.assert_allclose(read(stream), candidates.mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["buffer", "planes"])
def test_read_matches_formula(layout):
    stream = random_stream(jax.random.key(0), 5, 3)
    if layout == "planes":
        stream = stream.unstacked(3)
    gain = jax.random.normal(jax.random.key(1), (8,))
    query = jax.random.normal(jax.random.key(2), (8,))
    candidates = np.concatenate([stream.sealed[:3], stream.live[None]]).astype(np.float64)
    normed = candidates / np.sqrt(np.mean(candidates**2, -1, keepdims=True) + EPS)
    scores = normed @ (np.asarray(gain) * np.asarray(query))  # [C, B, T]
    probs = np.exp(scores - scores.max(0))
    probs /= probs.sum(0)
    expected = (probs[..., None] * candidates).sum(0)
    got = attn_res_read(stream, gain, query, EPS)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_sealed", [0, 1, 3])
def test_planes_and_buffer_layouts_agree_in_value_and_gradients(num_sealed):
    stream = random_stream(jax.random.key(7), 4, num_sealed)
    gain, query = (jax.random.normal(jax.random.key(i), (8,)) for i in (8, 9))
    cotangent = jax.random.normal(jax.random.key(10), stream.live.shape)

    def loss(sealed, live, gain, query):
        stream = ResidualStream(sealed, None if isinstance(sealed, tuple) else count, live)
        return jnp.sum(attn_res_read(stream, gain, query, EPS) * cotangent)

    count = stream.num_sealed
    planes = stream.unstacked(num_sealed)
    assert len(planes.sealed) == num_sealed and planes.num_sealed is None
    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
    value, grads = grad(stream.sealed, stream.live, gain, query)
    planes_value, planes_grads = grad(planes.sealed, planes.live, gain, query)
    np.testing.assert_allclose(planes_value, value, rtol=1e-6)
    np.testing.assert_allclose(jnp.stack(planes_grads[0] + (planes_grads[1],)),
                               jnp.concatenate([grads[0][:num_sealed], grads[1][None]]),
                               rtol=1e-5, atol=1e-6)
    for got, want in zip(planes_grads[2:], grads[2:]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_planes_read_and_gradient_never_build_a_candidate_buffer():
    """In the planes layout the read and its backward work plane by plane: no [C, B, T, D]
    stack of candidates (C >= 2) is written, so the gradient of a snapshot costs one plane."""
    planes = random_stream(jax.random.key(11), 4, 3).unstacked(3)
    plane_shape = planes.live.shape

    def loss(sealed, live, gain, query):
        return jnp.sum(attn_res_read(ResidualStream(sealed, None, live), gain, query, EPS))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(
        planes.sealed, planes.live, jnp.ones(8), jnp.ones(8))
    stacked = [eqn.primitive.name for eqn in jaxpr.jaxpr.eqns for var in eqn.outvars
               if var.aval.ndim == 4 and var.aval.shape[1:] == plane_shape]
    assert stacked == []


def test_layout_conversions_and_their_errors():
    stream = random_stream(jax.random.key(12), 4, 2)
    planes = stream.unstacked(2)
    back = planes.stacked(4)
    np.testing.assert_array_equal(back.sealed, stream.sealed)
    assert int(back.num_sealed) == 2 and planes.stacked(4).sealed.shape == (4, 2, 3, 8)
    assert ResidualStream.start(stream.live).stacked(0).sealed.shape == (0, 2, 3, 8)
    with pytest.raises(ValueError, match="num_slots"):
        planes.stacked(1)
    with pytest.raises(ValueError, match="stacked"):
        planes.seal(jnp.bool_(True))
    sealed = planes.seal(True)
    assert len(sealed.sealed) == 3 and not sealed.live.any()
    np.testing.assert_array_equal(sealed.sealed[2], stream.live)


def test_read_is_float32_inside_and_returns_stream_dtype():
    stream = random_stream(jax.random.key(3), 3, 2, dtype=jnp.bfloat16)
    query = jax.random.normal(jax.random.key(4), (8,))
    out = attn_res_read(stream, jnp.ones(8), query, EPS)
    assert out.dtype == jnp.bfloat16
    f32 = ResidualStream(stream.sealed.astype(jnp.float32), stream.num_sealed,
                         stream.live.astype(jnp.float32))
    expected = attn_res_read(f32, jnp.ones(8), query, EPS).astype(jnp.bfloat16)
    np.testing.assert_array_equal(out, expected)


def formula_read(candidates, gain, query):
    """The read as the module docstring writes it, float32, differentiated by autodiff: the
    oracle for `attn_res_read`'s written-out backward."""
    direction = gain * query
    normed = [v / jnp.sqrt(jnp.mean(v**2, -1, keepdims=True) + EPS) for v in candidates]
    probs = jax.nn.softmax(jnp.stack([jnp.sum(n * direction, -1) for n in normed]), axis=0)
    return sum(p[..., None] * v for p, v in zip(probs, candidates))


@pytest.mark.parametrize("layout", ["buffer", "planes"])
@pytest.mark.parametrize("num_sealed", [0, 2, 4])
def test_written_out_backward_matches_autodiff_of_the_formula(layout, num_sealed):
    stream = random_stream(jax.random.key(20 + num_sealed), 4, num_sealed)
    if layout == "planes":
        stream = stream.unstacked(num_sealed)
    gain = 1.0 + 0.3 * jax.random.normal(jax.random.key(1), (8,))
    query = jax.random.normal(jax.random.key(2), (8,))
    cotangent = jax.random.normal(jax.random.key(3), stream.live.shape)

    def ours(sealed, live, gain, query):
        read = attn_res_read(ResidualStream(sealed, stream.num_sealed, live), gain, query, EPS)
        return jnp.sum(read * cotangent)

    def oracle(filled, live, gain, query):
        return jnp.sum(formula_read(tuple(filled) + (live,), gain, query) * cotangent)

    grads = jax.grad(ours, argnums=(0, 1, 2, 3))(stream.sealed, stream.live, gain, query)
    filled = tuple(stream.sealed[i] for i in range(num_sealed))
    expected = jax.grad(oracle, argnums=(0, 1, 2, 3))(filled, stream.live, gain, query)
    d_sealed = grads[0] if layout == "planes" else tuple(grads[0][:num_sealed])
    for got, want in zip(d_sealed + grads[1:], expected[0] + expected[1:]):
        # float32 rounding of sums taken in other orders: relative to the array's largest value
        assert np.max(np.abs(got - want)) <= 1e-6 * np.max(np.abs(want))
    if layout == "buffer":  # unfilled slots are masked out: no gradient reaches them
        np.testing.assert_array_equal(grads[0][num_sealed:], 0.0)


def _equations(jaxpr):
    """Every equation of a jaxpr, those of the jaxprs inside its equations included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from _equations(inner)


def test_read_contracts_each_plane_in_its_own_dtype():
    """The forward's contractions over D and over the candidates are reductions (as dots, XLA
    wrote the normalised float32 candidates out, transposed for a batched matmul). The backward's
    only dots are the direction's gradient: one per candidate, reading the bf16 plane itself
    against three bf16 rows of token weights that sum to the float32 weights."""
    stream = random_stream(jax.random.key(5), 4, 2, dtype=jnp.bfloat16).unstacked(2)

    def read(sealed, live, gain, query):
        out = attn_res_read(ResidualStream(sealed, None, live), gain, query, EPS)
        return jnp.sum(out.astype(jnp.float32))

    args = (stream.sealed, stream.live, jnp.ones(8), jnp.ones(8))
    forward = [eqn.primitive.name for eqn in _equations(jax.make_jaxpr(read)(*args).jaxpr)]
    assert "dot_general" not in forward and "reduce_sum" in forward
    backward = jax.make_jaxpr(jax.grad(read, argnums=(0, 1, 2, 3)))(*args).jaxpr
    dots = [eqn for eqn in _equations(backward) if eqn.primitive.name == "dot_general"]
    assert len(dots) == 3  # two sealed planes and the live sum
    for dot in dots:
        weights, plane = (var.aval for var in dot.invars)
        assert weights.shape == (3,) + stream.live.shape[:2] and weights.dtype == jnp.bfloat16
        assert plane.shape == stream.live.shape and plane.dtype == jnp.bfloat16
        assert dot.outvars[0].aval.shape == (3, 8)


def test_direction_gradient_keeps_float32_accuracy_from_a_bf16_plane():
    """The float32 token weights enter the bf16 product as three bf16 rows that sum to them, so
    the direction's gradient is as accurate as float32 weights times the bf16 plane; one bf16
    row of weights would lose bf16's 2^-9."""
    plane = jax.random.normal(jax.random.key(8), (2, 64, 16)).astype(jnp.bfloat16)
    weights = jax.random.normal(jax.random.key(9), (2, 64)) * 1e-3
    exact = np.einsum("bt,btd->d", np.float64(weights), np.float64(plane.astype(jnp.float32)))
    got = attn_res._token_weighted_sum(weights, plane)
    one_row = jnp.einsum("bt,btd->d", weights.astype(jnp.bfloat16), plane,
                         preferred_element_type=jnp.float32)
    float32_rounding = 128 * np.finfo(np.float32).eps * np.max(np.abs(exact))
    assert np.max(np.abs(got - exact)) < float32_rounding
    assert np.max(np.abs(one_row - exact)) > 100 * float32_rounding


def test_traced_seal_writes_one_slot_not_the_whole_buffer():
    """A scanned layer seals with a traced condition; selecting between the old and the new
    [S, B, T, D] buffers copied all of it (and its gradient) at every scanned sub-layer."""
    stream = random_stream(jax.random.key(6), 4, 2, dtype=jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda stream, when: stream.seal(when))(stream, jnp.bool_(True))
    writers = [eqn.primitive.name for eqn in _equations(jaxpr.jaxpr)  # whole-buffer writers
               if "jaxpr" not in eqn.params
               and any(var.aval.shape == stream.sealed.shape for var in eqn.outvars)]
    assert writers == ["dynamic_update_slice"]
    for when in (False, True):
        sealed = stream.seal(jnp.bool_(when))
        expected = stream.seal(when)
        for got, want in zip(jax.tree.leaves(sealed), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(got, want)


def literal_k3_walk(embedding, sublayers, reads, final_read, block_size):
    """K3's published bookkeeping (moe_arch.md §5.3) transcribed with a growing Python list."""

    def read(sealed, live, gq):
        gain, query = gq
        return attn_res_read(
            ResidualStream(jnp.stack(sealed), jnp.int32(len(sealed)), live), gain, query, EPS
        )

    sealed, live = [], embedding
    for layer in range(len(sublayers) // 2):
        attention, ffn = sublayers[2 * layer], sublayers[2 * layer + 1]
        x = live if not sealed else read(sealed, live, reads[2 * layer])
        if layer % block_size == 0:
            sealed.append(live)
            live = None
        a = attention(x)
        live = a if live is None else live + a
        x = read(sealed, live, reads[2 * layer + 1])
        live = live + ffn(x)
    return read(sealed, live, final_read)


def walk_with_stream(embedding, sublayers, reads, final_read, period, scanned):
    """The same walk through `sublayer_input`, optionally with a traced sub-layer index."""
    stream = ResidualStream.start(embedding)
    if scanned:
        stream = stream.stacked(num_seal_slots(len(sublayers), period))
    for index, (f, (gain, query)) in enumerate(zip(sublayers, reads)):
        read = AttnResRead(embedding.shape[-1], eps=EPS)
        read.gain[...], read.query[...] = gain, query
        x, stream = sublayer_input(stream, read, jnp.int32(index) if scanned else index, period)
        stream = stream.add(f(x))
    return attn_res_read(stream, *final_read, EPS)


@pytest.mark.parametrize("scanned", [False, True])
@pytest.mark.parametrize("num_layers, block_size", [(5, 2), (4, 3), (3, 1)])
def test_block_bookkeeping_matches_k3_walk(num_layers, block_size, scanned):
    d = 8
    keys = iter(jax.random.split(jax.random.key(5), 6 * num_layers + 2))
    weights = [jax.random.normal(next(keys), (d, d)) / np.sqrt(d) for _ in range(2 * num_layers)]
    sublayers = [lambda x, w=w: jnp.tanh(x @ w) for w in weights]
    reads = [
        (1.0 + 0.1 * jax.random.normal(next(keys), (d,)), jax.random.normal(next(keys), (d,)))
        for _ in range(2 * num_layers)
    ]
    final_read = (jnp.ones(d), jax.random.normal(next(keys), (d,)))
    embedding = jax.random.normal(next(keys), (2, 3, d))
    expected = literal_k3_walk(embedding, sublayers, reads, final_read, block_size)
    period = seal_period("block_attn_res", block_size)
    got = walk_with_stream(embedding, sublayers, reads, final_read, period, scanned)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_full_attn_res_reads_every_earlier_sublayer_output():
    d, num_sublayers = 4, 5
    embedding = jax.random.normal(jax.random.key(6), (1, 2, d))
    outputs = [jax.random.normal(jax.random.key(10 + i), (1, 2, d)) for i in range(num_sublayers)]
    period = seal_period("full_attn_res", block_size=12)
    stream = ResidualStream.start(embedding)
    read = AttnResRead(d, eps=EPS)
    for index, out in enumerate(outputs):
        x, stream = sublayer_input(stream, read, index, period)
        # Zero-init query: the input is the plain mean of the embedding and earlier outputs.
        np.testing.assert_allclose(x, jnp.mean(jnp.stack([embedding] + outputs[:index]), 0),
                                   rtol=1e-5, atol=1e-6)
        stream = stream.add(out)


def test_plain_residual_is_running_sum():
    embedding = jnp.ones((1, 2, 4))
    stream = ResidualStream.start(embedding)
    for index in range(3):
        x, stream = sublayer_input(stream, None, index, None)
        np.testing.assert_array_equal(x, embedding * (1 + index))
        stream = stream.add(jnp.ones_like(x))


def test_slot_counts():
    assert num_seal_slots(2 * 93, seal_period("block_attn_res", 12)) == 8  # K3: embedding + 7
    assert num_seal_slots(10, seal_period("full_attn_res", 12)) == 10
    assert num_seal_slots(10, seal_period("plain", 12)) == 0
    with pytest.raises(ValueError, match="residual mode"):
        seal_period("dense", 12)


@pytest.mark.slow
def test_layout_benchmark_smoke(tmp_path):
    """`python -m experiments.bench_attn_res --smoke`: both layouts run and agree, and the
    table is written. The reads compute in float32 and the layouts sum in different orders: the
    gain and query gradients (float32 sums over every token, some with norms of 0.01) differ by
    up to 2.2e-5 relative at the smoke size, the output and embedding gradient by about 1e-7."""
    from experiments import bench_attn_res

    out = tmp_path / "attn_res.md"
    results, difference = bench_attn_res.main(
        ["--smoke", "--repeats", "2", "--warmup", "1", "--out", str(out)])
    assert set(results) == {"buffer", "planes"} and difference < 1e-4
    table = out.read_text()
    assert "| planes |" in table and "| buffer |" in table
