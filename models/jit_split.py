"""A model split for module-level jitted programs: its structure as one static argument whose hash
is computed once, and its arrays as a flat list.

`jax.jit` hashes every static argument at every call. An `nnx.GraphDef` computes its hash from
its whole node tree each time, which for a 16-layer model costs milliseconds of host time per
call: more than a decode step's device time. Flattening an `nnx.State` runs Python code for each
variable as well. The serving engine, `prefill` and `generate` call their programs once per
token, so they pass a `ModelStructure` (hashed once, and interned, so that equal structures are
one object: the jit cache's key comparison is then an identity check) and the variables' leaves
(a list, which jit flattens in C++).

    structure, leaves = split_for_jit(model)          # once per model
    program(structure, leaves, ...)                  # a jitted function, structure static
    model = structure.merge(leaves)                  # inside the program
"""

import functools

import jax
from flax import nnx


class ModelStructure:
    """A model's `nnx.GraphDef` and the tree structure of its variables, hashable at no cost."""

    __slots__ = ("graphdef", "treedef", "_hash")

    def __init__(self, graphdef: nnx.GraphDef, treedef: jax.tree_util.PyTreeDef):
        self.graphdef, self.treedef = graphdef, treedef
        self._hash = hash((graphdef, treedef))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, ModelStructure) and self._hash == other._hash
                                 and self.graphdef == other.graphdef
                                 and self.treedef == other.treedef)

    def merge(self, leaves: list[jax.Array]) -> nnx.Module:
        """The module of these variable leaves (as `split_for_jit` returned them)."""
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))


@functools.lru_cache(maxsize=64)
def _interned(graphdef: nnx.GraphDef, treedef: jax.tree_util.PyTreeDef) -> ModelStructure:
    return ModelStructure(graphdef, treedef)


def split_for_jit(model: nnx.Module) -> tuple[ModelStructure, list[jax.Array]]:
    """(the model's structure, interned: equal structures give the same object; its variables'
    arrays in `jax.tree.leaves` order)."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    return _interned(graphdef, treedef), leaves
