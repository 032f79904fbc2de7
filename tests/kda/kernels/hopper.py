"""Mosaic GPU kernels on a simulated Hopper, with no GPU: interpreted on CPU with race detection,
or lowered for Hopper within a shared-memory budget.

Interpret mode (`interpreted_on_simulated_hopper`) runs TMA, barriers and wgmma on CPU and records
data races; lowering (`lowering_for_hopper_within`, or under `HOPPER` alone) runs Mosaic GPU's
layout inference, wgmma and TMA checks, and its shared-memory check against a budget. The budgets
are those of one, two or four programs an SM: an H100/H200 SM has 228 KiB of shared memory and
reserves 1 KiB a program.
"""

import contextlib
import functools
import warnings
from unittest import mock

import jax
import numpy as np
from jax.experimental import io_callback
from jax.experimental.mosaic.gpu import core as mosaic_gpu_core
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import AbstractDevice, AbstractMesh

# Interpret mode has no public race report yet, nor wgmma with a left operand in registers; jax is
# pinned, so the private modules used for both are stable here.
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret
from jax._src.state import types as jax_state

HOPPER = AbstractMesh((), (), abstract_device=AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132))

ONE_PROGRAM_PER_SM = 227 * 1024
TWO_PROGRAMS_PER_SM = 113 * 1024
FOUR_PROGRAMS_PER_SM = 56 * 1024


def _wgmma_with_lhs_in_registers(*, token, mesh_location, thread, acc_allocation_key_as_array,
                                 acc_transforms, lhs, b_allocation_key_as_array, b_transforms,
                                 source_info=None):
    """Interpret mode's wgmma (`gpu_callbacks.wgmma`) with the left operand an array."""
    memory = gpu_callbacks._get_shared_memory()
    logging_info = gpu_callbacks.memory.GPULoggingInfo(mesh_location, thread, source_info)

    def buffer(key_as_array, transforms):
        key = gpu_callbacks.HostAllocationKey.from_array(key_as_array)
        region = memory.access(key, jax.tree.map(
            int, gpu_callbacks._remove_noop_transforms(transforms)))
        return key, region, memory.get_buffer_content(key, region, thread,
                                                      logging_info=logging_info)[0]

    _, _, rhs = buffer(b_allocation_key_as_array, b_transforms)
    acc_key, acc_region, acc = buffer(acc_allocation_key_as_array, acc_transforms)
    memory.store_buffer_content(acc_key, acc_region,
                                acc + np.matmul(np.asarray(lhs), rhs, dtype=acc.dtype), thread,
                                logging_info=logging_info)
    return token


def _interpret_wgmma(original):
    """`JaxprInterpreter._interpret_wgmma_ref_p`, which takes both operands from shared memory,
    extended to a left operand in registers (as Hopper's wgmma takes it, and the recurrence
    kernels give it)."""

    def interpret(self, eqn, token, get_invals):
        if isinstance(eqn.invars[1].aval, jax_state.AbstractRef):
            return original(self, eqn, token, get_invals)
        acc, lhs, rhs, *leaves = get_invals()
        trees = [eqn.params[f"{name}_transforms_tree"] or jax.tree.structure([])
                 for name in ("acc", "a", "b")]
        acc_transforms, _, rhs_transforms = jax.tree.unflatten(
            jax.tree_util.treedef_tuple(trees), leaves)
        acc, acc_transforms = jaxpr_interpret.resolve_ref(eqn.invars[0].aval, acc,
                                                          acc_transforms)
        rhs, rhs_transforms = jaxpr_interpret.resolve_ref(eqn.invars[2].aval, rhs,
                                                          rhs_transforms)
        return io_callback(
            functools.partial(_wgmma_with_lhs_in_registers, source_info=eqn.source_info),
            gpu_callbacks.TOKEN_SHAPE_DTYPE, token=token, mesh_location=self.mesh_location,
            thread=self.thread, acc_allocation_key_as_array=acc, acc_transforms=acc_transforms,
            lhs=lhs, b_allocation_key_as_array=rhs, b_transforms=rhs_transforms), []

    return interpret


@contextlib.contextmanager
def interpreted_on_simulated_hopper():
    """Runs Mosaic GPU kernels in interpret mode on CPU and fails on any data race.

    Interpret mode reads both of wgmma's operands from shared memory; here it also takes the
    left one from registers (`_interpret_wgmma`). Its numpy products warn of no overflow: the
    preparation's score tiles overflow by design in entries that its causal mask selects away
    (`kda.kernels.mosaic_gpu.tiles.transposed_scores`)."""
    gpu_interpret.reset_gpu_interpret_mode_state()
    interpreter = jaxpr_interpret.JaxprInterpreter
    with (warnings.catch_warnings(),
          jax.sharding.use_abstract_mesh(HOPPER),
          plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)),
          mock.patch.object(interpreter, "_interpret_wgmma_ref_p",
                            _interpret_wgmma(interpreter._interpret_wgmma_ref_p))):
        warnings.filterwarnings("ignore", "overflow encountered in matmul", RuntimeWarning)
        yield
    assert not gpu_interpret.get_races().races_found, "the kernel has a data race"


@contextlib.contextmanager
def lowering_for_hopper_within(shared_memory_bytes):
    """Lowers Mosaic GPU kernels for Hopper, failing any kernel over `shared_memory_bytes`.

    Mosaic GPU checks the limit as it lowers a kernel, and jit caches a lowered kernel without
    the limit in its key, so the caches are cleared first: a kernel another test had lowered
    would otherwise pass unchecked."""
    jax.clear_caches()
    with (jax.sharding.use_abstract_mesh(HOPPER),
          mosaic_gpu_core.artificial_shared_memory_limit(shared_memory_bytes)):
        yield
