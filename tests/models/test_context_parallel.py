"""Context parallelism in the model: Gated MLA and the whole hybrid with the tokens split over a
seq mesh axis equal one device (forward and gradients, float32, packed documents across shard
boundaries), through the collectives of `core.context_parallel`. 8 virtual CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core.sharding import batch_sharding, make_mesh, shard_module
from experiments.harness import relative_error
from models.attention import GatedMLA, MLAConfig
from models.lm import HybridLM
from tests.core.test_context_parallel import CONTEXT_MESHES
from tests.core.test_sharding import SHARD_CFG, logits_and_grads
from tests.kda.test_segments import documents_starting_at

LENGTH = 32
# Shards hold 4, 8 or 16 tokens. Row 0: documents begin inside shards (5, 9, 20) and at a
# boundary of every mesh (16); row 1 is one document; row 2's [3, 17) crosses the boundary at 16
# of every mesh; row 3's documents begin at shard boundaries of seq=8 and seq=4 (8, 24).
SEGMENT_IDS = jnp.concatenate([documents_starting_at(LENGTH, starts) for starts in
                               ([5, 9, 16, 20], [], [3, 17], [8, 24])])
# The whole hybrid on two of the meshes: seq=8 (the most shard boundaries) and
# seq=2 x expert=2 x data=2 (expert parallelism and a batch split). seq=4 x data=2 adds no path:
# its layers' collectives are checked on it alone (KDA's op and convolution in tests/kda, Gated
# MLA below).
HYBRID_MESHES = ["seq2_expert2_data2", "seq8"]
MLA_CFG = MLAConfig(num_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                    qk_rope_head_dim=4, v_head_dim=8)


def collectives(fn, *args) -> tuple[int, set[str]]:
    """How many `shard_map`s the program of fn(*args) holds, and which collectives."""
    program = str(jax.make_jaxpr(fn)(*args))
    return (program.count("shard_map["),
            {name for name in ("all_gather", "ppermute") if name in program})


def mla_outputs_and_grads(layer, x):
    def loss(layer, x):
        y = layer(x, segment_ids=SEGMENT_IDS)
        return jnp.sum(y * jnp.cos(y)), y

    grads, y = jax.jit(nnx.grad(loss, argnums=(0, 1), has_aux=True))(layer, x)
    return y, grads


@pytest.fixture(scope="module")
def mla_one_device():
    layer = GatedMLA(32, MLA_CFG, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, LENGTH, 32))
    return layer, x, mla_outputs_and_grads(layer, x)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", sorted(CONTEXT_MESHES))
def test_gated_mla_across_shards_equals_one_device(mla_one_device, mesh_name):
    layer, x, want = mla_one_device
    with jax.set_mesh(make_mesh(**CONTEXT_MESHES[mesh_name])):
        assert collectives(lambda x: layer(x, segment_ids=SEGMENT_IDS), x) == (1, {"all_gather"})
        got = mla_outputs_and_grads(layer, x)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        assert relative_error(a, b) <= 1e-5, jax.tree_util.keystr(path)


@pytest.fixture(scope="module")
def hybrid_one_device():
    """SHARD_CFG's two layers (KDA + dense FFN, Gated MLA + MoE, Block AttnRes) on one device."""
    model = HybridLM(SHARD_CFG, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (4, LENGTH), 0, SHARD_CFG.vocab_size,
                                jnp.int32)
    logits, grads = jax.jit(logits_and_grads)(model, tokens, SEGMENT_IDS)
    return model, tokens, logits, grads


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", HYBRID_MESHES)
def test_hybrid_lm_across_shards_equals_one_device(hybrid_one_device, mesh_name):
    model, tokens, want_logits, want_grads = hybrid_one_device
    mesh = make_mesh(**CONTEXT_MESHES[mesh_name])
    sharded = shard_module(nnx.clone(model), mesh)
    placed = [jax.device_put(x, batch_sharding(mesh, x.shape)) for x in (tokens, SEGMENT_IDS)]
    with jax.set_mesh(mesh):
        # The short convolution's halo, KDA's state maps and MLA's latents cross the shards,
        # each under its own shard_map, and the MoE dispatches each shard's tokens under one
        # (expert or data parallel); the rest runs token by token.
        assert collectives(sharded, *placed) == (4, {"all_gather", "ppermute"})
        logits, grads = jax.jit(logits_and_grads)(sharded, *placed)
    assert logits.sharding.spec[1] == "seq"  # the stream stays split to the head
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(grads))[0],
                                 jax.tree.leaves(nnx.to_pure_dict(want_grads))):
        assert relative_error(got, want) <= 1e-5, jax.tree_util.keystr(path)
