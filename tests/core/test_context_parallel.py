"""core.context_parallel: the seq mesh axis, the halo and gather collectives, and the checks that
refuse sequences the seq axis cannot split."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.context_parallel import (
    all_tokens,
    context_shards,
    over_token_shards,
    previous_tokens,
)
from core.sharding import make_mesh

# The meshes of 8 virtual CPU devices that the context-parallel tests run on (tests/kda and
# tests/models import them): the seq axis alone, with data parallelism, and with expert and
# data parallelism.
CONTEXT_MESHES = {
    "seq8": dict(seq=8),
    "seq4_data2": dict(seq=4, data=2),
    "seq2_expert2_data2": dict(seq=2, expert=2, data=2),
}


def test_context_shards_is_the_seq_axis_outside_shard_map():
    assert context_shards() == 1
    mesh = make_mesh(seq=4, data=2)
    with jax.set_mesh(mesh):
        assert context_shards() == 4
        seen = []
        over_token_shards(lambda x: (seen.append(context_shards()), x)[1],
                          in_names=(("batch", "seq"),), out_names=("batch", "seq"), batch=2,
                          length=8)(jnp.zeros((2, 8)))
        assert seen == [1]  # inside, each device holds its own tokens
    with jax.set_mesh(make_mesh(data=8)):
        assert context_shards() == 1


def test_halo_and_gather_across_shards():
    x = jnp.arange(2 * 16, dtype=jnp.float32).reshape(2, 16)
    tokens = ("batch", "seq")
    with jax.set_mesh(make_mesh(seq=4, data=2)):
        halo = over_token_shards(lambda x: previous_tokens(x, 3), in_names=(tokens,),
                                 out_names=tokens, batch=2, length=16)(x)
        gathered = over_token_shards(lambda x: all_tokens(x)[:, ::4], in_names=(tokens,),
                                     out_names=tokens, batch=2, length=16)(x)
    x = np.asarray(x)
    # Shard p's halo is the last 3 tokens of shard p - 1; the first shard's is zeros.
    expected_halo = np.concatenate([np.zeros((2, 3))] + [x[:, 4 * p + 1:4 * p + 4]
                                                          for p in range(3)], axis=1)
    np.testing.assert_array_equal(halo, expected_halo)
    # Every shard sees the whole sequence in order (each keeps every 4th token of it here).
    np.testing.assert_array_equal(gathered, np.tile(x[:, ::4], (1, 4)))


def test_sequences_the_seq_axis_cannot_split_are_refused():
    tokens = ("batch", "seq")
    with jax.set_mesh(make_mesh(seq=8)):
        with pytest.raises(ValueError, match="does not divide its length 12"):
            over_token_shards(lambda x: x, in_names=(tokens,), out_names=tokens, batch=1,
                              length=12)
        short = over_token_shards(lambda x: previous_tokens(x, 3), in_names=(tokens,),
                                  out_names=tokens, batch=1, length=16)
        with pytest.raises(ValueError, match="a shard of 2 tokens cannot give the 3 tokens"):
            short(jnp.zeros((1, 16)))
