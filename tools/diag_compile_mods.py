"""Session 30 diagnostic: a torch.compile'd call with a score_mod against eager calls, per closure
(the GPU test test_torch_compile_another_function_retraces failed on the H200): which graph each
call ran, and whether the difference follows the slope, the lse flag or the compile."""
import torch

import fa4
import torch._dynamo.utils as du
from fa4.testing import random_qkv
import sys
sys.path.insert(0, "tests")
from mods_cases import alibi  # noqa: E402

print("torch", torch.__version__)
SM90 = fa4.KernelOptions(arch="sm90")
q, k, v = random_qkv(2, 256, 256, 4, 4, 64, torch.bfloat16, "cuda", seed=24)
compiled = torch.compile(lambda q, k, v, fn: fa4.flash_attn_func(q, k, v, score_mod=fn, kernel_options=SM90)[0],
                         fullgraph=True)
outs = {}
for slope in (0.05, 0.2):
    fn, _ = alibi(slope)
    c = compiled(q, k, v, fn)
    e_nolse, _ = fa4.flash_attn_func(q, k, v, score_mod=fn, kernel_options=SM90)
    e_lse, _ = fa4.flash_attn_func(q, k, v, score_mod=fn, return_lse=True, kernel_options=SM90)
    outs[slope] = (c, e_nolse, e_lse)
    d = lambda a, b: (a.float() - b.float()).abs().max().item()  # noqa: E731
    print(f"slope {slope}: compiled-eager(no lse) {d(c, e_nolse):.3e}  eager no lse - lse {d(e_nolse, e_lse):.3e}")
print("compiled(0.2) - eager(0.05):", (outs[0.2][0].float() - outs[0.05][2].float()).abs().max().item())
print("dynamo counters:", dict(du.counters["stats"]), dict(du.counters.get("frames", {})))
