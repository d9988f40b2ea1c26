"""The split-KV combine on the CPU: argument validation, output layouts, configs and variants,
the warps-per-row heuristic, and one compile with a look at its SASS.

Validation runs on FakeTensors placed on "cuda" (shapes, dtypes, devices, strides; no storage),
with the launcher replaced by a recorder: a bad argument must raise before it, a good call must
reach it with the documented output layouts. The GPU tests are tests/test_combine_gpu.py.
"""

import inspect
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fa4
from fa4 import combine, jit
from fa4.config import ARCHS

F32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16


@pytest.fixture
def launches(monkeypatch):
    calls = []
    monkeypatch.setattr(combine, "combine_into", lambda *a, **k: calls.append((a, k)))
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield calls


def cuda(*shape, dtype=F32):
    return torch.empty(*shape, dtype=dtype, device="cuda")


def dense(splits=3, b=2, s=5, h=4, d=64):
    return cuda(splits, b, s, h, d), cuda(splits, b, s, h)


def packed(splits=3, total=9, h=4, d=64):
    return cuda(splits, total, h, d), cuda(splits, total, h)


def strided(shape, stride, dtype=F32):
    """A non-contiguous layout (FakeTensors of a CUDA-less torch cannot be sliced)."""
    return torch.empty_strided(shape, stride, dtype=dtype, device="cuda")


