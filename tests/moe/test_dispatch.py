"""Dispatch: dropless == naive dense reference (values and gradients); expert parallel == single
device on several meshes; capacity drops are counted; grouped matmul backends."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe.activations import GLUActivation, fused_glu
from moe.dispatch import combine, dropless_moe, expert_parallel_moe, plan_dispatch
from moe.grouped_matmul import grouped_matmul, mosaic_gpu_supports

SITU = GLUActivation("situ")


def naive_moe(x, expert_ids, weights, w_in, w_out, activation):
    """Each token times each of its k experts, weighted and summed (no sorting, no grouping)."""
    w_in_tok = w_in[expert_ids]  # [T, k, W, 2, M]
    hidden = jnp.einsum("tw,tkwcm->tkcm", x, w_in_tok, precision="highest")
    act = activation(hidden[..., 0, :], hidden[..., 1, :])
    y = jnp.einsum("tkm,tkmw->tkw", act, w_out[expert_ids], precision="highest")
    return jnp.sum(y * weights[..., None], axis=1)


def make_problem(seed, tokens, width, experts, hidden, k):
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (tokens, width))
    scores = jax.random.uniform(keys[1], (tokens, experts))
    expert_ids = jax.lax.top_k(scores, k)[1].astype(jnp.int32)
    weights = jax.random.uniform(keys[2], (tokens, k))
    w_in = jax.random.normal(keys[3], (experts, width, 2, hidden)) * width**-0.5
    w_out = jax.random.normal(keys[4], (experts, hidden, width)) * hidden**-0.5
    return x, expert_ids, weights, w_in, w_out


@pytest.mark.slow
@settings(deadline=None, max_examples=4)
@given(
    shape=st.sampled_from([(16, 8, 4, 6, 2), (33, 16, 8, 8, 3)]),
    activation=st.sampled_from(["situ", "swiglu", "clamped_swiglu"]),
    seed=st.integers(0, 100),
)
def test_dropless_equals_naive_reference_values_and_gradients(shape, activation, seed):
    tokens, width, experts, hidden, k = shape
    act = GLUActivation(activation)
    x, ids, weights, w_in, w_out = make_problem(seed, tokens, width, experts, hidden, k)
    ours = functools.partial(dropless_moe, expert_ids=ids, activation=act, backend="xla")
    ref = functools.partial(naive_moe, expert_ids=ids, activation=act)
    args = dict(x=x, weights=weights, w_in=w_in, w_out=w_out)
    cotangent = jax.random.normal(jax.random.key(seed + 7), (tokens, width))

    @jax.jit
    def outputs_and_grads(args):
        def loss(fn, a):
            return jnp.sum(fn(**a) * cotangent)

        return [(fn(**args), jax.grad(functools.partial(loss, fn))(args)) for fn in (ours, ref)]

    (y_ours, grads_ours), (y_ref, grads_ref) = outputs_and_grads(args)
    np.testing.assert_allclose(y_ours, y_ref, rtol=1e-5, atol=1e-5)
    for name in args:
        np.testing.assert_allclose(grads_ours[name], grads_ref[name], rtol=1e-4, atol=1e-5)


def test_dropless_in_bf16_is_close_to_the_float32_reference():
    x, ids, weights, w_in, w_out = make_problem(0, 64, 32, 8, 16, 2)
    ours = dropless_moe(x.astype(jnp.bfloat16), ids, weights, w_in, w_out, SITU, backend="xla")
    assert ours.dtype == jnp.bfloat16
    ref = naive_moe(x, ids, weights, w_in, w_out, SITU)
    np.testing.assert_allclose(ours.astype(jnp.float32), ref, atol=0.05, rtol=0.05)



@pytest.mark.parametrize("kind", ["situ", "swiglu", "clamped_swiglu"])
def test_fused_glu_equals_autodiff_and_saves_only_its_input(kind):
    act = GLUActivation(kind)
    gate_up = (8 * jax.random.normal(jax.random.key(0), (64, 2, 16))).astype(jnp.bfloat16)
    cotangent = jax.random.normal(jax.random.key(1), (64, 16), jnp.bfloat16)

    def plain(a):
        return act(a[:, 0], a[:, 1]).astype(a.dtype)

    ours, ours_pullback = jax.vjp(functools.partial(fused_glu, act), gate_up)
    ref, ref_pullback = jax.vjp(plain, gate_up)
    np.testing.assert_array_equal(ours.astype(jnp.float32), ref.astype(jnp.float32))
    np.testing.assert_array_equal(
        ours_pullback(cotangent)[0].astype(jnp.float32),
        ref_pullback(cotangent)[0].astype(jnp.float32),
    )
    # The backward keeps gate_up alone, no float32 intermediate of the activation.
    residuals = jax.tree.leaves(ours_pullback)
    assert [(r.shape, r.dtype) for r in residuals] == [(gate_up.shape, jnp.bfloat16)]


def test_plan_dispatch_groups_rows_and_inverts():
    row_expert = jnp.array([2, 0, 2, 1, 0, 2])
    valid = jnp.array([True, True, False, True, True, True])
    plan = plan_dispatch(row_expert, 3, valid)
    np.testing.assert_array_equal(plan.group_sizes, [2, 1, 2])
    np.testing.assert_array_equal(plan.order, [1, 4, 3, 0, 5, 2])
    np.testing.assert_array_equal(plan.order[plan.inverse], np.arange(6))


def test_combine_weights_each_copy():
    y = jnp.arange(12.0).reshape(2, 3, 2)
    w = jnp.array([[1.0, 0.0, 2.0], [0.5, 0.5, 0.0]])
    np.testing.assert_allclose(combine(y, w), [[8.0, 11.0], [7.0, 8.0]])


@pytest.fixture(scope="module")
def expert_parallel_problem():
    """(x, ids, weights, w_in, w_out), an output cotangent, and the single-device dropless y and
    gradients of sum(y * cotangent) with respect to (x, weights, w_in, w_out), in one program."""
    x, ids, weights, w_in, w_out = make_problem(1, 64, 16, 8, 8, 2)
    cotangent = jax.random.normal(jax.random.key(3), x.shape)

    @jax.jit
    def single_device(x, weights, w_in, w_out):
        y, pullback = jax.vjp(
            lambda *a: dropless_moe(a[0], ids, a[1], a[2], a[3], SITU, backend="xla"),
            x, weights, w_in, w_out)
        return y, pullback(cotangent)

    return (x, ids, weights, w_in, w_out), cotangent, single_device(x, weights, w_in, w_out)


@pytest.mark.parametrize(
    "mesh_shape, axis_names",
    [((8,), ("expert",)), ((2, 4), ("data", "expert")), ((4, 2), ("data", "expert"))],
)
def test_expert_parallel_equals_single_device(mesh_shape, axis_names, expert_parallel_problem):
    (x, ids, weights, w_in, w_out), cotangent, (single, single_grads) = expert_parallel_problem
    mesh = jax.make_mesh(
        mesh_shape, axis_names, axis_types=(jax.sharding.AxisType.Auto,) * len(axis_names)
    )

    @jax.jit
    def parallel(x, weights, w_in, w_out):
        """y, dropped and the gradients, in one program."""
        y, pullback, dropped = jax.vjp(
            lambda *a: expert_parallel_moe(a[0], ids, a[1], a[2], a[3], SITU, backend="xla",
                                           mesh=mesh),
            x, weights, w_in, w_out, has_aux=True)
        return y, dropped, pullback(cotangent)

    with jax.set_mesh(mesh):
        y, dropped, grads = parallel(x, weights, w_in, w_out)
    assert float(dropped) == 0.0
    np.testing.assert_allclose(y, single, rtol=1e-5, atol=1e-5)
    for ours, ref in zip(grads, single_grads):
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)


def test_expert_parallel_drops_late_choices_first_and_counts_them():
    """All tokens pick expert 0 first: with buffers of 16 rows the overflow is dropped (second
    choices before first choices) and counted, and what is kept equals the dropless result with
    the dropped copies' weights set to 0."""
    shards, tokens, k, experts = 4, 128, 2, 8
    mesh = jax.make_mesh((shards,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    x, _, weights, w_in, w_out = make_problem(2, tokens, 8, experts, 8, k)
    second = jax.random.randint(jax.random.key(9), (tokens,), 1, experts)
    ids = jnp.stack([jnp.zeros(tokens, jnp.int32), second], 1)
    with jax.set_mesh(mesh):
        y, dropped = jax.jit(
            lambda x: expert_parallel_moe(
                x, ids, weights, w_in, w_out, SITU, capacity_factor=1.0, backend="xla", mesh=mesh
            )
        )(x)
    # Reference policy: each source shard fills each destination's buffer (capacity =
    # 32 local tokens * 2 / 4 shards = 16 rows) with its copies in slot-major order.
    local_tokens, capacity = tokens // shards, 16
    kept = np.zeros((tokens, k), bool)
    for shard in range(shards):
        used = np.zeros(shards, int)
        for slot in range(k):
            for token in range(shard * local_tokens, (shard + 1) * local_tokens):
                destination = int(ids[token, slot]) // (experts // shards)
                if used[destination] < capacity:
                    kept[token, slot] = True
                    used[destination] += 1
    assert 0 < float(dropped) == float((~kept).sum())
    assert kept[:, 0].sum() == shards * capacity  # first choices fill shard 0's buffers
    expected = dropless_moe(x, ids, jnp.where(kept, weights, 0.0), w_in, w_out, SITU)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_expert_parallel_skips_masked_copies():
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x, ids, weights, w_in, w_out = make_problem(4, 32, 8, 8, 8, 2)
    mask = jax.random.bernoulli(jax.random.key(5), 0.7, ids.shape)
    with jax.set_mesh(mesh):
        y, dropped = jax.jit(
            lambda x: expert_parallel_moe(
                x, ids, weights, w_in, w_out, SITU, copy_mask=mask, backend="xla", mesh=mesh
            )
        )(x)
    expected = dropless_moe(x, ids, jnp.where(mask, weights, 0.0), w_in, w_out, SITU)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    assert float(dropped) == 0.0


def test_dispatch_rejects_bad_shapes():
    x, ids, weights, w_in, w_out = make_problem(0, 8, 4, 4, 4, 2)
    with pytest.raises(ValueError, match="x must be"):
        dropless_moe(x[None], ids, weights, w_in, w_out, SITU)
    with pytest.raises(ValueError, match="weights must match"):
        dropless_moe(x, ids, weights[:, :1], w_in, w_out, SITU)
    with pytest.raises(ValueError, match="w_in must be"):
        dropless_moe(x, ids, weights, w_in[:, :2], w_out, SITU)
    with pytest.raises(ValueError, match="w_out must be"):
        dropless_moe(x, ids, weights, w_in, w_out[:, :2], SITU)
    with pytest.raises(ValueError, match="needs a mesh"):
        expert_parallel_moe(x, ids, weights, w_in, w_out, SITU)
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    with pytest.raises(ValueError, match="must divide by the 'expert' axis"):
        expert_parallel_moe(x, ids, weights, w_in, w_out, SITU, mesh=mesh)


def test_grouped_matmul_xla_and_errors():
    lhs = jax.random.normal(jax.random.key(0), (10, 4))
    rhs = jax.random.normal(jax.random.key(1), (3, 4, 5))
    sizes = jnp.array([3, 0, 7])
    out = grouped_matmul(lhs, rhs, sizes, backend="xla")
    expected = jnp.concatenate([lhs[:3] @ rhs[0], lhs[3:] @ rhs[2]])
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert not mosaic_gpu_supports(lhs, rhs) or jax.default_backend() == "gpu"
    with pytest.raises(ValueError, match="grouped_matmul needs"):
        grouped_matmul(lhs, rhs[:, :3], sizes)
    with pytest.raises(ValueError, match="group_sizes must be"):
        grouped_matmul(lhs, rhs, sizes[:2])
    with pytest.raises(ValueError, match="backend must be"):
        grouped_matmul(lhs, rhs, sizes, backend="cuda")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="needs a Hopper GPU"):
            grouped_matmul(lhs, rhs, sizes, backend="mosaic_gpu")


@pytest.mark.gpu
def test_mosaic_grouped_matmul_matches_xla_with_gradients():
    keys = jax.random.split(jax.random.key(0), 4)
    lhs = jax.random.normal(keys[0], (1024, 256), jnp.bfloat16)
    rhs = jax.random.normal(keys[1], (8, 256, 384), jnp.bfloat16)
    sizes = jnp.array([0, 300, 100, 124, 0, 200, 200, 100], jnp.int32)
    cotangent = jax.random.normal(keys[2], (1024, 384), jnp.bfloat16)
    assert mosaic_gpu_supports(lhs, rhs)

    def value_and_grads(backend):
        out, pullback = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, backend=backend), lhs, rhs)
        return (out, *pullback(cotangent))

    for ours, ref in zip(value_and_grads("mosaic_gpu"), value_and_grads("xla")):
        np.testing.assert_allclose(
            np.asarray(ours, np.float32), np.asarray(ref, np.float32), rtol=2e-2, atol=2e-1
        )


