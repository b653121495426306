"""The CUDA driver library through ctypes, for the few calls torch does not expose.

Nothing here needs ``cuda-python`` or a CUDA toolkit: ``libcuda.so.1`` comes with the driver.
Every function returns ``None`` (with a reason where useful) instead of raising when there is
no driver.
"""

from __future__ import annotations

import ctypes
import functools

import torch

__all__ = ["driver_library", "driver_version", "host_pointer_is_device_pointer"]

_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91  # CUdevice_attribute


@functools.cache
def driver_library() -> tuple[ctypes.CDLL | None, str]:
    """``libcuda.so.1``, or ``None`` and why not."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    try:
        return ctypes.CDLL("libcuda.so.1"), "libcuda.so.1"
    except OSError as exc:
        return None, f"cannot load libcuda.so.1: {exc}"


def driver_version() -> int | None:
    """The CUDA version the driver supports, as 1000 * major + 10 * minor (12080: 12.8)."""
    library, _ = driver_library()
    if library is None:
        return None
    version = ctypes.c_int(0)
    if library.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return version.value


@functools.cache
def host_pointer_is_device_pointer(device_index: int) -> bool:
    """Whether a kernel on this device reaches memory registered with ``cudaHostRegister`` at
    its host address (``CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM``). Memory
    from ``cudaHostAlloc`` (torch's pinned memory) always is, under unified addressing."""
    library, _ = driver_library()
    if library is None:
        return False
    device = ctypes.c_int(0)
    if library.cuDeviceGet(ctypes.byref(device), device_index) != 0:
        return False
    value = ctypes.c_int(0)
    attribute = _CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
    if library.cuDeviceGetAttribute(ctypes.byref(value), attribute, device) != 0:
        return False
    return value.value == 1
