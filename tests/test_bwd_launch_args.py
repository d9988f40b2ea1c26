"""The backward driver hands every kernel it launches (preprocess, main kernel, postprocess or dQ
pass) tensors that fit the kernel's compiled signature (CPU: the kernels are replaced by a checker
of ``fake_args``): ranks, fixed sizes, element widths, and one value for each symbolic size that
several arguments share (the compiled code checks them all at launch: a mismatch raises there)."""

import dataclasses

import pytest
import torch
from cutlass.cute.typing import SymInt

from fa4 import jit, validate
from fa4.bwd import sm80, sm90


def _check_signature(cfg, args):
    """``args`` against ``fake_args(cfg)`` (without the stream): ValueError naming the argument."""
    fake = jit.kernel_class(cfg).fake_args(cfg)[:-1]
    assert len(args) == len(fake), (type(cfg).__name__, len(args), len(fake))
    sizes = {}  # id(SymInt) -> the value bound by the first argument that has it
    for i, (f, a) in enumerate(zip(fake, args)):
        if f is None or not hasattr(f, "element_type"):
            assert (a is None) == (f is None), f"{type(cfg).__name__} argument #{i}: {a!r} against {f!r}"
            continue
        where = f"{type(cfg).__name__} argument #{i} of shape {tuple(a.shape)}"
        assert isinstance(a, torch.Tensor) and a.dim() == len(f.shape), f"{where}: rank, expected {f.shape}"
        assert a.element_size() * 8 == f.element_type.width, f"{where}: {a.dtype} against {f.element_type}"
        for d, (fd, n) in enumerate(zip(f.shape, a.shape)):
            if isinstance(fd, SymInt):
                bound = sizes.setdefault(id(fd), n)
                if bound != n:
                    raise ValueError(f"{where}: mode {d} is {n}, another argument with the same size has {bound}")
                assert n % fd.divisibility == 0, f"{where}: mode {d} = {n} not a multiple of {fd.divisibility}"
            else:
                assert fd == n, f"{where}: mode {d} is {n}, the kernel is compiled for {fd}"


def _problem_and_tensors(d, dv, varlen, h=6, hk=2):
    b, sq, sk = 2, 100, 77
    q = torch.randn(b, sq, h, d, dtype=torch.bfloat16)
    k = torch.randn(b, sk, hk, d, dtype=torch.bfloat16)
    v = torch.randn(b, sk, hk, dv, dtype=torch.bfloat16)
    cu_q = cu_k = None
    with validate.allow_any_device():
        problem = validate.check_dense(q, k, v, d**-0.5, True, (None, None), 0.0)
    if varlen:
        q, k, v = (t.flatten(0, 1).unsqueeze(0) for t in (q, k, v))
        cu_q = torch.tensor([0, sq, 2 * sq], dtype=torch.int32)
        cu_k = torch.tensor([0, sk, 2 * sk], dtype=torch.int32)
        problem = dataclasses.replace(problem, varlen_q=True, varlen_k=True, total_q=2 * sq, total_k=2 * sk)
    return problem, q, k, v, cu_q, cu_k


_MODES = [(sm90, None, False), (sm90, None, True), (sm90, dict(bwd_dq_pass=True), False),
          (sm90, dict(bwd_dq_pass=False), True), (sm90, dict(bwd_two_cta=True), False),
          (sm80, None, True), (sm80, None, False)]
_DIMS = [(64, 64), (128, 128), (192, 192), (256, 256), (192, 128)]
# The two-CTA backward serves padded head dims 64 and 128; the sm80 backward head_dim_v == head_dim.
CASES = [(mod, opts, det, dims) for mod, opts, det in _MODES for dims in _DIMS
         if not (opts and opts.get("bwd_two_cta") and dims not in ((64, 64), (128, 128)))
         and not (mod is sm80 and dims[0] != dims[1])]


@pytest.mark.parametrize("mod,opts,det,dims", CASES)
@pytest.mark.parametrize("varlen", [False, True])
def test_backward_launches_fit_the_signatures(monkeypatch, mod, opts, det, dims, varlen):
    from fa4.config import KernelOptions

    d, dv = dims
    launched = []

    def get_kernel(cfg):
        def run(*args):
            _check_signature(cfg, args)
            launched.append(type(cfg).__name__)
        return run

    monkeypatch.setattr(jit, "get_kernel", get_kernel)
    problem, q, k, v, cu_q, cu_k = _problem_and_tensors(d, dv, varlen)
    arch = "sm_90a" if mod is sm90 else "sm_80"
    cfg = mod.make_config(problem, KernelOptions(**(opts or {})), arch, det)
    out = torch.randn(q.shape[:-1] + (dv,), dtype=torch.bfloat16)
    lse = torch.randn(q.shape[0], q.shape[2], q.shape[1])
    dq, dk, dv_ = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if mod is sm90:
        monkeypatch.setattr("fa4.arch.num_sms", lambda *a, **k: 132)
    mod.run_backward(cfg, problem, torch.randn_like(out), q, k, v, out, lse, None, cu_q, cu_k, None, dq, dk, dv_)
    last = "BwdDqSm90Config" if getattr(cfg, "dq_pass", False) else "BwdPostprocessConfig"
    assert launched == ["BwdPreprocessConfig", type(cfg).__name__, last], launched


