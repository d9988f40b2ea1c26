"""Which kernel family serves a call, on which code-generation target, and why.

The device's compute capability gives the target arch (``sm_80``, ``sm_90a``, ``sm_100a``...) and
its natural family. ``KernelOptions(arch=...)`` or ``FA4_ARCH`` force a family (the sm80 family
runs on every arch from sm_80 on, so the Ampere path is testable on a Hopper GPU). A family that is
not implemented yet for a direction (forward/backward) falls back to the newest implemented family
the device can run, with a one-time warning; :func:`fa4.explain` reports the same decision.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import Optional

from fa4.config import KernelOptions, env_options, normalize_family

# Families with a working kernel, per direction, newest first. Only these are dispatched to.
IMPLEMENTED = {"fwd": ("sm90", "sm80"), "bwd": ("sm90", "sm80")}
FAMILY_MODULES = {
    ("fwd", "sm90"): "fa4.fwd.sm90",
    ("fwd", "sm80"): "fa4.fwd.sm80",
    ("bwd", "sm80"): "fa4.bwd.sm80",
    ("bwd", "sm90"): "fa4.bwd.sm90",
}
_FAMILY_MIN_CC = {"sm80": (8, 0), "sm90": (9, 0), "sm100": (10, 0)}
# Families built on arch-specific ("a") instructions run on that major version only: wgmma and
# setmaxnreg (sm_90a) do not exist on Blackwell, tcgen05 (sm_100a) not on consumer Blackwell.
_FAMILY_ONLY_MAJOR = {"sm90": 9, "sm100": 10}


def can_run(family: str, cc: tuple[int, int]) -> bool:
    """Whether kernels of ``family`` run on a device of compute capability ``cc``."""
    major = _FAMILY_ONLY_MAJOR.get(family)
    return cc >= _FAMILY_MIN_CC[family] and (major is None or cc[0] == major)


@dataclass(frozen=True)
class Dispatch:
    """The decision for one direction of one call."""

    direction: str  # "fwd" | "bwd"
    family: str  # kernel family that runs
    target: str  # code-generation arch, e.g. "sm_90a"
    reason: str  # one line: why this family
    fallback: bool = False  # True when the preferred family is not implemented

    @property
    def module(self) -> str:
        return FAMILY_MODULES[(self.direction, self.family)]


def target_arch(cc: tuple[int, int]) -> str:
    """Code-generation arch for a compute capability: (9, 0) -> 'sm_90a'."""
    major, minor = cc
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def natural_family(cc: tuple[int, int]) -> str:
    major, _ = cc
    if major == 9:
        return "sm90"
    if major == 10:
        return "sm100"
    return "sm80"  # Ampere, Ada, and consumer Blackwell (sm_120) run the mma.sync path


@functools.lru_cache(maxsize=None)
def device_capability(index: int) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(index)


def capability_of(device) -> tuple[int, int]:
    """:func:`device_capability` of a CUDA ``torch.device`` (no index: the current GPU)."""
    import torch

    return device_capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def num_sms(index: Optional[int] = None) -> int:
    """SM count of GPU ``index`` (default the current one), or an H100/H200's 132 on a machine
    without a GPU (explain() there); cached per index."""
    import torch

    if not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()
                                            ).multi_processor_count


def device_guard(t):
    """``torch.cuda.device(t.device)`` when ``t`` (a tensor or a ``torch.device``) sits on a GPU
    other than the current one, else a no-op context (CPU and meta tensors too).

    Note [Device guard]
        Tensors on ``cuda:1`` while ``cuda:0`` is the current device (one process driving several
        GPUs, a model placed with ``.to("cuda:1")``) are a known way for DSL-built attention to
        launch on the wrong GPU or stream: the launches go through the TVM-FFI environment stream
        and the current CUDA context. Every public entry that launches (the forward, the backward,
        ``flash_attn_combine``) runs under this guard, as flash-attention's C++ extension runs under
        a CUDA device guard. The common case (the tensors on the current GPU) costs one
        ``current_device()`` query."""
    import torch

    device = getattr(t, "device", t)
    index = device.index
    if device.type != "cuda" or index is None:
        return _NO_GUARD
    try:
        current = torch.cuda.current_device()
    except (AssertionError, RuntimeError):  # fake CUDA tensors on a machine without CUDA (CPU tests)
        return _NO_GUARD
    return _NO_GUARD if index == current else torch.cuda.device(index)


_NO_GUARD = contextlib.nullcontext()  # reusable: one object for every call on the current GPU


SM90_SMEM_PER_CTA = 232448  # sm_90a: 227 KB of dynamic shared memory per CTA


# An empty kernel for the driver's cluster occupancy query (resident_clusters): PTX, so the driver
# builds it for whatever GPU it is loaded on, in about a millisecond.
_CLUSTER_PROBE_PTX = b"""
.version 7.8
.target sm_90
.address_size 64
.visible .entry fa4_cluster_probe() { ret; }
\0"""


def resident_clusters(index: Optional[int] = None, size: int = 2) -> Optional[int]:
    """How many clusters of ``size`` CTAs the GPU ``index`` (default the current one) holds at once
    when each CTA takes an SM's whole shared memory, as fa4's persistent grids' CTAs do (one CTA per
    SM): the driver's ``cuOccupancyMaxActiveClusters`` for an empty kernel launched with the opt-in
    shared-memory maximum. A cluster needs ``size`` free SMs of one GPC, so a GPC of an odd SM count
    leaves one SM out of clusters of two, and the count can be below ``num_sms // size``. None
    where it cannot be asked (no GPU, a GPU before Hopper, a driver error); cached per GPU."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        index = index if index is not None else torch.cuda.current_device()
        if device_capability(index)[0] < 9:
            return None
    except Exception:  # (a torch build without CUDA)
        return None
    return _resident_clusters(index, size)


