"""Shared pytest setup: GPU tests skip cleanly on machines without a CUDA GPU; GPU runs allocate
every fa4 output NaN-filled so an element a kernel forgets to write fails its test."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/ helper modules (test kernels)


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine with `pytest -m gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _nan_fill_outputs(request):
    if "gpu" not in request.keywords:
        yield
        return
    from fa4 import ops

    ops.set_nan_fill(True)
    try:
        yield
    finally:
        ops.set_nan_fill(False)


@pytest.fixture
def calls(monkeypatch):
    """CPU runs of the public calls up to the launch (tests/test_fast_path.py, tests/test_dropin.py):
    every kernel is a recorder of ``(config, arguments)``, the GPU an sm_90 of 132 SMs, the tensors
    CPU tensors under ``validate.allow_any_device``; the plan cache cleared before and after."""
    import torch

    import fa4
    from fa4 import jit, ops, validate
    from fa4.fwd import sm90

    got = []
    monkeypatch.setattr(jit, "get_kernel", lambda cfg: lambda *a: got.append((cfg, a)))
    monkeypatch.setattr(sm90, "_num_sms", lambda device: 132)
    monkeypatch.setattr(fa4.arch, "device_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # (CPU tensors: device index None)
    ops._plans.clear()
    with validate.allow_any_device():
        yield got
    ops._plans.clear()


@pytest.fixture
def hang_watchdog():
    """For tests whose failure mode is a hang (a deadlocked kernel cannot be interrupted): if the test
    runs longer than ``seconds`` (``hang_watchdog(seconds)``, default 180), the process prints every
    thread's traceback and exits, so the run fails (a crashed worker under xdist) instead of waiting
    forever."""
    import faulthandler

    def arm(seconds: float = 180.0):
        faulthandler.dump_traceback_later(seconds, exit=True)

    try:
        yield arm
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def ordered_dq(monkeypatch):
    """The dQ of the main kernel (reductions in the deterministic orders under test), not the dQ pass
    (Note [dQ pass] in fa4/bwd/dq_sm90.py), whose dQ does not depend on any order: for the tests of
    those orders, whatever ``DQ_PASS_MIN_HD``'s default. The plan cache (whose key does not hold
    that constant) is cleared before and after, so no plan of the default path is reused."""
    from fa4 import ops
    from fa4.bwd import sm90

    monkeypatch.setattr(sm90, "DQ_PASS_MIN_HD", {True: None, False: None})
    ops._plans.clear()
    yield
    ops._plans.clear()
