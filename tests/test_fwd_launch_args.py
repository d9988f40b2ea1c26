"""The forward launchers hand the compiled kernel the arguments of its signature (CPU: the kernel
is replaced by a recorder), in the order of ``fake_args`` (fa4/fwd/common.py)."""

import pytest
import torch

from fa4 import jit, validate
from fa4.fwd import sm80, sm90


@pytest.mark.parametrize("mod", [sm80, sm90])
@pytest.mark.parametrize("local", [False, True])
def test_run_passes_the_signature(monkeypatch, mod, local):
    calls = []
    monkeypatch.setattr(jit, "get_kernel", lambda cfg: lambda *a: calls.append(a))
    if mod is sm90:
        monkeypatch.setattr(sm90, "_num_sms", lambda device: 132)
    q, k, v = (torch.empty(2, 100, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
    window = (30, 5) if local else (None, None)
    with validate.allow_any_device():
        problem = validate.check_dense(q, k, v, 0.125, not local, window, 0.0)
    cfg = mod.make_config(problem, None, "sm_90a" if mod is sm90 else "sm_80", True)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 100)
    mod.run(cfg, problem, q, k, v, out, lse)
    (args,) = calls
    assert args[:8] == (q, k, v, out, lse, None, None, None)
    assert args[8:13] == (0.125, 1.0, 30 if local else 0, 5 if local else 0, 100)
    assert args[13:] == ((132,) if mod is sm90 else ())
    # as many runtime arguments as the compiled signature (fake_args without the stream)
    assert len(args) == len(jit.kernel_class(cfg).fake_args(cfg)) - 1
