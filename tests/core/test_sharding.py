"""Sharding: the rules table, meshes, annotations, sharded == unsharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from core.sharding import (
    LOGICAL_AXIS_RULES,
    abstract_mesh,
    batch_sharding,
    init_sharded,
    logical_to_mesh,
    make_mesh,
    shard_module,
    state_shardings,
)
from kda.layer import KDAConfig
from models.attention import MLAConfig
from models.config import preset
from models.lm import HybridLM, aux_loss
from moe.config import MoEConfig

VOCABULARY = {"batch", "seq", "embed", "heads", "kv", "mlp", "expert", "latent", "vocab"}


def test_rules_cover_the_vocabulary():
    assert {name for name, _ in LOGICAL_AXIS_RULES} == VOCABULARY


def test_logical_to_mesh_resolution():
    mesh = abstract_mesh(data=2, fsdp=2, tensor=2)
    assert logical_to_mesh(("embed", "mlp"), (8, 8), mesh) == P("fsdp", "tensor")
    # batch takes data and fsdp; embed then finds fsdp used and the expert axis of size 1.
    assert logical_to_mesh(("batch", "seq", "embed"), (4, 3, 8), mesh) == P(
        ("data", "fsdp"), None, None
    )
    # An axis that does not divide the dimension is skipped (replicated), not an error.
    assert logical_to_mesh(("heads", "kv"), (3, 8), mesh) == P(None, None)
    assert logical_to_mesh(("batch",), (2,), mesh) == P("data")
    expert_mesh = abstract_mesh(fsdp=2, expert=4)
    assert logical_to_mesh(("expert", "latent", None, "mlp"), (8, 4, 2, 6), expert_mesh) == P(
        "expert", "fsdp", None, None
    )
    assert logical_to_mesh(("embed", "heads"), (16, 4), expert_mesh) == P(("fsdp", "expert"), None)
    # Context parallelism: seq splits the token axis of activations and of the input batch.
    seq_mesh = abstract_mesh(data=2, seq=4)
    assert logical_to_mesh(("batch", "seq", "embed"), (4, 8, 8), seq_mesh) == P("data", "seq", None)
    assert batch_sharding(seq_mesh, (4, 8)).spec == P("data", "seq")
    assert batch_sharding(seq_mesh, (4,)).spec == P("data")
    with pytest.raises(ValueError, match="unknown logical axis"):
        logical_to_mesh(("model",), (4,), mesh)


def test_make_mesh():
    mesh = make_mesh(fsdp=-1, tensor=2)
    assert dict(mesh.shape) == dict(data=1, fsdp=4, expert=1, seq=1, tensor=2)
    assert mesh.axis_names == ("data", "fsdp", "expert", "seq", "tensor")
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(ValueError, match="devices"):
        make_mesh(data=3)
    with pytest.raises(ValueError, match="at most one -1"):
        make_mesh(data=-1, fsdp=-1)


def test_every_k3_parameter_is_annotated():
    abstract = nnx.eval_shape(lambda: HybridLM(preset("k3", scan_layers=True),
                                               rngs=nnx.Rngs(0)))
    missing = []
    for path, variable in jax.tree_util.tree_flatten_with_path(
        nnx.state(abstract, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]:
        name = jax.tree_util.keystr(path)
        names = variable.get_metadata().get("out_sharding")
        if names is None or len(names) != len(variable.shape):
            missing.append(name)
        else:
            assert set(names) - {None} <= VOCABULARY, name
    assert not missing, f"parameters without logical axis names: {missing}"


# Two layers (KDA with the dense FFN, Gated MLA with the MoE; an AttnRes block per layer) whose
# widths all divide by 8, so a single-axis mesh of 8 devices really splits something.
SHARD_CFG = preset(
    "tiny",
    num_layers=2,
    kda_layers=(1,),
    full_attn_layers=(2,),
    attn_res_block_size=1,
    kda=KDAConfig(num_heads=8, head_dim=8, full_rank_gate=True, impl="reference"),
    mla=MLAConfig(num_heads=8, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=8,
                  qk_rope_head_dim=8, v_head_dim=8),
    moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=32, latent_dim=32, shared_hidden=32,
                  latent_norm=True),
    dense_hidden=64,
)
# Every mesh axis splits in one of three programs (each a compile of the two layers' gradient on
# eight devices): fsdp and expert alone over all eight (one expert a device), and data, expert and
# tensor together, two each.
MESHES = {
    "fsdp": dict(fsdp=8),
    "expert": dict(expert=8),
    "mixed": dict(data=2, expert=2, tensor=2),
}


def logits_and_grads(model, tokens, segment_ids):
    def loss(model):
        logits, stats = model.forward(tokens, segment_ids)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 1]) + aux_loss(stats), logits

    (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return logits, grads


@pytest.fixture(scope="module")
def unsharded():
    model = HybridLM(SHARD_CFG, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 8), 0, SHARD_CFG.vocab_size, jnp.int32)
    segment_ids = jnp.concatenate([jnp.ones((8, 5), jnp.int32), 2 * jnp.ones((8, 3), jnp.int32)],
                                  axis=1)
    logits, grads = jax.jit(logits_and_grads)(model, tokens, segment_ids)
    return model, tokens, segment_ids, logits, grads


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_sharded_equals_unsharded(unsharded, mesh_name):
    model, tokens, segment_ids, want_logits, want_grads = unsharded
    mesh = make_mesh(**MESHES[mesh_name])
    if mesh_name == "mixed":  # built in place, each shard on its device
        sharded = init_sharded(lambda: HybridLM(SHARD_CFG, rngs=nnx.Rngs(0)), mesh)
        for got, want in zip(jax.tree.leaves(nnx.state(sharded, nnx.Param)),
                             jax.tree.leaves(nnx.state(model, nnx.Param))):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    else:  # an existing model moved onto the mesh
        sharded = shard_module(nnx.clone(model), mesh)
    specs = [v.sharding.spec for v in jax.tree.leaves(nnx.state(sharded, nnx.Param))]
    assert any(any(entry is not None for entry in spec) for spec in specs)
    batch = batch_sharding(mesh, tokens.shape)
    with jax.set_mesh(mesh):
        logits, grads = jax.jit(logits_and_grads)(
            sharded, jax.device_put(tokens, batch), jax.device_put(segment_ids, batch)
        )
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(grads))[0],
                                 jax.tree.leaves(nnx.to_pure_dict(want_grads))):
        name = jax.tree_util.keystr(path)
        # The MoE router's gradient is bf16-accurate by design (see moe.routing.router_scores).
        rtol = 2**-7 if name.endswith("['router']") else 1e-4
        np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-4 * np.abs(want).max(),
                                   err_msg=name)


def test_state_shardings_place_parameters_by_name():
    mesh = make_mesh(fsdp=2, expert=2, tensor=2)
    abstract = nnx.eval_shape(lambda: HybridLM(SHARD_CFG, rngs=nnx.Rngs(0)))
    shardings = state_shardings(nnx.state(abstract, nnx.Param), mesh)
    moe = shardings["groups"][1]["layers"][0]["ffn"]  # layer 2: Gated MLA + MoE
    assert moe["expert_w_in"].get_value().spec == P("expert", "fsdp", None, "tensor")
    assert shardings["lm_head"]["kernel"].get_value().spec == P(("fsdp", "expert"), "tensor")
