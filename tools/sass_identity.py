"""Hash the SASS of a few forward configs of a checkout, to show that a host-side change left the
device code identical (run once with the old checkout's path, once with the new one):

    python tools/sass_identity.py /path/to/checkout [bwd]

With ``bwd``: the sm90 backward's defaults instead (d64 / d128, plain / causal / varlen, deterministic
or not), for a change that should leave them as they ran.
"""
import hashlib
import os
import sys
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, sys.argv[1])
from fa4 import sass
from fa4.config import AttnProblem
from fa4.fwd import sm80, sm90
if sys.argv[2:] == ["bwd"]:
    from fa4.bwd import sm90 as bwd90
    for d in (64, 128):
        for causal, varlen in ((False, False), (True, False), (True, True)):
            for det in (False, True):
                p = AttnProblem("bf16", 2, 1024, 1024, 8, 2, d, d, d ** -0.5, causal=causal, varlen_q=varlen,
                                varlen_k=varlen)
                text = sass.disassemble(bwd90.make_config(p, None, "sm_90a", det))
                text = "\n".join(l for l in text.splitlines() if "/*" in l and not l.strip().startswith("//"))
                print("bwd sm90", d, causal, varlen, det, hashlib.sha256(text.encode()).hexdigest()[:16], flush=True)
    sys.exit(0)
for mod, arch in ((sm90, "sm_90a"), (sm80, "sm_80")):
    for d, causal, varlen in ((128, False, False), (64, True, False), (256, True, True)):
        p = AttnProblem("bf16", 2, 1024, 1024, 8, 8, d, d, d ** -0.5, causal=causal, varlen_q=varlen, varlen_k=varlen)
        cfg = mod.make_config(p, None, arch, True)
        text = sass.disassemble(cfg)
        text = "\n".join(l for l in text.splitlines() if "/*" in l and not l.strip().startswith("//"))
        print(mod.__name__, d, causal, varlen, hashlib.sha256(text.encode()).hexdigest()[:16], flush=True)
