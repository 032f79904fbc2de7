"""Running and lowering the MoE's Mosaic GPU kernels without a GPU (tests, CPU benchmarks).

`simulated_hopper` makes an abstract H100-class device current, so lowering for "cuda" runs
Mosaic GPU's compile-time checks (layouts, wgmma, TMA, shared memory); `interpreted_on_cpu`
runs the kernels in Mosaic GPU interpret mode on such a device (optionally detecting races).
"""

import contextlib

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe.kernels.mosaic_gpu.tiling import HOPPER_SMS


def simulated_hopper(num_sms: int = HOPPER_SMS) -> contextlib.AbstractContextManager:
    """An abstract H100-class device to build the kernel for where there is none (CPU).

    Inside it, `jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))` runs Mosaic GPU's
    lowering checks (layouts, wgmma, TMA, shared memory) without a GPU.
    """
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh(
            (),
            (),
            abstract_device=jax.sharding.AbstractDevice(
                device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=num_sms
            ),
        )
    )


@contextlib.contextmanager
def interpreted_on_cpu(num_sms: int = HOPPER_SMS, detect_races: bool = False):
    """Runs the Mosaic GPU kernels called inside in interpret mode on a simulated Hopper (CPU).

    num_sms: the simulated SMs, hence programs; a few make each program walk several tiles.
    """
    interpret = plgpu.InterpretGPUParams(detect_races=detect_races)
    with simulated_hopper(num_sms), plgpu.force_gpu_interpret_mode(interpret):
        yield

