export FA4_CACHE_DIR=/tmp/fa4c; L="--lens 1,840,1451,1500/1300,949,904,1"; D="python3 tools/det_diag.py --d 256 --mask causal --nondet"
f() { echo "== $*"; timeout 120 $D "$@" 2>&1 | grep -v Warn | grep -E "error|differs|seq [0-9]|bit-exact|Error" | head -30; }
f --ref --runs 2 $L
f --fixed-fwd --runs 3 $L
f --fwd-static --ref --runs 2 $L
f --ref --runs 1 --lens 1,840,1451/1300,949,904
f --ref --runs 1 --lens 1,840,1500/1300,949,1
f --ref --runs 1 --lens 840,1500/949,1
echo "== memcheck"; timeout 150 compute-sanitizer --tool memcheck --print-limit 5 $D --runs 1 --fixed-fwd $L 2>&1 | grep -v Warn | tail -15
echo "== racecheck"; timeout 200 compute-sanitizer --tool racecheck --print-limit 5 $D --runs 1 --fixed-fwd $L 2>&1 | grep -v Warn | tail -15
