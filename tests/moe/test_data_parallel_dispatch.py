"""The routed experts on a mesh without an `expert` axis: each device dispatches its own tokens
(`moe.dispatch.data_parallel_moe`), with the single-device layer's outputs and gradients."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.moe.test_experts import SMALL, inputs, make_layer

MESH_SHAPE = {"data": 2, "fsdp": 4}


@nnx.jit
def loss_and_grads(layer, x):
    """sum(y * cos(y index)) and its gradients to every parameter and to x."""

    def loss(layer, x):
        y, _ = layer(x)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape)))

    return nnx.value_and_grad(loss, argnums=(0, 1))(layer, x)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh(tuple(MESH_SHAPE.values()), tuple(MESH_SHAPE),
                         axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_SHAPE))


@pytest.mark.slow
def test_layer_on_a_data_and_fsdp_mesh_equals_one_device(mesh):
    layer, x = make_layer(), inputs(length=16)
    expected = loss_and_grads(layer, x)
    with jax.set_mesh(mesh):
        got = loss_and_grads(layer, x)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_each_device_sorts_only_its_own_token_copies(mesh):
    """The compiled per-device program sorts T·k / P copies, not the whole batch's T·k."""
    layer, x = make_layer(), inputs(length=16)
    copies = x.shape[0] * x.shape[1] * SMALL.top_k
    with jax.set_mesh(mesh):
        text = nnx.jit(lambda m, x: m(x)[0]).lower(layer, x).compile().as_text()
    sorted_lengths = {int(n) for n in re.findall(r"= \(?s32\[(\d+)\][^\n]*? sort\(", text)}
    assert sorted_lengths == {copies // mesh.size}, sorted_lengths