@pytest.mark.parametrize("dims", [(128, 128), (192, 128), (80, 80)])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("det", [False, True])
def test_split_group_launch_fits_the_signature(monkeypatch, dims, varlen, det):
    """Note [Split GQA group]: the main kernel takes float32 partials of heads_k * kv_split virtual
    kv heads (MQA, 8 q heads, split 4; deterministic: under the dQ pass), and the driver refuses a
    split that does not divide the group."""
    import dataclasses as dc

    from fa4.config import KernelOptions

    launched = []

    def get_kernel(cfg):
        def run(*args):
            _check_signature(cfg, args)
            if type(cfg).__name__ in ("BwdSm90Config", "BwdSm80Config"):
                assert args[7].dtype == torch.float32 and args[7].shape[2] == 4, args[7].shape
            launched.append(type(cfg).__name__)
        return run

    monkeypatch.setattr(jit, "get_kernel", get_kernel)
    monkeypatch.setattr("fa4.arch.num_sms", lambda *a, **k: 132)
    d, dv = dims
    problem, q, k, v, cu_q, cu_k = _problem_and_tensors(d, dv, varlen, h=8, hk=1)
    opts = KernelOptions(bwd_dq_pass=True) if det else None
    cfg = dc.replace(sm90.make_config(problem, opts, "sm_90a", det), kv_split=4)
    if d == dv:  # the sm80 family's split (off by default, forced here) takes the same arguments
        cfg80 = dc.replace(sm80.make_config(problem, None, "sm_90a", det), kv_split=4)
        sm80.run_backward(cfg80, problem, torch.randn(q.shape[:-1] + (dv,), dtype=torch.bfloat16), q, k, v,
                          torch.randn(q.shape[:-1] + (dv,), dtype=torch.bfloat16),
                          torch.randn(q.shape[0], q.shape[2], q.shape[1]), None, cu_q, cu_k, None,
                          torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        assert launched == ["BwdPreprocessConfig", "BwdSm80Config", "BwdPostprocessConfig"], launched
        launched.clear()
    out = torch.randn(q.shape[:-1] + (dv,), dtype=torch.bfloat16)
    lse = torch.randn(q.shape[0], q.shape[2], q.shape[1])
    dq, dk, dv_ = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    sm90.run_backward(cfg, problem, torch.randn_like(out), q, k, v, out, lse, None, cu_q, cu_k, None, dq, dk, dv_)
    assert launched[1] == "BwdSm90Config", launched
    with pytest.raises(ValueError, match="kv_split"):
        sm90.run_backward(dc.replace(cfg, kv_split=16), problem, torch.randn_like(out), q, k, v, out, lse, None,
                          cu_q, cu_k, None, dq, dk, dv_)


def test_the_checker_catches_a_shared_size_mismatch():
    """The check this file rests on: two arguments with one symbolic size and different values fail
    (as a dq_accum with its own row count against lse_log2's did at launch on the H200)."""
    problem, q, k, v, _, _ = _problem_and_tensors(256, 256, False)
    cfg = dataclasses.replace(sm90.make_config(problem, None, "sm_90a", False), dq_pass=False)
    fake = jit.kernel_class(cfg).fake_args(cfg)
    args = [None if f is None or not hasattr(f, "element_type") else
            torch.empty([32 if isinstance(n, SymInt) else n for n in f.shape],
                        dtype=torch.float32 if f.element_type.width == 32 else torch.bfloat16)
            for f in fake[:-1]]
    for i, f in enumerate(fake[:-1]):
        if f is not None and not hasattr(f, "element_type"):
            args[i] = 0
    args[6] = torch.empty(32, 32, 16, 256)  # dq_accum rows 16, lse_log2 rows 32
    _check_signature(cfg, args[:6] + [torch.empty(32, 32, 32, 256)] + args[7:])
    with pytest.raises(ValueError, match="same size"):
        _check_signature(cfg, args)


def test_compact_grid_checks_the_packed_rows(monkeypatch):
    """The compact varlen grid's size check (``common.launch_grid``) counts the packed K rows of the
    (1, total_k, h_k, d) view, as the kernel's grid does (review of v0.28: it was given the 1)."""
    from fa4.bwd import common

    seen = []
    real = common.launch_grid
    monkeypatch.setattr(common, "launch_grid", lambda *a: seen.append(a) or real(*a))
    monkeypatch.setattr(jit, "get_kernel", lambda cfg: lambda *args: _check_signature(cfg, args))
    monkeypatch.setattr("fa4.arch.num_sms", lambda *a, **k: 132)
    problem, q, k, v, cu_q, cu_k = _problem_and_tensors(128, 128, True)
    cfg = dataclasses.replace(sm90.make_config(problem, None, "sm_90a", False), compact_grid=True)
    out = torch.randn(q.shape[:-1] + (128,), dtype=torch.bfloat16)
    lse = torch.randn(q.shape[0], q.shape[2], q.shape[1])
    sm90.run_backward(cfg, problem, torch.randn_like(out), q, k, v, out, lse, None, cu_q, cu_k, None,
                      torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    assert seen and seen[0][4] == k.shape[1] == 2 * 77, seen
    assert real(cfg, 2, 2, 77, k.shape[1]) == ((154 // cfg.tile_n + 2) * 2, 1, 1)
    with pytest.raises(ValueError, match="packed K rows"):
        real(cfg, 2, 2**26, 77, 8000)