@functools.lru_cache(maxsize=None)
def _resident_clusters(index: int, size: int) -> Optional[int]:
    try:
        from cuda.bindings import driver
    except ImportError:
        return None

    def ok(result):
        result = result if isinstance(result, tuple) else (result,)
        if result[0] != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{result[0]!r}")
        return result[1] if len(result) > 1 else None

    pushed = module = None
    try:
        ok(driver.cuInit(0))
        device = ok(driver.cuDeviceGet(index))
        ok(driver.cuCtxPushCurrent(ok(driver.cuDevicePrimaryCtxRetain(device))))
        pushed = device
        module = ok(driver.cuModuleLoadData(_CLUSTER_PROBE_PTX))
        kernel = ok(driver.cuModuleGetFunction(module, b"fa4_cluster_probe"))
        smem = ok(driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device))
        ok(driver.cuFuncSetAttribute(
            kernel, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = size, 1, 1
        launch = driver.CUlaunchConfig()
        launch.gridDimX, launch.gridDimY, launch.gridDimZ = size, 1, 1
        launch.blockDimX, launch.blockDimY, launch.blockDimZ = 128, 1, 1
        launch.sharedMemBytes = smem
        launch.attrs = [attr]
        launch.numAttrs = 1
        return int(ok(driver.cuOccupancyMaxActiveClusters(kernel, launch)))
    except Exception as e:
        _warn_once(f"fa4: the driver's cluster occupancy query failed on GPU {index} ({e}); the persistent "
                   "multicast grid keeps the SM counts it was measured on")
        return None
    finally:
        if module is not None:
            driver.cuModuleUnload(module)
        if pushed is not None:
            driver.cuCtxPopCurrent()
            driver.cuDevicePrimaryCtxRelease(pushed)


H200_L2_BYTES = 60 << 20  # what torch reports for the H200 (measured: 62914560)


@functools.lru_cache(maxsize=None)
def l2_bytes(index: Optional[int] = None) -> int:
    """L2 cache size of GPU ``index`` (default the current one), or an H200's 60 MB on a machine
    without a GPU; cached per index."""
    import torch

    if not torch.cuda.is_available():
        return H200_L2_BYTES
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()
                                            ).L2_cache_size or H200_L2_BYTES


_warned: set = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, stacklevel=4)