def kernel_like_grouped_matmul(lhs, rhs, group_sizes, *, backend="auto"):
    """XLA's grouped matmul, behaving past the groups as the Mosaic GPU kernels may: NaN in the
    product's and the input gradient's rows past sum(group_sizes) (left unwritten), and a weight
    gradient that masks those rows by multiplying (JAX's bundled kernel's last block)."""
    del backend
    rows = lhs.shape[0]
    in_groups = (jnp.arange(rows) < jnp.sum(group_sizes))[:, None]
    last_group_to_the_end = group_sizes.at[-1].add(rows - jnp.sum(group_sizes))

    def poisoned(x):
        return jnp.where(in_groups, x, jnp.nan)

    @jax.custom_vjp
    def product(lhs, rhs):
        return poisoned(jax.lax.ragged_dot(lhs, rhs, group_sizes))

    def forward(lhs, rhs):
        return product(lhs, rhs), (lhs, rhs)

    def backward(residuals, out_grad):
        lhs, rhs = residuals
        lhs_grad = poisoned(jax.lax.ragged_dot(out_grad, jnp.swapaxes(rhs, 1, 2), group_sizes))
        masked = lhs * in_groups.astype(lhs.dtype)
        _, pullback = jax.vjp(
            lambda w: jax.lax.ragged_dot(masked, w, last_group_to_the_end), rhs)
        return lhs_grad, pullback(out_grad)[0]

    product.defvjp(forward, backward)
    return product(lhs, rhs)