def contiguous_strides(shape, last=1):
    out, acc = [], last
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def cu(*values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


# --------------------------------------------------------------------------------------------
# The public function: signature, export, import cost
# --------------------------------------------------------------------------------------------


def test_exported_with_flash_attn_cute_signature():
    assert fa4.flash_attn_combine is combine.flash_attn_combine and "flash_attn_combine" in fa4.__all__
    params = inspect.signature(fa4.flash_attn_combine).parameters
    assert list(params) == ["out_partial", "lse_partial", "out", "out_dtype", "cu_seqlens", "seqused",
                            "virtual_batch_idx", "return_lse"]
    assert params["return_lse"].default is True and params["out"].default is None


def test_import_does_not_load_the_dsl():
    code = "import sys, fa4.combine; print('cutlass' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_kernel_class_resolves_lazily():
    cfg = combine.make_config("bf16", 128, "sm_90a")
    cls = jit.kernel_class(cfg)
    from fa4.combine_kernel import FlashCombine

    assert cls is FlashCombine is combine.FlashCombine
    with pytest.raises(AttributeError):
        combine.NoSuchThing  # noqa: B018


# --------------------------------------------------------------------------------------------
# Output layouts of a valid call (reaches the launcher)
# --------------------------------------------------------------------------------------------


def test_dense_outputs(launches):
    op, lp = dense(splits=3, b=2, s=5, h=4, d=72)
    out, lse = fa4.flash_attn_combine(op, lp, out_dtype=BF16)
    assert out.shape == (2, 5, 4, 72) and out.dtype == BF16 and out.is_contiguous()
    # (b, s, h) view of (b, h, s) memory, as flash_attn.cute returns it
    assert lse.shape == (2, 5, 4) and lse.dtype == F32 and lse.stride() == (20, 1, 5)
    assert lse.transpose(1, 2).is_contiguous()
    (args, _), = launches
    assert args[2] is out and args[3] is lse and args[4] is None and args[5] is None


def test_packed_outputs(launches):
    op, lp = packed(splits=2, total=9, h=4, d=128)
    c = cu(0, 4, 9)
    out, lse = fa4.flash_attn_combine(op, lp, cu_seqlens=c, seqused=cu(3, 5))
    assert out.shape == (9, 4, 128) and out.dtype == F32  # default: out_partial's dtype
    assert lse.shape == (9, 4) and lse.stride() == (1, 9)  # (total_q, h) view of (h, total_q)
    (args, _), = launches
    assert args[4] is c


def test_return_lse_false_and_user_out(launches):
    op, lp = dense()
    user = cuda(2, 5, 4, 64, dtype=FP16)
    out, lse = fa4.flash_attn_combine(op, lp, out=user, return_lse=False)
    assert out is user and lse is None
    (args, _), = launches
    assert args[3] is None


def test_16_bit_partials_are_widened(launches):
    """bf16 / fp16 partials (stacked outputs of calls over key chunks) are taken as flash_attn.cute
    takes them: widened to float32 for the kernel, the output in their dtype by default."""
    op, lp = dense(splits=2, b=1, s=3, h=2, d=64)
    out, _ = fa4.flash_attn_combine(op.to(BF16), lp)
    assert out.dtype == BF16
    (args, _), = launches
    assert args[0].dtype == F32 and args[0].shape == op.shape and args[0].is_contiguous()
    # a permuted 16-bit tensor: widened into a compact one (the kernel takes a unit last stride)
    fa4.flash_attn_combine(strided((2, 1, 3, 2, 64), (384, 384, 128, 1, 2), dtype=FP16), lp)
    assert launches[1][0][0].is_contiguous()


def test_one_split_and_packed_without_cu_seqlens(launches):
    out, lse = fa4.flash_attn_combine(*packed(splits=1))
    assert out.shape == (9, 4, 64) and lse.shape == (9, 4)


def test_transposed_lse_partial_accepted(launches):
    op = cuda(3, 2, 5, 4, 64)
    lp = cuda(3, 2, 4, 5).transpose(2, 3)  # the forward's (splits, b, h, s) buffer
    fa4.flash_attn_combine(op, lp)
    assert len(launches) == 1


def test_allocate_outputs_on_meta():
    op = torch.empty(4, 3, 7, 2, 64, device="meta")
    args = combine.check_args(op, torch.empty(4, 3, 7, 2, device="meta"), require_cuda=False)
    out, lse = combine.allocate_outputs(args, op.device, True)
    assert out.shape == (3, 7, 2, 64) and lse.shape == (3, 7, 2) and lse.stride() == (14, 1, 7)
    op = torch.empty(4, 11, 2, 64, device="meta")
    args = combine.check_args(op, torch.empty(4, 11, 2, device="meta"), out_dtype=FP16, require_cuda=False)
    out, lse = combine.allocate_outputs(args, op.device, True)
    assert out.dtype == FP16 and lse.shape == (11, 2) and lse.stride() == (1, 11)
    assert combine.allocate_outputs(args, op.device, False)[1] is None


# --------------------------------------------------------------------------------------------
# Every bad argument raises before the launch, naming the argument
# --------------------------------------------------------------------------------------------


def packed_call(**kwargs):
    op, lp = packed()
    return dict(out_partial=op, lse_partial=lp, **kwargs)


# (id, keyword arguments replacing those of a valid dense call (built inside the fake mode),
#  exception, message pattern); the exception None marks a valid variation.
BAD = [
    ("out_partial-not-a-tensor", lambda: dict(out_partial=[1.0]), TypeError, "out_partial must be a torch.Tensor"),
    ("out_partial-dtype", lambda: dict(out_partial=cuda(3, 2, 5, 4, 64, dtype=torch.float64)), TypeError,
     "out_partial must be torch.float32, torch.bfloat16 or torch.float16"),
    ("out_partial-bf16", lambda: dict(out_partial=cuda(3, 2, 5, 4, 64, dtype=BF16)), None, None),
    ("out_partial-rank-4-is-packed", lambda: dict(out_partial=cuda(3, 5, 4, 64), lse_partial=cuda(3, 5, 4)),
     None, None),
    ("out_partial-rank-3", lambda: dict(out_partial=cuda(3, 4, 64), lse_partial=cuda(3, 4)), ValueError,
     "out_partial must have 5 dimensions"),
    ("out_partial-last-dim",
     lambda: dict(out_partial=strided((3, 2, 5, 4, 64), contiguous_strides((3, 2, 5, 4, 64), 2))), ValueError,
     "out_partial must be contiguous in its last dimension"),
    ("out_partial-stride", lambda: dict(out_partial=strided((3, 2, 5, 4, 64), (2640, 1320, 264, 66, 1))), ValueError,
     "out_partial stride 66 of dimension 3 must be a multiple of 4"),
    ("head-dim-multiple", lambda: dict(out_partial=cuda(3, 2, 5, 4, 60)), ValueError,
     r"head_dim \(out_partial.shape\[-1\]\) must be a multiple of 8"),
    ("head-dim-too-large", lambda: dict(out_partial=cuda(3, 2, 5, 4, 264)), ValueError,
     r"head_dim .* in \[8, 256\], got 264"),
    ("zero-splits", lambda: dict(out_partial=cuda(0, 2, 5, 4, 64), lse_partial=cuda(0, 2, 5, 4)), ValueError,
     r"num_splits \(out_partial.shape\[0\]\) must be in \[1, 256\], got 0"),
    ("too-many-splits", lambda: dict(out_partial=cuda(257, 1, 1, 1, 64), lse_partial=cuda(257, 1, 1, 1)),
     ValueError, "num_splits .* got 257"),
    ("lse_partial-not-a-tensor", lambda: dict(lse_partial=None), TypeError, "lse_partial must be a torch.Tensor"),
    ("lse_partial-dtype", lambda: dict(lse_partial=cuda(3, 2, 5, 4, dtype=BF16)), TypeError,
     "lse_partial must be torch.float32"),
    ("lse_partial-shape", lambda: dict(lse_partial=cuda(3, 2, 5, 3)), ValueError,
     r"lse_partial must have shape \(num_splits, batch, seqlen, heads\) = \(3, 2, 5, 4\)"),
    ("lse_partial-rank", lambda: dict(lse_partial=cuda(2, 5, 4)), ValueError, "lse_partial must have shape"),
    ("lse_partial-packed-shape", lambda: dict(out_partial=packed()[0], lse_partial=cuda(3, 8, 4)), ValueError,
     r"lse_partial must have shape \(num_splits, total_q, heads\)"),
    ("lse_partial-device", lambda: dict(lse_partial=torch.empty(3, 2, 5, 4)), ValueError,
     "lse_partial must be on the same device as out_partial"),
    ("out_dtype", lambda: dict(out_dtype=torch.float64), TypeError, "out_dtype must be torch.bfloat16"),
    ("out_dtype-not-a-dtype", lambda: dict(out_dtype="bf16"), TypeError, "out_dtype must be"),
    ("out-not-a-tensor", lambda: dict(out=3), TypeError, "out must be a torch.Tensor or None"),
    ("out-dtype", lambda: dict(out=cuda(2, 5, 4, 64, dtype=torch.float64)), TypeError,
     "out must be torch.bfloat16"),
    ("out-vs-out_dtype", lambda: dict(out=cuda(2, 5, 4, 64, dtype=BF16), out_dtype=FP16), TypeError,
     "out has dtype torch.bfloat16 but out_dtype is torch.float16"),
    ("out-shape", lambda: dict(out=cuda(2, 5, 4, 32)), ValueError, r"out must have shape \(2, 5, 4, 64\)"),
    ("out-device", lambda: dict(out=torch.empty(2, 5, 4, 64)), ValueError, "out must be on the same device"),
    ("out-last-dim", lambda: dict(out=strided((2, 5, 4, 64), contiguous_strides((2, 5, 4, 64), 2))), ValueError,
     "out must be contiguous in its last dimension"),
    ("out-stride", lambda: dict(out=strided((2, 5, 4, 64), (1400, 280, 70, 1), BF16)), ValueError,
     "out stride 70 of dimension 2 must be a multiple of 4"),
    ("out-broadcast", lambda: dict(out=strided((2, 5, 4, 64), (320, 64, 0, 1), BF16)), ValueError,
     "out must not be a broadcast view"),
    ("cu_seqlens-with-dense", lambda: dict(cu_seqlens=cu(0, 5, 10)), ValueError,
     "cu_seqlens is only for packed partials"),
    ("cu_seqlens-dtype", lambda: packed_call(cu_seqlens=cu(0, 9).long()), TypeError,
     "cu_seqlens must be torch.int32"),
    ("cu_seqlens-not-a-tensor", lambda: packed_call(cu_seqlens=[0, 9]), TypeError,
     "cu_seqlens must be a torch.Tensor"),
    ("cu_seqlens-rank", lambda: packed_call(cu_seqlens=cu(0, 9).view(1, 2)), ValueError,
     "cu_seqlens must be 1-dimensional"),
    ("cu_seqlens-length", lambda: packed_call(cu_seqlens=cu(0)), ValueError,
     r"cu_seqlens must have length batch \+ 1 >= 2"),
    ("cu_seqlens-device", lambda: packed_call(cu_seqlens=torch.tensor([0, 9], dtype=torch.int32)), ValueError,
     "cu_seqlens must be on the same device"),
    ("cu_seqlens-stride", lambda: packed_call(cu_seqlens=strided((3,), (2,), torch.int32)), ValueError,
     "cu_seqlens must be contiguous"),
    ("seqused-dtype", lambda: dict(seqused=cu(1, 2).float()), TypeError, "seqused must be torch.int32"),
    ("seqused-length", lambda: dict(seqused=cu(1, 2, 3)), ValueError, r"seqused must have length 2 \(batch,\)"),
    ("seqused-packed-length", lambda: packed_call(cu_seqlens=cu(0, 4, 9), seqused=cu(1)), ValueError,
     "seqused must have length 2"),
    ("seqused-packed-without-cu_seqlens", lambda: packed_call(seqused=cu(1)), ValueError,
     "seqused with packed partials .* needs cu_seqlens"),
    ("return_lse", lambda: dict(return_lse=1), TypeError, "return_lse must be a bool"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_argument_raises_before_launch(launches, case):
    name, kwargs, exc, match = case
    op, lp = dense()
    call = dict(out_partial=op, lse_partial=lp)
    call.update(kwargs())
    if exc is None:
        fa4.flash_attn_combine(**call)
        assert len(launches) == 1, name
        return
    with pytest.raises(exc, match=match):
        fa4.flash_attn_combine(**call)
    assert not launches, f"{name}: the launcher was reached"


def test_cpu_tensors_rejected():
    with pytest.raises(ValueError, match="out_partial must be a CUDA tensor"):
        fa4.flash_attn_combine(torch.zeros(2, 1, 1, 1, 64), torch.zeros(2, 1, 1, 1))


def test_too_many_rows_rejected():
    op = torch.empty(1, 2**16, 2**12, 8, 64, device="meta")
    with pytest.raises(ValueError, match="32-bit"):
        combine.check_args(op, torch.empty(1, 2**16, 2**12, 8, device="meta"), require_cuda=False)


# --------------------------------------------------------------------------------------------
# Configs, variants, launcher helpers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d,bucket,lanes,vecs", [(8, 32, 8, 1), (32, 32, 8, 1), (40, 64, 16, 1), (64, 64, 16, 1),
                                                 (72, 128, 32, 1), (128, 128, 32, 1), (136, 256, 32, 2),
                                                 (256, 256, 32, 2)])
def test_head_dim_buckets(d, bucket, lanes, vecs):
    cfg = combine.make_config("bf16", d, "sm_90a")
    assert cfg.head_dim == bucket and cfg.threads_per_row == lanes
    assert combine.lanes_and_vectors(cfg.head_dim, cfg.threads_per_row) == (lanes, vecs)
    assert cfg.unroll * vecs == 8  # 8 vectors of 16 bytes in flight per lane and step
    assert lanes * vecs * 4 >= d
    combine.check_config(cfg)


def test_head_dim_above_256_has_no_bucket():
    with pytest.raises(ValueError, match="head_dim 264"):
        combine.make_config("bf16", 264, "sm_90a")


@pytest.mark.parametrize("arch", ARCHS)
def test_variants_cover_every_flag(arch):
    vs = combine.variants(arch)
    assert len(vs) == len(set(vs)) and all(v.arch == arch for v in vs)
    for v in vs:
        combine.check_config(v)
    assert {v.dtype for v in vs} == set(combine.OUT_DTYPES)
    assert {v.head_dim for v in vs} == {32, 64, 128, 256}
    for flag in ("varlen", "has_seqused", "has_lse"):
        assert {getattr(v, flag) for v in vs} == {False, True}, flag
    assert any(v.varlen and v.has_seqused for v in vs)
    assert combine.variants("sm_75") == []


def test_variants_are_in_the_compile_tests():
    from fa4 import arch

    assert "fa4.combine" in arch.KERNEL_MODULES
    for a in ARCHS:
        assert set(combine.variants(a)) <= set(arch.all_variants(a))


@pytest.mark.parametrize("field,value,match", [
    ("dtype", "fp8", "CombineConfig.dtype"),
    ("arch", "sm_70", "CombineConfig.arch"),
    ("head_dim", 80, "CombineConfig.head_dim"),
    ("head_dim", 512, "CombineConfig.head_dim"),
    ("threads_per_row", 4, "CombineConfig.threads_per_row"),
    ("num_threads", 48, "CombineConfig.num_threads"),
    ("max_splits", 100, "CombineConfig.max_splits"),
    ("unroll", 0, "CombineConfig.unroll"),
])
def test_config_checks_name_the_field(field, value, match):
    import dataclasses

    cfg = dataclasses.replace(combine.make_config("bf16", 128, "sm_90a"), **{field: value})
    with pytest.raises(ValueError, match=match):
        combine.check_config(cfg)


def test_config_key_holds_every_field():
    cfg = combine.make_config("fp32", 64, "sm_80", varlen=True, has_seqused=True, has_lse=False)
    key = cfg.key()
    for part in ("CombineConfig(", "dtype='fp32'", "head_dim=64", "varlen=True", "has_seqused=True",
                 "has_lse=False", "threads_per_row=16", "max_splits=256"):
        assert part in key


@pytest.mark.parametrize("d,rows,splits,sms,want", [
    (128, 8 * 32, 16, 132, 2),  # decode: 256 rows, 16 splits -> 2 warps of 8 splits each
    (128, 32, 128, 132, 4),  # few rows, many splits: the whole CTA on one row
    (128, 32, 8, 132, 1),  # one step of splits: nothing to share
    (128, 100_000, 64, 132, 1),  # many rows: the grid alone fills the GPU
    (64, 1024, 256, 132, 4),  # 2 rows per warp: 512 groups
    (256, 64, 4, 132, 1),  # unroll 4 at d256: 4 splits are one step
    (256, 64, 8, 132, 2),
])
def test_warps_per_row(d, rows, splits, sms, want):
    cfg = combine.make_config("bf16", d, "sm_90a")
    wpr = combine.warps_per_row(cfg, rows, splits, sms)
    assert wpr == want
    assert wpr & (wpr - 1) == 0 and wpr <= cfg.num_threads // 32


def test_kernel_view_zeroes_unused_odd_strides():
    t = torch.empty(3, 1, 1, 8, 64).as_strided((3, 1, 1, 8, 64), (512, 7, 3, 64, 1))
    v = combine._kernel_view(t)
    assert v.stride() == (512, 0, 0, 64, 1) and v.data_ptr() == t.data_ptr()
    u = torch.empty(3, 2, 5, 8, 64)
    assert combine._kernel_view(u) is u


# --------------------------------------------------------------------------------------------
# One compile (the whole set is in tests/test_compile.py, -m slow): the SASS the design relies on
# --------------------------------------------------------------------------------------------


def test_sm90_d128_sass_has_wide_loads_and_no_spills(tmp_path):
    from fa4 import sass

    cfg = combine.make_config("bf16", 128, "sm_90a")
    fn = jit.compile_uncached(cfg)
    path = tmp_path / "k.o"
    fn.export_to_c(str(path), function_name=jit.EXPORT_SYMBOL)
    (info,) = jit.cubin_info(path)
    assert info["sm"] == 90 and info["frame_bytes"] == 0, info
    ops = sass.opcode_counts(sass.disassemble_object(str(path)))
    assert sass.count(ops, "LDL") == 0 and sass.count(ops, "STL") == 0
    # unroll (8) 128-bit loads of the partials per step, 256 / 32 LSE loads, all in flight at once
    assert ops["LDG.E.128"] == cfg.unroll
    assert ops["LDG.E"] == cfg.max_splits // cfg.threads_per_row
    assert ops["STG.E.64"] == 1  # 4 bf16 per lane


@pytest.mark.parametrize("wpr", [0, 3, 8])
def test_combine_into_rejects_a_bad_wpr(wpr):
    op, lp = torch.empty(2, 1, 1, 4, 64), torch.empty(2, 1, 1, 4)
    out, lse = torch.empty(1, 1, 4, 64), torch.empty(1, 1, 4)
    with pytest.raises(ValueError, match="wpr must be a power of two"):
        combine.combine_into(op, lp, out, lse, arch="sm_90a", wpr=wpr)