def resolve(direction: str, cc: tuple[int, int], options: Optional[KernelOptions], warn: bool = True) -> Dispatch:
    """Pick the family for ``direction`` on a device of compute capability ``cc``.

    Order: ``options.arch`` > ``FA4_ARCH`` > the device's natural family. A forced family must be
    implemented and runnable on the device (ValueError otherwise); the natural family falls back
    to the newest implemented family the device can run, visibly.
    """
    target = target_arch(cc)
    forced = (options.arch if options is not None else None) or env_options().arch
    if forced is not None:
        fam = normalize_family(forced)
        source = "KernelOptions.arch" if options is not None and options.arch else "FA4_ARCH"
        if fam is None:
            raise ValueError(f"{source}={forced!r} is not a kernel family; expected one of sm80, sm90, sm100")
        if not can_run(fam, cc):
            need = (f"compute capability {_FAMILY_ONLY_MAJOR[fam]}.x" if fam in _FAMILY_ONLY_MAJOR
                    else f"compute capability >= {_FAMILY_MIN_CC[fam][0]}.{_FAMILY_MIN_CC[fam][1]}")
            raise ValueError(f"{source}={forced!r}: the {fam} kernels need {need}, this GPU is {cc[0]}.{cc[1]}")
        if fam not in IMPLEMENTED[direction]:
            raise NotImplementedError(
                f"{source}={forced!r}: fa4 has no {fam} {direction} kernel yet "
                f"(implemented: {', '.join(IMPLEMENTED[direction])})"
            )
        return Dispatch(direction, fam, target, f"forced by {source}={forced!r}")
    natural = natural_family(cc)
    if natural in IMPLEMENTED[direction]:
        return Dispatch(direction, natural, target, f"native family of compute capability {cc[0]}.{cc[1]}")
    for fam in IMPLEMENTED[direction]:
        if can_run(fam, cc):
            msg = (
                f"fa4: no {natural} {direction} kernel yet; compute capability {cc[0]}.{cc[1]} runs the "
                f"{fam} {direction} kernel instead (slower than a native one). fa4.explain() shows the dispatch."
            )
            if warn:
                _warn_once(msg)
            return Dispatch(direction, fam, target, f"fallback: {natural} {direction} not implemented", fallback=True)
    raise NotImplementedError(f"fa4 has no {direction} kernel for compute capability {cc[0]}.{cc[1]} (needs >= 8.0)")


# Every module that defines kernels, for `python -m fa4 compile` and the compile tests. Each has
# `variants(arch) -> list[KernelConfig]` (empty for an arch it does not claim).
KERNEL_MODULES = ("fa4.bwd.preprocess", "fa4.bwd.postprocess", "fa4.fwd.sm80", "fa4.fwd.sm90", "fa4.bwd.sm80",
                  "fa4.bwd.sm90", "fa4.bwd.dq_sm90", "fa4.combine", "fa4.block_sparse")


def all_variants(arch: str, modules=KERNEL_MODULES) -> list:
    """Every module's ``variants(arch)``, plus the postprocess of every backward main-kernel variant
    (a config with a ``dq_fragment``: its dq_accum order), each config once."""
    import importlib

    out = []
    for name in modules:
        out.extend(importlib.import_module(name).variants(arch))
    if "fa4.bwd.postprocess" in modules:
        from fa4.bwd import postprocess

        out.extend(postprocess.config_for(c) for c in list(out) if hasattr(c, "dq_fragment"))
    return list(dict.fromkeys(out))