@pytest.mark.parametrize("rows_past_groups", [False, True])
def test_rows_past_the_groups_cannot_reach_the_weight_gradients(rows_past_groups, monkeypatch):
    """Expert parallelism's capacity slack leaves rows past the groups; with the kernels' garbage
    there (NaN here), `rows_past_groups` keeps the weight gradients and the grouped rows' input
    gradients finite, and without it they are not (the test's witness)."""
    from moe import dispatch

    keys = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(keys[0], (12, 8))
    w_in = jax.random.normal(keys[1], (3, 8, 2, 6)) * 0.3
    w_out = jax.random.normal(keys[2], (3, 6, 8)) * 0.3
    group_sizes = jnp.array([4, 0, 5])  # rows 9-11 belong to no group
    in_groups = (jnp.arange(12) < 9)[:, None]
    cotangent = jnp.where(in_groups, jax.random.normal(keys[3], (12, 8)), 0)  # callers select

    def loss(x, w_in, w_out):
        y = dispatch.expert_mlp(x, group_sizes, w_in, w_out, SITU,
                                rows_past_groups=rows_past_groups)
        return jnp.sum(jnp.where(in_groups, y, 0) * cotangent)

    expected = jax.grad(loss, argnums=(0, 1, 2))(x, w_in, w_out)  # XLA: zeros past the groups
    monkeypatch.setattr(dispatch, "grouped_matmul", kernel_like_grouped_matmul)
    x_grad, w_in_grad, w_out_grad = jax.grad(loss, argnums=(0, 1, 2))(x, w_in, w_out)
    finite = [bool(jnp.isfinite(g).all()) for g in (x_grad[:9], w_in_grad, w_out_grad)]
    assert finite == ([True] * 3 if rows_past_groups else [True, False, False])
    if rows_past_groups:
        for got, want in zip((x_grad[:9], w_in_grad, w_out_grad),
                             (expected[0][:9], *expected[1:])):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
