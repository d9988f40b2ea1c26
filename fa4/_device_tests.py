"""Small test kernels for the shared device code (compiled through :mod:`fa4.jit` like any kernel).

* :class:`Exp2Test` -- elementwise ``2**x`` of a float32 array twice: by the polynomial emulation
  and by MUFU ``ex2.approx`` (``y_emu``, ``y_mufu``).
* :class:`SoftmaxTest` -- the online softmax of :mod:`fa4.softmax` on a ``(rows, cols)`` score
  matrix processed in key blocks of ``tile_n`` exactly as an attention kernel does it: scores in
  an ``mma.sync`` accumulator fragment, ``P`` converted to bf16 and multiplied by ``V`` with
  m16n8k16 MMAs (P from registers), conditional rescale, final normalization. Outputs
  ``O = softmax(S * scale) @ V`` (float32) and the natural-log LSE per row.
  ``-inf`` entries of S act as masked scores (a row of all -inf must give O = 0, LSE = -inf).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warp

from fa4.config import KernelConfig
from fa4.cute_utils import convert_f32_to_half, make_acc_as_A, make_acc_mn_view
from fa4.softmax import OnlineSoftmax, exp2_emulated, exp2_mufu


def _stream():
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


# --------------------------------------------------------------------------------------------
# exp2
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exp2TestConfig(KernelConfig):
    KERNEL = "fa4._device_tests:Exp2Test"


class Exp2Test:
    """``y_emu[i] = exp2_emulated(x[i])``, ``y_mufu[i] = ex2.approx(x[i])``; x, y: float32 (n,)."""

    threads = 128

    def __init__(self, cfg: Exp2TestConfig):
        self.cfg = cfg

    @staticmethod
    def can_implement(cfg) -> None:
        return None

    @staticmethod
    def fake_args(cfg):
        n = cute.sym_int()
        mk = lambda: cute.runtime.make_fake_compact_tensor(Float32, (n,), assumed_align=4)  # noqa: E731
        return mk(), mk(), mk(), _stream()

    @cute.jit
    def __call__(self, mX: cute.Tensor, mYEmu: cute.Tensor, mYMufu: cute.Tensor, stream):
        n = mX.shape[0]
        self.kernel(mX, mYEmu, mYMufu).launch(
            grid=(cute.ceil_div(n, self.threads), 1, 1), block=(self.threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mYEmu: cute.Tensor, mYMufu: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * self.threads + tidx
        if i < mX.shape[0]:
            x = mX[i]
            mYEmu[i] = exp2_emulated(x)
            mYMufu[i] = exp2_mufu(x)


# --------------------------------------------------------------------------------------------
# Online softmax + P @ V
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SoftmaxTestConfig(KernelConfig):
    tile_m: int = 64
    tile_n: int = 64
    head_dim_v: int = 32
    exp2_emu_frac: float = 0.0
    rescale_threshold: float = 8.0

    KERNEL = "fa4._device_tests:SoftmaxTest"


class SoftmaxTest:
    """S: float32 (rows, cols), V: bf16 (cols, dv), O: float32 (rows, dv), LSE: float32 (rows,);
    rows % tile_m == 0, cols % tile_n == 0. One CTA of tile_m / 16 warps per row block."""

    def __init__(self, cfg: SoftmaxTestConfig):
        self.cfg = cfg
        self.num_threads = cfg.tile_m // 16 * 32

    @staticmethod
    def can_implement(cfg) -> None:
        if cfg.tile_m % 16 or cfg.tile_n % 16 or cfg.head_dim_v % 16:
            raise ValueError("SoftmaxTestConfig: tile_m, tile_n, head_dim_v must be multiples of 16")

    @staticmethod
    def fake_args(cfg):
        rows = cute.sym_int(divisibility=cfg.tile_m)
        cols = cute.sym_int(divisibility=cfg.tile_n)
        mS = cute.runtime.make_fake_compact_tensor(Float32, (rows, cols), stride_order=(1, 0), assumed_align=16)
        mV = cute.runtime.make_fake_compact_tensor(cutlass.BFloat16, (cols, cfg.head_dim_v), stride_order=(1, 0),
                                                   assumed_align=16)
        mO = cute.runtime.make_fake_compact_tensor(Float32, (rows, cfg.head_dim_v), stride_order=(1, 0),
                                                   assumed_align=16)
        mLSE = cute.runtime.make_fake_compact_tensor(Float32, (rows,), assumed_align=4)
        return mS, mV, mO, mLSE, Float32(1.0), _stream()

    @cute.jit
    def __call__(self, mS: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 scale_log2: Float32, stream):
        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(cutlass.BFloat16, Float32, (16, 8, 16)),
            (self.num_threads // 32, 1, 1),
            permutation_mnk=(self.num_threads // 32 * 16, 16, 16),
        )
        self.kernel(mS, mV, mO, mLSE, scale_log2, tiled_mma).launch(
            grid=(cute.ceil_div(mS.shape[0], self.cfg.tile_m), 1, 1),
            block=(self.num_threads, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mS: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               scale_log2: Float32, tiled_mma: cute.TiledMma):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        m_block, _, _ = cute.arch.block_idx()
        thr_mma = tiled_mma.get_slice(tidx)
        # (tile_m, tile_n, n_blocks), (dv, tile_n, n_blocks) = V^T, (tile_m, dv)
        gS = cute.local_tile(mS, (cfg.tile_m, cfg.tile_n), (m_block, None))
        mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[1, 0]))
        gVt = cute.local_tile(mVt, (cfg.head_dim_v, cfg.tile_n), (0, None))
        gO = cute.local_tile(mO, (cfg.tile_m, cfg.head_dim_v), (m_block, 0))

        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((cfg.tile_m, cfg.head_dim_v)), Float32)
        acc_O.fill(0.0)
        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((cfg.tile_m, cfg.tile_n)), Float32)
        tSgS = thr_mma.partition_C(gS)
        tOgVt = thr_mma.partition_B(gVt)
        tOrVt = thr_mma.make_fragment_B(tOgVt[None, None, None, 0])
        num_rows = cute.size(make_acc_mn_view(acc_O).shape[0])
        softmax = OnlineSoftmax(scale_log2, num_rows, cfg.exp2_emu_frac, cfg.rescale_threshold)
        softmax.reset()

        n_blocks = mS.shape[1] // cfg.tile_n
        self.block(0, tSgS, tOgVt, acc_S, tOrVt, acc_O, tiled_mma, softmax, is_first=True)
        for n in cutlass.range(1, n_blocks, unroll=1):
            self.block(n, tSgS, tOgVt, acc_S, tOrVt, acc_O, tiled_mma, softmax, is_first=False)

        lse = softmax.finalize(acc_O)
        cute.autovec_copy(acc_O, thr_mma.partition_C(gO))
        # LSE: the lane with column offset 0 of each quad writes its rows.
        cO = cute.make_identity_tensor((cfg.tile_m, cfg.head_dim_v))
        tOcO = make_acc_mn_view(thr_mma.partition_C(cO))
        if tOcO[0][1] == 0:
            for r in cutlass.range_constexpr(num_rows):
                mLSE[m_block * cfg.tile_m + tOcO[r, 0][0]] = lse[r]

    @cute.jit
    def block(self, n: Int32, tSgS, tOgVt, acc_S, tOrVt, acc_O, tiled_mma, softmax: OnlineSoftmax,
              is_first: cutlass.Constexpr[bool]):
        cute.autovec_copy(tSgS[None, None, None, n], acc_S)
        cute.autovec_copy(tOgVt[None, None, None, n], tOrVt)
        softmax.online_softmax(acc_S, acc_O, is_first=is_first)
        rP = cute.make_rmem_tensor_like(acc_S, cutlass.BFloat16)
        convert_f32_to_half(acc_S, rP)
        tOrP = make_acc_as_A(rP)
        for k in cutlass.range_constexpr(cute.size(tOrP.shape[2])):
            cute.gemm(tiled_mma, acc_O, tOrP[None, None, k], tOrVt[None, None, k], acc_O)
