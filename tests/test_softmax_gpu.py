"""The shared softmax engine on the GPU, through the test kernels of ``fa4._device_tests``.

* exp2 emulation: relative error vs float64 over [-126, 8] (dense), exact 0 at and below -127,
  within 1 bf16 ulp of MUFU ``ex2.approx`` for >= 99% of inputs.
* online softmax with conditional rescale: adversarial score rows (max creeping below the threshold
  every block, jumping above it every block, a 60-nat cliff at the end, fully masked rows, rows that
  start masked) must pass FlashAttention's rule for every (exp2_emu_frac, rescale_threshold), i.e.
  tau = 8 passes exactly when tau = 0 does.
"""

from __future__ import annotations

import math

import pytest
import torch

from fa4.testing import check_close

LN2 = math.log(2.0)


def _target() -> str:
    from fa4 import arch

    return arch.target_arch(torch.cuda.get_device_capability())


def _exp2_kernel():
    from fa4 import jit
    from fa4._device_tests import Exp2TestConfig

    return jit.get_kernel(Exp2TestConfig(arch=_target(), dtype="bf16"))


def _run_exp2(x: torch.Tensor):
    y_emu, y_mufu = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    _exp2_kernel()(x, y_emu, y_mufu)
    torch.cuda.synchronize()
    return y_emu, y_mufu


@pytest.mark.gpu
def test_exp2_emulation_relative_error():
    x = torch.linspace(-126.0, 8.0, 2**24 + 1, device="cuda", dtype=torch.float32)
    # Also every float32 in [-1, 0) near integers, where floor() switches.
    ints = torch.arange(-125, 8, device="cuda", dtype=torch.float32)  # results stay normal floats
    near = torch.cat([torch.nextafter(ints, ints - 1), ints, torch.nextafter(ints, ints + 1)])
    x = torch.cat([x, near])
    y_emu, y_mufu = _run_exp2(x)
    ref = torch.exp2(x.double())
    rel = ((y_emu.double() - ref) / ref).abs()
    assert not torch.isnan(y_emu).any()
    worst = int(rel.argmax())
    assert rel.max() <= 1e-4, f"max rel err {rel.max().item():.3g} at x={x[worst].item()!r}"
    # MUFU for comparison: the emulation is meant to be as good as ex2.approx for softmax purposes.
    rel_mufu = ((y_mufu.double() - ref) / ref).abs()
    assert rel_mufu.max() <= 1e-5


@pytest.mark.gpu
def test_exp2_emulation_underflow_is_exact_zero():
    x = torch.tensor([-127.0, -127.5, -200.0, -1e30, -math.inf], device="cuda")
    y_emu, _ = _run_exp2(x)
    assert torch.all(y_emu == 0), y_emu
    # Between -127 and -126 the result is below the smallest normal and need not be faithful.
    x = torch.linspace(-126.999, -126.0, 4097, device="cuda")
    y_emu, _ = _run_exp2(x)
    assert torch.all((y_emu.double() - torch.exp2(x.double())).abs() <= 2.0**-126)


@pytest.mark.gpu
def test_exp2_emulation_vs_mufu_in_bf16_ulps():
    x = torch.rand(2**22, device="cuda") * -30.0  # softmax exponents: mostly in [-30, 0]
    y_emu, y_mufu = _run_exp2(x)
    a = y_emu.to(torch.bfloat16).view(torch.int16).int()
    b = y_mufu.to(torch.bfloat16).view(torch.int16).int()
    ulps = (a - b).abs()  # positive floats: bit patterns are ordered
    assert (ulps <= 1).float().mean() >= 0.99
    assert ulps.max() <= 2


# --------------------------------------------------------------------------------------------
# Online softmax with conditional rescale
# --------------------------------------------------------------------------------------------

ROWS, COLS, DV, TILE_N = 256, 1024, 32, 64
SCALE_LOG2 = 0.125 * math.log2(math.e)  # softmax_scale = 1/8


def _adversarial_scores(seed: int = 0) -> torch.Tensor:
    """(ROWS, COLS) raw scores s; the kernel exponentiates s * SCALE_LOG2 (log2 units, "z")."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    block = (torch.arange(COLS) // TILE_N).double()
    z = torch.randn(ROWS, COLS, generator=g, dtype=torch.float64) * 0.2
    kind = torch.arange(ROWS) % 8
    z[kind == 0] *= 15.0                                   # plain random rows
    z[kind == 1] += 0.5 * block                            # max creeps by 0.5 < tau per block
    z[kind == 2] += 9.0 * block                            # max jumps by 9 > tau per block
    z[kind == 3] += 0.5 * block + 60.0 * (block == block[-1])   # a cliff of 60 in the last block
    z[kind == 4] += 7.9 * block                            # just under tau, every block
    z[kind == 5] -= 3.0 * block                            # max in the first block, then decreasing
    z[kind == 6, : COLS // 2 + 5] = -math.inf              # the first blocks fully masked
    z[kind == 7] = -math.inf                               # fully masked rows, half of them
    z[(kind == 7).nonzero().flatten()[::2], 700] = 3.0     # with a single visible key
    return (z / SCALE_LOG2).float()


def _softmax_kernel(frac: float, tau: float):
    from fa4 import jit
    from fa4._device_tests import SoftmaxTestConfig

    cfg = SoftmaxTestConfig(arch=_target(), dtype="bf16", tile_m=64, tile_n=TILE_N, head_dim_v=DV,
                            exp2_emu_frac=frac, rescale_threshold=tau)
    return jit.get_kernel(cfg)


def _reference(s: torch.Tensor, v: torch.Tensor, low_precision: bool):
    z = s.double() * SCALE_LOG2 * LN2  # natural-log units
    if low_precision:
        z = z.to(torch.bfloat16).double()
    live = torch.isfinite(z).any(dim=1, keepdim=True)
    lse = torch.logsumexp(z.masked_fill(~live, 0.0), dim=1).masked_fill(~live.squeeze(1), -math.inf)
    p = torch.softmax(z.masked_fill(~live, 0.0), dim=1).masked_fill(~live, 0.0)
    if low_precision:
        out = (p.to(torch.bfloat16) @ v.to(torch.bfloat16)).float()
    else:
        out = (p @ v.double()).float()
    return out, lse.float()


@pytest.mark.gpu
@pytest.mark.parametrize("frac", [0.0, 0.25, 1.0])
@pytest.mark.parametrize("tau", [0.0, 8.0])
def test_online_softmax_adversarial(frac, tau):
    s = _adversarial_scores().cuda()
    v = torch.randn(COLS, DV, device="cuda").to(torch.bfloat16)
    out = torch.full((ROWS, DV), float("nan"), device="cuda")
    lse = torch.full((ROWS,), float("nan"), device="cuda")
    _softmax_kernel(frac, tau)(s, v, out, lse, SCALE_LOG2)
    torch.cuda.synchronize()
    out_ref, lse_ref = _reference(s, v, low_precision=False)
    out_pt, lse_pt = _reference(s, v, low_precision=True)
    # The kernel's O is float32 here; judge it with bf16 rounding noise like a real kernel output.
    check_close("out", out.to(torch.bfloat16), out_ref, out_pt)
    check_close("lse", lse, lse_ref, lse_pt)
    masked = (torch.arange(ROWS, device="cuda") % 8 == 7) & ~torch.isfinite(s).any(dim=1)
    assert torch.all(out[masked] == 0) and torch.all(lse[masked] == -math.inf)
