"""A tiny CuTe DSL kernel used to test the JIT cache without depending on any attention kernel."""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from fa4.config import KernelConfig


@dataclass(frozen=True)
class ScaleAddConfig(KernelConfig):
    """out[i] = a[i] * s + bias (bias is compile-time, so configs with different bias differ)."""

    bias: float = 1.0
    KERNEL = "kernels_for_tests:ScaleAdd"


class ScaleAdd:
    def __init__(self, cfg: ScaleAddConfig):
        self.bias = cfg.bias

    @staticmethod
    def fake_args(cfg):
        n = cute.sym_int()
        a = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
        out = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
        return a, out, cutlass.Float32(1.0), cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)

    @cute.jit
    def __call__(self, a: cute.Tensor, out: cute.Tensor, s: cutlass.Float32, stream):
        n = a.shape[0]
        self.kernel(a, out, s).launch(grid=((n + 127) // 128, 1, 1), block=(128, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, a: cute.Tensor, out: cute.Tensor, s: cutlass.Float32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        i = bid * 128 + tid
        if i < a.shape[0]:
            out[i] = a[i] * s + self.bias
