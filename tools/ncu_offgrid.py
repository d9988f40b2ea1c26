"""One forward + backward of an off-grid case (``fa4.offgrid.CASES``), for ncu on the device:

    ncu --clock-control none --kernel-name regex:fa4_bwd_sm90 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis python3 tools/ncu_offgrid.py CASE [SECTION]

``SECTION``: the backward's launch sections in pairs (``LAUNCH_ORDER.section``, Note [Launch order] in
fa4/bwd/common.py); left out, the default rule's."""
import sys

import torch

from fa4 import offgrid
from fa4.bwd import sm90

name = sys.argv[1]
if len(sys.argv) > 2:
    sm90.LAUNCH_ORDER.section = int(sys.argv[2])
q, k, v, lq, lk, causal, varlen, _ = offgrid.build(offgrid.CASES[name])
q, k, v = (t.requires_grad_() for t in (q, k, v))
call = offgrid.callers(q, k, v, lq, lk, causal, varlen, False)["fa4"]
out = call()
torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
torch.cuda.synchronize()
print("done", name, sm90.LAUNCH_ORDER.section)
