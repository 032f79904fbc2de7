"""KDA with the tokens split over a seq mesh axis equals the single-device op: the op across
shards (outputs, final state, every gradient; on each shard the chunked op, the oracle, or the
oracle in segments), the short convolution's halo, and the shard restarts of packed documents.
8 virtual CPU devices, float32."""

import functools

import jax
import jax.numpy as jnp
import pytest

from core.context_parallel import over_token_shards
from core.sharding import make_mesh
from experiments.harness import relative_error
from kda.api import kda_attention
from kda.context_parallel import context_parallel_kda, shards_start_documents
from kda.layer import causal_depthwise_conv, context_parallel_conv
from kda.segments import kda_attention_in_segments
from tests.core.test_context_parallel import CONTEXT_MESHES
from tests.kda.inputs import make_inputs
from tests.kda.test_segments import documents_starting_at
from tests.kda.tolerances import F32_TOLERANCE

LENGTH = 256
# Shards hold 32, 64 or 128 tokens. Row 0: documents begin inside shards (80, 200), at a boundary
# of every mesh (128) and two tokens after it (130, inside the convolution's halo); row 1 is one
# document across all shards; row 2's [96, 160) crosses the boundary at 128 of every mesh; row
# 3's documents begin at shard boundaries of seq=8 and seq=4 (32, 64, 192).
SEGMENT_IDS = jnp.concatenate([documents_starting_at(LENGTH, starts) for starts in
                               ([80, 128, 130, 200], [], [96, 160], [32, 64, 192])])
NAMES = ("q", "k", "v", "g", "beta", "initial_state")
# What each shard runs: the chunked op, the token-by-token oracle (faster to compile), and the
# oracle in recomputed segments of 64 tokens (`KDAConfig.segment_tokens`).
SHARD_OPS = {
    "seq8": (kda_attention, "chunked"),
    "seq4_data2": (kda_attention, "reference"),
    "seq2_expert2_data2": (functools.partial(kda_attention_in_segments, segment_tokens=64),
                           "reference"),
}


def _inputs():
    inputs = make_inputs(0, 4, LENGTH, 2, 4, 8, 8, initial_state=True)  # GVA: 2 q/k heads
    inputs["segment_ids"] = SEGMENT_IDS
    cotangents = make_inputs(1, 4, LENGTH, 2, 4, 8, 8, initial_state=True)
    return inputs, cotangents["v"] - 0.5, cotangents["initial_state"]


def outputs_and_grads(op, impl):
    """(o, final state, gradients of NAMES) of `op` (kda_attention's signature) under a loss
    that weighs every output and final-state element differently."""
    inputs, d_o, d_state = _inputs()

    def loss(differentiable):
        o, state = op(**{**inputs, **differentiable}, output_final_state=True,
                      gate_lower_bound=-5.0, impl=impl)
        return jnp.sum(o * d_o) + jnp.sum(state * d_state), (o, state)

    grads, (o, state) = jax.jit(jax.grad(loss, has_aux=True))({n: inputs[n] for n in NAMES})
    return {"o": o, "state": state, **grads}


@pytest.fixture(scope="module")
def one_device():
    return outputs_and_grads(kda_attention, "reference")


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", sorted(CONTEXT_MESHES))
def test_op_across_shards_equals_one_device(one_device, mesh_name):
    attend, impl = SHARD_OPS[mesh_name]
    with jax.set_mesh(make_mesh(**CONTEXT_MESHES[mesh_name])):
        sharded = outputs_and_grads(functools.partial(context_parallel_kda, attend=attend), impl)
    for name, want in one_device.items():
        assert relative_error(sharded[name], want) <= F32_TOLERANCE, name


def test_shards_start_documents_where_the_previous_shard_ends_another():
    ids = SEGMENT_IDS[jnp.array([0, 3])]  # documents begin at 80, 128, 130, 200 and 32, 64, 192
    with jax.set_mesh(make_mesh(seq=8)):
        restarts = over_token_shards(
            lambda ids: shards_start_documents(ids).T[:, None, :], in_names=(("batch", "seq"),),
            out_names=("batch", "seq", None), batch=2, length=LENGTH)(ids)[:, 0]
    assert restarts.tolist() == [[False, False, False, False, True, False, False, False],
                                 [False, True, True, False, False, False, True, False]]


@pytest.mark.parametrize("mesh_name", sorted(CONTEXT_MESHES))
def test_convolution_across_shards_equals_one_device(mesh_name):
    x = jax.random.normal(jax.random.key(0), (4, LENGTH, 16))
    weight = jax.random.normal(jax.random.key(1), (4, 16))

    def loss_and_grads(conv):
        def loss(x, weight):
            y = conv(x, weight)
            return jnp.sum(y * jnp.cos(y)), y
        return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(x, weight)

    want = loss_and_grads(lambda x, w: causal_depthwise_conv(x, w, jnp.zeros((4, 3, 16)),
                                                             SEGMENT_IDS)[0])
    with jax.set_mesh(make_mesh(**CONTEXT_MESHES[mesh_name])):
        got = loss_and_grads(lambda x, w: context_parallel_conv(x, w, SEGMENT_IDS))
    for name, a, b in zip(("dx", "d_weight", "y"), jax.tree.leaves(got), jax.tree.leaves(want)):
        assert relative_error(a, b) <= 1e-6, name
