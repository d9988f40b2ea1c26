#!/usr/bin/env bash
# One device run: environment, parallel precompile of the sm_90a variants, then the named steps.
# Usage (device tool, carry [".device"]):  . .device/env.sh && bash tools/device_run.sh STEPS
# STEPS (comma list): bwd90 (the backward GPU tests, both families), gpu (the whole GPU suite),
# sanitize (compute-sanitizer memcheck/racecheck on tools/sanitize_sm90.py), sanitizemods (the same on tools/sanitize_mods.py), bench (fwd+bwd grid),
# benchbwd, det (deterministic bench), latency, sweep (tools/sweep_bwd.py), ncu (tools/ncu_bwd.py),
# pytests (pytest -m gpu $PYTESTS), sweepfwd80 (tools/sweep_fwd.py --family sm80 $SWEEP_FWD80), detsec (tools/det_sections.py $DETSEC_ARGS), sink (learnable-sink GPU tests + tools/sink_diag.py), issue9 (pack GQA / split-KV / combine / paged / flash_attn.cute call GPU tests), decode (bench --decode),
# next9 .. next11 (session 9: lane slots; the rotated order at d64; d64 det rotated), next13 (ping-pong
# around the steps only), next14 (causal det: ncu, sweep v16), next15 (the up order; its
# tests ran in session 10, the sweep not), next16 (ncu: the up order against the down order), next17
# (dv_late at d64; run in session 11), next18 (publish_peek), next20 (publish_peek as the default), next22 (v27 sections, det bench), next8 (session 8's not-yet-run tests and sweeps), ncusrc (source-level stall sampling
# of the forwards; NCUSRC_IMPLS), ncusrcbwd (the same for the backwards), bwdacc (tools/bwd_accuracy.py $BWDACC), ncustall (stall reasons, fa4 vs
# flash-attn-4), sweepfwd (tools/sweep_fwd.py $SWEEP_FWD), ncufwd (ncu of the fa4 and flash-attn-4 forwards,
# tools/ncu_fwd.py), ncubwd (the same for the backwards, NCU_BWD_SHAPES), v012b (session 10's side-by-side benches), firststore (session 17: Note [First store]'s tests and the backward profile), claims (session 18: the relaxed, rotated claims: tests and profile), bwdprof (tools/bwd_profile.py $BWDPROF_ROWS), hostprof (tools/host_profile.py $HOSTPROF_ARGS), hostbd (tools/host_breakdown.py $HOSTBD_ROWS), offgrid (tools/offgrid.py: shapes off the standard grid), next26 (session 25: the split GQA group), next27 / next27b (session 25's unrun work: tests / timings), next28 / next28b / next28c (session 26's: tests / forward timings / backward sections and decode), next29 (session 27: the decode grid, the compact varlen backward grid, their tests and timings; skipfwd leaves out its forward tests), next30 / next30m / next30v / next30b / next30c / next30d / next30e (the decode rule's and the compact grids' forward tests / score_mod and mask_mod / the varlen backward suite with the compact grid on / the compact grids' timings / the decode rule's timings and the decode bench / one_step_loop at d128-256 causal / varlen calls without max_seqlen, default and compact grids), next25 (session 24's unrun test edits and sweep v57), next31 / next31b / sanitizebs (session 30: the user-function and block-sparse GPU tests / the mods timings), next33 (session 32: flash_attn_with_kvcache's GPU tests, then the decode bench with its fa4-kvcache16 column), next34 (session 33: the kvcache, one_step_loop, sm90 forward and flash_attn.cute-call GPU tests; one_step_loop's cost with its uniform branch; compile times; next34m: the one_step_loop part alone), next35 (session 34: one_step_loop with K released after the mask: its tests, then five-round sweeps against the separate loops, causal and local), ctime (tools/compile_time.py, 200 s), next38 / next38b (session 36: the unit-stride branch and the score positions beside main in baseline/), next39 (their trace-time unroll only where it folds, branch wip/positions-fold-only), next39n (the block-sparse K range by ballot, branch wip/narrow-ballot), next40 (session 37: both merged, their GPU tests), next40v (session 37: varlen calls without max_seqlen), next41 (the GQA causal backward's group split on varlen and dense rows), next43 (issue 8's backward rows, three repeats), next44 (session 38: the backward's block skip, branch wip/bwd-block-skip), next45 (session 38: the drop-in fixes, branch wip/dropin), next46 (session 38: the sm80 user-function forward at 256 threads), next47 / next47s / next47q (session 39: the merged GPU files of session 38; the causal backward's launch sections on varlen rows / the same cut down), next42t / next42 (session 40, branch wip/sm80-loose-plan: its tests / the sm80 rows with and without the lengths), next49 (session 40: the outputs through empty_like: the GPU files that allocate them, then --latency three times), next50 (session 41: packed GQA rows by TMA: tests, then the GQA rows packed by TMA / by rows / unpacked), sanitizepack (compute-sanitizer on tools/sanitize_pack.py), next55 (one_step_loop at d64 / d128 causal: seven rounds, then compile times), next56 / next56b (session 43: fold_first's tests, timings and compile times / more rounds, interleaved compile times), next57 (session 43's unrun sm80 fold_first: tests, timings, compile times), next58 (the window rows with one_step_loop and fold_first), next59 / next59q / next59r / next59c (session 44, branch wip/edges-first: the fold's and the window tests / the d128 window row / the window rows / the causal rows and compile times), next60 (ncu of the d128 window row, separate loops against the fold), next61 (session 45: the edges-first order's error test, then the forward grid beside the peers, three repeats), next62 (the sanitizer with the d64 window case, then the grid forward and backward with round-robin repeats), next63 (session 46: SM clocks and power beside the forward timings of fa4 and flash-attn-4, then ncu at the base clock), next64 (DRAM / L2 / shared traffic of both at d128 s16k; ping-pong and the plain grid at d128 without a mask; --latency), next65 (the grid with three repeats and the bar per row), next66 (session 47: the row sum's chain count, sum_chains, at d64 / d128; scale_emu and 1/16 emulation at d64; ran in session 48, the knobs then removed, so it no longer runs), next67 (next66, the knobs' GPU test, next65, in that order; the same), next69 (session 48: K/V multicast's tests on both grids and with pack GQA, then the non-causal rows with it on the persistent grid), next71 (session 49: K/V multicast with 3-4 stages at d64 / d128, GQA with multicast, the forward grid), next72 / next72q (session 50: the driver's resident cluster counts, then next71 / alone), next73 / next73s (session 51: causal K/V multicast and pair claims: the multicast tests and the sanitizer on the multicast cases / the causal rows against the default), next74 (d64 causal multicast with 3-4 stages; the forward grid, three repeats), next75 (session 52: overlap_tiles: its tests, the per-tile cost, the d64 / d128 rows), next76 (its sanitizer cases, the forward GPU files, five rounds against it off, the forward grid), next77 (the packed GQA multicast default's GPU tests and rows), next78 (one_step_loop's speed where the defaults miss the compile bar, then compile times), next79 (ncu source counters of the d64 forwards), next80 (wg_store_o: its tests, sanitizer cases, tile cost and rows), next81 (session 53: wg_store_o's sanitizer cases again; wg_store_o and d128 ping-pong, seven rounds), next82 (the d64 warpgroup-store default: the forward, user-function and block-sparse GPU files), next83 (the grid beside the peers, two repeats, then compile times), next84 (the d128 s1k forward row: warpgroup stores and ping-pong, ten rounds), next85 (session 54: the backward's programmatic dependent launches: tests, three rounds), next86 (session 54 in one call: the window tests and rows, then next85 cut down), next86t (its tests only, the d256 windows), next87 / next87s (session 55: next86's tests, the split-KV combine launched early (its tests and the decode rows) / next86's sweeps), next97 (session 58: the ordered kernel for short causal rows: its GPU test and rounds against it off), next96 (session 58: the deterministic bench, compile times with three cold rounds, --latency), next95 (session 57's Next: rescale_o_before_pv at d64, ten rounds; its own call after next83, on an H200), next94 (session 57: the d256 stmatrix default: the forward files' d256 cases), next93 (session 56: O staged by stmatrix, an option: its bit-equality test, then its rows), next92 (session 56: the backward's pdl on the causal rows and d128 s4k; the split-KV and kvcache files with SPLIT_PDL on), next91 / next91s (session 56: next90's tests cut to what next89f did not reach, with next90s's tests / next90s's rounds), next90 / next90s (session 55's unrun work: the forward files under its defaults / the backward's pdl_post rows), next89 (the d128 causal warpgroup-store and short-backward pdl defaults: their GPU files), next88 (more pdl rounds, the d256 window / causal one step body, the d128 s1k forward row, compile times), next54 / next54b (session 42's unrun work: packed-vs-unpacked error test / the packing rows on an H200), next53 (session 42: the default packing up to 8 heads, partial boxes on: the sm90 forward / split-KV files and the g = 7 rows), next52 / next52b (session 42: the partial boxes' tests and racecheck / g = 7 timings, after the transaction-count fix), next51 / next51b (session 41's unrun tests: the files after the default packing change, the partial boxes and their sanitizer / timings: g = 7 partial boxes, g = 8, MQA), next50g (the default packing them: the sm90 forward file, then packed / unpacked at d64 / d256 / d128), next36 (session 35: the d192 one_step_loop default's tests and timing, the forward grid with three repeats), next37n (ncu source counters of fa4's and flash-attn-4's document mask_mod forwards), next37a (branch wip/aux-unit-stride: its tests and the user-function timings), next35t (branch wip/table-kernel: the block table in one launch, its tests and timings), next35h (eager against CUDA-graph replay of the block-sparse and user-function cases: tools/host_vs_gpu.py), gpu1 / gpu2 (the whole GPU suite in two calls), nocompile (skip the precompile). Logs go to $OUT; each step has a timeout.
set -uo pipefail
steps=${1:-bwd90}
out=${OUT:-/tmp/out}; mkdir -p "$out"
export FA4_CACHE_DIR=${FA4_CACHE_DIR:-/tmp/fa4c}
has() { [[ ",$steps," == *",$1,"* ]]; }
# gpu_tests NAME LIMIT PYTEST_ARGS...: GPU tests logged to $out/NAME.log, a summary printed; pytest's status.
# Tests that fail only for want of GPU memory (12 workers share an 80 GiB H100) run again one at a
# time, logged to NAME_serial.log; its status is then the step's. Any other failure stands.
gpu_tests() {
  local name=$1 limit=$2; shift 2
  COLUMNS=2000 timeout "$limit" python3 -m pytest -m gpu -p no:cacheprovider $xd -q -rfEs --maxfail=${FA4_MAXFAIL:-25} "$@" \
    > "$out/$name.log" 2>&1
  local rc=$?; echo "$name tests rc=$rc"; grep -E "passed|failed|FAILED|ERROR|Timeout" "$out/$name.log" | cut -c1-200 | tail -12
  local failed oom
  failed=$(grep -cE "^(FAILED|ERROR) " "$out/$name.log")
  oom=$(grep -E "^FAILED \S+ - (torch.OutOfMemoryError|RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED)" "$out/$name.log" | awk '{print $2}')
  if [ "$rc" = 1 ] && [ -n "$oom" ] && [ "$failed" = "$(echo "$oom" | wc -l)" ]; then
    timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -q -rfE $oom > "$out/${name}_serial.log" 2>&1
    rc=$?; echo "$name: $failed out-of-memory failures, one at a time: rc=$rc"
    grep -E "passed|failed|FAILED|ERROR" "$out/${name}_serial.log" | cut -c1-200 | tail -6
  fi
  return $rc
}
# gpu_tests_on N NAME LIMIT PYTEST_ARGS...: gpu_tests with N test workers (files whose references
# fill the GPU's memory at 12); pytest's status.
gpu_tests_on() {
  local n=$1 saved=$xd rc; shift
  [ -n "$xd" ] && xd="-n $n"
  gpu_tests "$@"; rc=$?
  xd=$saved
  return $rc
}
# logged NAME LIMIT LINES CMD...: a command under a timeout, logged to $out/NAME.log, its last LINES printed.
logged() {
  local name=$1 limit=$2 lines=$3; shift 3
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$?"; grep -v Warning "$out/$name.log" | grep -v exe_args | tail -"$lines"
}
# beside_main NAME REPS BENCH_ARGS...: off-grid bench runs of main's fa4 (unpacked in baseline/,
# untracked: rm -rf baseline && mkdir baseline && git archive main fa4 | tar -x -C baseline) and of
# the working tree in turn, REPS times, logged to NAMEmainR / NAMEnewR.
beside_main() {
  local name=$1 reps=$2; shift 2
  [ -d baseline/fa4 ] || { echo "$name: no baseline/fa4 to run main from"; return 1; }
  for r in $(seq "$reps"); do
    (cd baseline && FA4_CACHE_DIR=/tmp/fa4c_main logged "${name}main$r" 150 13 python3 -m fa4.bench --offgrid "$@")
    logged "${name}new$r" 150 13 python3 -m fa4.bench --offgrid "$@"
  done
}
xd=""; python3 -c "import xdist" 2>/dev/null && xd="-n ${FA4_XDIST:-12}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu,power.draw --format=csv,noheader | tee "$out/env.log"
t0=$(date +%s)
if ! has nocompile; then
  timeout 200 python3 -m fa4 compile --arch sm_90a --jobs 15 > "$out/compile.log" 2>&1
  echo "compile rc=$? $(tail -1 "$out/compile.log") ($(( $(date +%s) - t0 ))s)"; grep FAIL "$out/compile.log" | head -5
fi
if has bwd90; then
  timeout ${BWD90_TIMEOUT:-330} python3 -m pytest -m gpu -p no:cacheprovider $xd -q -rfE --maxfail=40 \
    tests/test_bwd_gpu.py tests/test_preprocess_gpu.py "tests/test_fwd_sm90_gpu.py::test_unused_kv_rows_may_hold_nan" \
    > "$out/bwd90.log" 2>&1
  echo "bwd90 rc=$?"; grep -E "passed|failed|FAILED|ERROR|Timeout" "$out/bwd90.log" | tail -40
fi
if has issue9; then
  timeout ${ISSUE9_TIMEOUT:-400} python3 -m pytest -m gpu -p no:cacheprovider $xd -q -rfE --maxfail=40 \
    ${ISSUE9_K:+-k "$ISSUE9_K"} tests/test_fwd_splitkv_gpu.py tests/test_flash_attn_cute_calls_gpu.py tests/test_combine_gpu.py \
    > "$out/issue9.log" 2>&1
  echo "issue9 rc=$?"; grep -E "passed|failed|FAILED|ERROR|Timeout" "$out/issue9.log" | tail -40
fi
if has pytests; then
  # Any GPU test files or node ids: PYTESTS="tests/a.py tests/b.py::test_x" (PYTESTS_K: a -k filter).
  timeout ${PYTESTS_TIMEOUT:-300} python3 -m pytest -m gpu -p no:cacheprovider $xd -q -rfE --maxfail=20 \
    ${PYTESTS_K:+-k "$PYTESTS_K"} $PYTESTS > "$out/pytests.log" 2>&1
  echo "pytests rc=$?"; grep -E "passed|failed|FAILED|ERROR" "$out/pytests.log" | tail -25
fi
if has sweepfwd80; then
  timeout ${SWEEP_TIMEOUT:-300} python3 tools/sweep_fwd.py --family sm80 ${SWEEP_FWD80:-} > "$out/sweepfwd80.log" 2>&1
  echo "sweepfwd80 rc=$?"; grep -v Warning "$out/sweepfwd80.log" | grep -v "exe_args" | tail -30
fi
if has detsec; then
  timeout 200 python3 tools/det_sections.py ${DETSEC_ARGS:-} > "$out/detsec.log" 2>&1
  echo "detsec rc=$?"; grep -E "^d[0-9]" "$out/detsec.log"; grep -E "Error|error" "$out/detsec.log" | tail -3
fi
if has sink; then
  # Learnable sinks in the kernels (issue 9 item 5): the GPU sink tests, then the dsink/out error table.
  timeout 300 python3 -m pytest -m gpu -p no:cacheprovider $xd -q -rfE -k sink tests/test_flash_attn_cute_calls_gpu.py \
    tests/test_fwd_splitkv_gpu.py tests/test_combine_gpu.py > "$out/sink.log" 2>&1
  echo "sink rc=$?"; grep -E "passed|failed|FAILED|ERROR" "$out/sink.log" | tail -20
  timeout 120 python3 tools/sink_diag.py > "$out/sink_diag.log" 2>&1; echo "sink_diag rc=$?"; cat "$out/sink_diag.log" | tail -16
fi
if has decode; then
  timeout 300 python3 -m fa4.bench --decode --out "$out/decode" ${BENCH_ARGS:-} > "$out/decode.log" 2>&1
  echo "decode rc=$?"; tail -12 "$out/decode.log"
fi
if has det90; then
  timeout 200 python3 -m pytest -m gpu -p no:cacheprovider $xd -q -rfE tests/test_bwd_gpu.py -k "(deterministic and sm90) or rotated" \
    > "$out/det90.log" 2>&1
  echo "det90 rc=$?"; grep -E "passed|failed|FAILED|ERROR" "$out/det90.log" | tail -10
fi
if has gpu; then
  timeout ${GPU_TIMEOUT:-420} python3 -m pytest -m gpu -p no:cacheprovider $xd -q -rfE tests > "$out/gpu.log" 2>&1
  echo "gpu rc=$?"; grep -E "passed|failed|FAILED|ERROR" "$out/gpu.log" | tail -30
fi
if has gpu1; then
  # The whole GPU suite in two calls (v0.32: every test's second call of a signature takes the fast
  # path, Note [Fast path]): the backward and API files here, the forward files in gpu2; 380 s each,
  # so a call that precompiles first (200 s at most) fits the 600 s limit.
  gpu_tests gpu1 ${GPU_PART_TIMEOUT:-380} tests/test_bwd_gpu.py tests/test_api_gpu.py tests/test_preprocess_gpu.py \
    tests/test_cuda_graph_gpu.py tests/test_device_guard_gpu.py tests/test_mods_gpu.py tests/test_block_sparse_gpu.py
fi
# The forward GPU files (gpu2, and the steps that rerun the forward after a default changes).
GPU2_FILES=(tests/test_fwd_sm90_gpu.py tests/test_fwd_sm80_gpu.py tests/test_fwd_splitkv_gpu.py
  tests/test_flash_attn_cute_calls_gpu.py tests/test_combine_gpu.py tests/test_one_step_loop_gpu.py
  tests/test_rescale_accuracy_gpu.py tests/test_softmax_gpu.py tests/test_kvcache_gpu.py tests/test_fold_first_gpu.py)
if has gpu2; then
  gpu_tests gpu2 ${GPU_PART_TIMEOUT:-380} "${GPU2_FILES[@]}"
fi
# sanitize_run NAME LIMIT SCRIPT [ARGS...]: memcheck and racecheck over SCRIPT, each under LIMIT seconds.
sanitize_run() {
  local name=$1 limit=$2 script=$3; shift 3
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    timeout "$limit" compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 3 python3 "$script" "$@" \
      > "$out/${name}_$tool.log" 2>&1
    echo "$name $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/${name}_$tool.log" | tail -1)"
  done
}
if has sanitize; then
  # 300 s: on a machine with an empty kernel cache memcheck compiles every case under the tool (v0.47: over 150 s).
  sanitize_run sanitize 300 tools/sanitize_sm90.py
fi
if has sanitizepack; then
  # Session 41: packed GQA rows by TMA (tools/sanitize_pack.py).
  sanitize_run sanitizepack 140 tools/sanitize_pack.py
fi
if has sanitizemods; then
  # Session 29: the user functions' cases (their kernels compile under each tool: not disk-cached).
  sanitize_run sanitizemods 240 tools/sanitize_mods.py
fi
if has bwdacc; then
  # Gradient error of backward variants against the float32 reference, beside flash-attn-4's (BWDACC: experiments).
  eval "set -- ${BWDACC:-'d256 dq_pass=False' 'd256' 'd256 peer' 'd256 causal dq_pass=False' 'd256 causal' 'd256 causal peer' 'd192' 'd192 dq_pass=True' 'd192 peer' 'd160 dq_pass=True' 'd160'}"
  timeout ${BWDACC_TIMEOUT:-200} python3 tools/bwd_accuracy.py "$@" > "$out/bwdacc.log" 2>&1
  echo "bwdacc rc=$?"; grep -v Warning "$out/bwdacc.log" | tail -30
fi
if has benchbwd; then
  timeout 300 python3 -m fa4.bench --mode bwd --out "$out/benchbwd" ${BENCH_ARGS:-} > "$out/benchbwd.log" 2>&1
  echo "benchbwd rc=$?"; tail -32 "$out/benchbwd.log"
fi
if has bench; then
  timeout 400 python3 -m fa4.bench --mode both --out "$out/bench" ${BENCH_ARGS:-} > "$out/bench.log" 2>&1
  echo "bench rc=$?"; tail -60 "$out/bench.log"
fi
if has det; then
  timeout 300 python3 -m fa4.bench --mode bwd --deterministic --out "$out/det" ${BENCH_ARGS:-} > "$out/det.log" 2>&1
  echo "det rc=$?"; tail -32 "$out/det.log"
fi
if has next33; then
  # Session 32 (RESULTS v0.33): flash_attn_with_kvcache (Note [KV cache calls]): its GPU tests,
  # then python -m fa4.bench --decode with the new fa4-kvcache16 / kvcache/paged columns.
  gpu_tests next33tests 300 tests/test_kvcache_gpu.py  # (the bench runs whatever the tests say)
  timeout 300 python3 -m fa4.bench --decode --out "$out/decode33" > "$out/next33decode.log" 2>&1
  echo "next33 decode rc=$?"; grep -v Warning "$out/next33decode.log" | tail -8
fi
if has next34; then
  # Session 33 (RESULTS v0.34): one_step_loop with its uniform window branch (Note [A uniform window
  # branch]): its same-bits tests and the sm90 forward file (the fast path's first GPU run there),
  # its cost against the separate loops, compile times on this host; then flash_attn_with_kvcache's
  # and the flash_attn.cute calls' tests (never run), and the sliding-window rows. Limits sum to 480 s
  # after the precompile.
  gpu_tests next34tests 150 tests/test_one_step_loop_gpu.py tests/test_fwd_sm90_gpu.py
  rc=$?; [ $rc = 0 ] || [ $rc = 124 ] || exit 1  # a failure stops the run; the time limit does not
  logged next34osl 110 30 python3 tools/sweep_fwd.py --hdim 64,128,192,256 --seqlen 4096,8192 --causal yes --any-pair \
    --repeat 3 osl:one_step_loop=True
  logged next34ctime 70 30 python3 tools/compile_time.py
  gpu_tests next34kvc 90 tests/test_kvcache_gpu.py tests/test_flash_attn_cute_calls_gpu.py
  logged next34osl_local 60 12 python3 tools/sweep_fwd.py --hdim 128,256 --seqlen 8192 --window 1024 --any-pair \
    --repeat 3 osl:one_step_loop=True
fi
if has next34m; then
  # next34 cut to what decides one_step_loop's default (for a lease with little time): its same-bits
  # tests, then its cost against the separate loops (run with nocompile: the sweep compiles its own).
  gpu_tests next34mtests 90 tests/test_one_step_loop_gpu.py
  rc=$?; [ $rc = 0 ] || [ $rc = 124 ] || exit 1
  logged next34osl 110 30 python3 tools/sweep_fwd.py --hdim 64,128,192,256 --seqlen 4096,8192 --causal yes --any-pair \
    --repeat 3 osl:one_step_loop=True
fi
if has next35; then
  # Session 34 (RESULTS v0.35): one_step_loop with K released after the mask (Note [K's release
  # after the mask]): its same-bits tests, then its cost against the separate loops, five rounds,
  # causal and local, on one machine (the default changes only if it is within 1% on every row).
  gpu_tests next35tests 120 tests/test_one_step_loop_gpu.py
  rc=$?; [ $rc = 0 ] || [ $rc = 124 ] || exit 1
  logged next35osl 150 30 python3 tools/sweep_fwd.py --hdim 64,128,192,256 --seqlen 4096,8192 --causal yes --any-pair \
    --repeat 5 osl:one_step_loop=True
  logged next35osl_local 90 12 python3 tools/sweep_fwd.py --hdim 128,192,256 --seqlen 8192 --window 1024 --any-pair \
    --repeat 5 osl:one_step_loop=True
fi
if has next35h; then
  # Session 34: are block-sparse calls host-bound? Eager against CUDA-graph replay (tools/host_vs_gpu.py).
  logged next35h 150 12 python3 tools/host_vs_gpu.py --cases mods-blockdoc-d128,mods-docmask-d128,mods-alibi-d128
fi
if has next35t; then
  # Session 34, branch wip/table-kernel: the block table in one launch (Note [One launch for the
  # table]): the block-sparse GPU tests (the kernel against the torch build among them), then the
  # document mask with block lists, eager and CUDA-graph replay, with the kernel and without.
  gpu_tests next35ttests 200 tests/test_block_sparse_gpu.py || exit 1
  logged next35t_kernel 90 6 python3 tools/host_vs_gpu.py --cases mods-blockdoc-d128
  logged next35t_torch 90 6 python3 -c "import runpy, sys; import fa4.block_sparse as b; b.TABLE_KERNEL = False; \
sys.argv = ['host_vs_gpu', '--cases', 'mods-blockdoc-d128']; runpy.run_path('tools/host_vs_gpu.py', run_name='__main__')"
fi
if has next36; then
  # Session 35 (RESULTS v0.36): one_step_loop the default at d192 (causal / local): the sm90 forward
  # suite and the one_step_loop tests, then d192 against the separate loops (five rounds), then the
  # forward grid side by side, three repeats (issue 7's misses).
  gpu_tests next36tests 200 tests/test_fwd_sm90_gpu.py tests/test_one_step_loop_gpu.py || exit 1
  logged next36sep 90 12 python3 tools/sweep_fwd.py --hdim 192 --seqlen 4096,8192 --causal yes --any-pair \
    --repeat 5 sep:one_step_loop=False
  timeout 150 python3 -m fa4.bench --mode fwd --hdim 64,128,256 --seqlen 8192 --repeats 3 --out "$out/next36bench" > "$out/next36bench.log" 2>&1
  echo "next36bench rc=$?"; grep -E "^ *[0-9]+ +[0-9]+ +[0-9]+ " "$out/next36bench.log" | tail -14
fi
if has next37n; then
  # Session 35's Next: where the document mask_mod's time goes, fa4 against flash-attn-4 (0.77x):
  # source-level stall sampling of both forwards on mods-docmask-d128 (the ncusrc step's method).
  NCU_FWD_SHAPES=mods-docmask-d128 bash "$0" nocompile,ncusrc
fi
if has next37a; then
  # Session 35, branch wip/aux-unit-stride: aux tensors compiled with the last stride 1 (Note [Aux
  # tensors' unit stride]): the user-function GPU tests (a column-major table among them), then the
  # user-function cases against main's numbers (run next37n's bench beside it on main).
  gpu_tests next37atests 300 tests/test_mods_gpu.py tests/test_block_sparse_gpu.py || exit 1
  logged next37abench 200 12 python3 -m fa4.bench --offgrid --mode fwd,bwd --rounds 3 \
    --cases mods-docmask-d128,mods-relbias-d128-causal,mods-blockdoc-d128
fi
if has next38; then
  # Session 36, one call (branch wip/aux-unit-stride, main's fa4 unpacked in baseline/, untracked):
  # (1) the branch's user-function and block-sparse GPU tests; (2) the user-function cases, main
  # (baseline/) and the branch in turn, twice; (3) issue 7's s8k forward rows with three repeats;
  # (4) next37n's profile of both document-mask forwards.
  gpu_tests next38tests 300 tests/test_mods_gpu.py tests/test_block_sparse_gpu.py || exit 1
  beside_main next38 2 --mode fwd,bwd --rounds 2 \
    --cases mods-docmask-d128,mods-relbias-d128-causal,mods-blockdoc-d128
  timeout 150 python3 -m fa4.bench --mode fwd --hdim 64,128,256 --seqlen 8192 --repeats 3 --out "$out/next38bench" > "$out/next38bench.log" 2>&1
  echo "next38bench rc=$?"; grep -E "^ *[0-9]+ +[0-9]+ +[0-9]+ " "$out/next38bench.log" | tail -14
  NCU_FWD_SHAPES=mods-docmask-d128 bash "$0" nocompile,ncusrc
fi
if has next38b; then
  # Session 36, branch wip/aux-unit-stride with the score positions (Note [Score positions]: the
  # document mask's d128 step 892 -> 642 SASS instructions): the user-function and block-sparse GPU
  # tests, then main (baseline/, untracked) and the branch in turn on the user-function cases.
  gpu_tests next38btests 300 tests/test_mods_gpu.py tests/test_block_sparse_gpu.py || exit 1
  beside_main next38b 2 --mode fwd,bwd --rounds 2 \
    --cases mods-docmask-d128,mods-relbias-d128-causal,mods-blockdoc-d128
fi
if has next39; then
  # Session 36's Next 1, on branch wip/positions-fold-only with main's fa4 unpacked in baseline/
  # (untracked: rm -rf baseline && mkdir baseline && git archive main fa4 | tar -x -C baseline):
  # the trace-time unroll only where a key table read folds; its user-function and block-sparse
  # GPU tests, then main and the branch in turn on the user-function cases.
  gpu_tests next39tests 300 tests/test_mods_gpu.py tests/test_block_sparse_gpu.py || exit 1
  beside_main next39 2 --mode fwd,bwd --rounds 2 \
    --cases mods-docmask-d128,mods-relbias-d128-causal,mods-blockdoc-d128
fi
if has next39n; then
  # Session 36's Next 2, on branch wip/narrow-ballot with main's fa4 in baseline/ (as next39): the
  # block-sparse forward's K range by ballot (Note [Narrowing by ballot]); its GPU tests, then the
  # block-sparse document lists beside main, three times in turn.
  gpu_tests next39ntests 300 tests/test_block_sparse_gpu.py || exit 1
  beside_main next39n 3 --mode fwd --rounds 2 --cases mods-blockdoc-d128
fi
if has next40; then
  # Session 37: main with wip/positions-fold-only and wip/narrow-ballot merged (each ran its tests
  # alone on an H100): the user-function and block-sparse GPU tests on the merge.
  gpu_tests next40tests 300 tests/test_mods_gpu.py tests/test_block_sparse_gpu.py || exit 1
fi
if has next40v; then
  # Session 37: varlen calls without max_seqlen (next30e: 1.9x slower decode, 1.45x slower causal GQA
  # backward): the forward's COMPACT_LOOSE_BOUND on, the backward's sections judged on the average
  # lengths. The varlen / decode GPU tests, then the nomax cases beside the call with the lengths
  # (the backward's sections: 8 from the average, 4 from the given max: the variant).
  gpu_tests next40vtests 260 tests/test_fwd_sm90_gpu.py tests/test_bwd_gpu.py tests/test_flash_attn_cute_calls_gpu.py \
    tests/test_api_gpu.py tests/test_fwd_splitkv_gpu.py tests/test_kvcache_gpu.py \
    -k "varlen or loose or nomax or compact or decode" || exit 1
  logged next40nomax 220 20 python3 -m fa4.bench --offgrid --mode fwd,bwd --rounds 2 \
    --cases varlen-d128-nomax,varlen-gqa-d128-causal-nomax,varlen-gqa-d128-causal --variant "bwd.section=4"
  logged next40dec 90 8 python3 -m fa4.bench --offgrid --mode fwd --cases varlen-decode,varlen-decode-nomax
fi
if has next41; then
  # Session 37's Next: the GQA causal backward against flash-attn-4 (varlen 0.85-0.88x on the H100,
  # v0.38; dense GQA 4 s4k causal 0.94x, v0.26): the group split (Note [Split GQA group]) on these
  # rows, three rounds.
  logged next41 300 24 python3 -m fa4.bench --offgrid --mode bwd --rounds 3 \
    --cases varlen-gqa-d128-causal,gqa-d128-s4k-causal \
    --variant "bwd.kv_split=2" --variant "bwd.kv_split=4"
  # ... and its launch sections: 4 pairs with the lengths (the wave floor; the L2 budget alone gives 2
  # on an H100: 4 pairs of 3774 rows x 4 q heads hold 62 MB); v0.38 read 8 faster than 4 without them.
  logged next41s 240 20 python3 -m fa4.bench --offgrid --mode bwd --rounds 3 --cases varlen-gqa-d128-causal \
    --variant "bwd.section=2" --variant "bwd.section=8" --variant "bwd.section=16"
fi
if has next47; then
  # Session 39's Next 1: main with session 38's three branches merged (each passed its files alone on
  # an H100; the merged run was cut off): their GPU files together.
  gpu_tests next47tests 560 tests/test_block_sparse_gpu.py tests/test_api_gpu.py tests/test_mods_gpu.py \
    tests/test_combine_gpu.py tests/test_flash_attn_cute_calls_gpu.py || exit 1
fi
if has next47s; then
  # Session 39's Next 2: the causal backward's launch sections on the varlen rows (v0.39, H100: the
  # GQA row 2.44-2.51 ms with the default 4, 2.17-2.28 with 16; 32 and 64 not timed) and the dense
  # GQA s4k and MQA s8k rows, three rounds.
  logged next47s 300 40 python3 -m fa4.bench --offgrid --mode bwd --rounds 3 \
    --cases varlen-gqa-d128-causal,varlen-d128-causal,varlen-d64-causal,gqa-d128-s4k-causal,mqa-d128-s8k-causal \
    --variant "bwd.section=4" --variant "bwd.section=8" --variant "bwd.section=16" \
    --variant "bwd.section=32" --variant "bwd.section=64"
  # ... and ncu of the GQA row's backward with sections of 4 and 16: L2 hit rate, reductions, DRAM.
  for sec in 4 16; do
    timeout 100 ncu --clock-control none --kernel-name regex:fa4_bwd_sm90 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
      python3 tools/ncu_offgrid.py varlen-gqa-d128-causal "$sec" > "$out/next47ncu$sec.txt" 2>&1
    echo "next47ncu$sec rc=$?"; grep -E "fa4_bwd|Duration|Throughput|L2 Hit|L1/TEX Hit|Mem Busy|Max Bandwidth|Grid Size|Achieved" \
      "$out/next47ncu$sec.txt" | cut -c1-150 | head -24
  done
fi
if has next49; then
  # Session 40: the outputs through empty_like again (3e191e4; ~3-4 us of host time per fast call on
  # the CPU). The GPU files that allocate outputs through every path (API, CUDA graphs, kvcache), then
  # --latency three times. Prediction: fa4 within 1.1x of cuDNN's us in each run (v0.37: 19.0 / 22.4
  # against 18.9 / 21.3; v0.41 before the fix: 1.08-1.71x).
  gpu_tests next49tests 400 tests/test_api_gpu.py tests/test_cuda_graph_gpu.py tests/test_kvcache_gpu.py || exit 1
  # ... and the varlen-without-lengths tests, whose inputs moved into fwd_cases.loose_bound_inputs.
  gpu_tests next49loose 200 tests/test_fwd_sm80_gpu.py tests/test_fwd_sm90_gpu.py \
    -k "without_lengths or loose_bound_rule" || exit 1
  for r in 1 2 3; do
    timeout 60 python3 -m fa4.bench --latency --out "$out/next49lat$r" > "$out/next49lat$r.log" 2>&1
    echo "next49lat$r rc=$?"; grep -E "^(1|8) " "$out/next49lat$r.log" | cut -c1-120
  done
fi
if has next50; then
  # Session 41: packed GQA rows by TMA (Note [Packed rows by TMA]). Its tests (bit-identical to the
  # row copies, the reference rule) and every packed-row GPU file, then the GQA rows packed by TMA /
  # packed by rows / the default (unpacked: fa4.fwd.common.PACK_GQA_MAX_TILE_SHARE), two rounds.
  # Prediction: varlen GQA causal packed by TMA 3-6% under the unpacked default (5% fewer K-block
  # steps on its ragged tails), near flash-attn-4's; the dense s4k rows within 2% of unpacked.
  gpu_tests next50t 420 tests/test_fwd_sm90_gpu.py tests/test_fwd_splitkv_gpu.py tests/test_kvcache_gpu.py \
    -k "packed_rows or varlen or compact or loose or pack or split or decode or kvcache" || exit 1
  logged next50b 300 40 python3 -m fa4.bench --offgrid --mode fwd --rounds 2 \
    --cases varlen-gqa-d128-causal,gqa-d128-s4k,gqa-d128-s4k-causal,prefill-cache-d128 \
    --variant "fwd.qhead_per_kvhead=4" --variant "fwd.qhead_per_kvhead=4 fwd.pack_tma=False"
  logged next50d 120 10 python3 -m fa4.bench --offgrid --mode fwd --rounds 2 \
    --cases varlen-decode --variant "fwd.pack_tma=False"
fi
if has next50g; then
  # ... then the default packs GQA rows by TMA up to 4 q heads per kv head (PACK_WHOLE_ROWS_MAX_GROUP):
  # the sm90 forward file (its GQA cases now packed) and the drop-in calls, then packed (default) /
  # unpacked at d64 (192-row tiles), d256 (O in Q's smem) and d128, two rounds. Prediction: packed
  # within 2% of unpacked on the dense rows, +3-6% on the varlen rows.
  gpu_tests next50g 330 tests/test_fwd_sm90_gpu.py tests/test_flash_attn_cute_calls_gpu.py || exit 1
  logged next50gb 260 40 python3 -m fa4.bench --offgrid --mode fwd --rounds 2 \
    --cases gqa-d64-s4k-causal,varlen-gqa-d64-causal,gqa-d256-s4k-causal,varlen-gqa-d256-causal,gqa-d128-s4k \
    --variant "fwd.qhead_per_kvhead=1"
fi
if has next51; then
  # Session 41's unrun GPU work, tests only (about 6 min): first the files not rerun after the
  # default began packing GQA prefill (kvcache's prefill chunks, the split-KV / pack file, the
  # block-sparse file the rule leaves unpacked); then the packed boxes of tile_m // g positions
  # (pack_tma_partial, off by default): their tests and compute-sanitizer. Timings: next51b.
  # These three files hold 8 GiB decode caches and the block-sparse references: 12 workers ran out of
  # the H100's memory (session 42), so 5 share it.
  gpu_tests_on 5 next51t 420 tests/test_kvcache_gpu.py tests/test_fwd_splitkv_gpu.py tests/test_block_sparse_gpu.py || exit 1
  gpu_tests next51p 200 tests/test_fwd_sm90_gpu.py -k "partial_boxes or packed_rows" || exit 1
  sanitize_run next51s 140 tools/sanitize_pack.py
fi
if has next52; then
  # Session 42: the partial boxes after the Q stage's transaction count was mended (their d128 / d256
  # cases hung on the expected bytes): their tests, compute-sanitizer, then the g = 7 row's timings.
  gpu_tests next52p 200 tests/test_fwd_sm90_gpu.py -k "partial_boxes or packed_rows" || exit 1
  SANITIZE_TOOLS=${SANITIZE_TOOLS:-racecheck} sanitize_run next52s 140 tools/sanitize_pack.py
fi
if has next52b; then
  logged next52g7 240 30 python3 -m fa4.bench --offgrid --mode fwd --rounds 3 --cases varlen-gqa7-d128-causal \
    --variant "fwd.qhead_per_kvhead=7 fwd.pack_tma_partial=True" --variant "fwd.qhead_per_kvhead=7"
fi
if has next53; then
  # Session 42: the default packs up to 8 q heads per kv head, by boxes of tile_m // g positions where
  # g does not divide the tile (pack_tma_partial on): the sm90 forward and split-KV files (8 workers),
  # then Qwen2.5-7B's dense g = 7 row packed (the default) / unpacked (prediction: within 3%, as
  # g = 4 / 8's dense rows) and its varlen row once more.
  gpu_tests_on 8 next53t 330 tests/test_fwd_sm90_gpu.py tests/test_fwd_splitkv_gpu.py || exit 1
  logged next53g7 150 20 python3 -m fa4.bench --offgrid --mode fwd --rounds 2 \
    --cases gqa7-d128-s4k-causal,varlen-gqa7-d128-causal --variant "fwd.qhead_per_kvhead=1"
fi
if has next54; then
  # Session 42's unrun test: packed GQA's error against the float32 reference beside pack_gqa=False
  # (g = 4 / 7 / 8 / 6 defaults, g = 5 forced), with the packed-box tests again. Then gpu1 / gpu2
  # (the files the g <= 8 / ragged-Q rule reaches that next53 did not run) and next54b.
  gpu_tests next54t 240 tests/test_fwd_sm90_gpu.py -k "packed_error or partial_boxes or packed_rows" || exit 1
  # flash_attn_with_kvcache with 7 q heads per kv head: partial boxes with paged / indexed caches.
  gpu_tests next54k 200 tests/test_kvcache_gpu.py -k "against_reference and -14-" || exit 1
fi
if has next54b; then
  # ... and the packing rule's rows on the H200, two rounds each, the default (packed) beside
  # unpacked: g = 7 dense (not packed by default: -4% in one H100 round) and varlen, g = 8, d64 / d256.
  logged next54g7 200 30 python3 -m fa4.bench --offgrid --mode fwd --rounds 2 \
    --cases gqa7-d128-s4k-causal,varlen-gqa7-d128-causal --variant "fwd.qhead_per_kvhead=1" --variant "fwd.qhead_per_kvhead=7"
  logged next54g8 200 30 python3 -m fa4.bench --offgrid --mode fwd --rounds 2 \
    --cases gqa8-d128-s4k-causal,varlen-gqa8-d128-causal --variant "fwd.qhead_per_kvhead=1"
  logged next54d 200 30 python3 -m fa4.bench --offgrid --mode fwd --rounds 2 \
    --cases varlen-gqa-d64-causal,varlen-gqa-d256-causal,varlen-gqa-d128-causal --variant "fwd.qhead_per_kvhead=1"
fi
if has next56; then
  # Session 43: fold_first (Note [The first block in the masked loop]): its GPU tests (the same bits
  # as the separate first block), then the causal rows with it and without, five interleaved rounds
  # (prediction: within 1%: only a tile's masked blocks run the folded body), a window's row, and
  # the cold compile times (this CPU: d128 causal -19%, d64 -17%, d256 -14%). (Ran before fold_first
  # became the causal default: rerun now, its causal "fold" column is the default's kernel.)
  gpu_tests next56t 300 tests/test_fold_first_gpu.py || exit 1
  logged next56c 330 30 python3 tools/sweep_fwd.py --hdim 64,128,256 --seqlen 4096,8192 --causal yes --any-pair \
    --repeat 5 fold:fold_first=True
  logged next56l 150 20 python3 tools/sweep_fwd.py --hdim 128 --seqlen 8192 --causal no --window 1024 --any-pair \
    --repeat 3 fold:fold_first=True
  logged next56ct 150 40 python3 tools/compile_time.py
fi
if has next57; then
  # Session 43's unrun work (CPU only then): the sm80 family's fold_first (off by default until this
  # runs; no runtime branch there) in tests/test_fold_first_gpu.py beside the sm90 one (same bits as
  # the separate first block), then its timings on the causal rows (prediction: within 1%, the free
  # loop's SASS is the same) and its interleaved compile times (this CPU, contended: d64 / d128 /
  # d256 causal 10.5 -> 6.0 / 8.2 -> 6.2 / 8.0 -> 6.8 s).
  gpu_tests next57t 330 tests/test_fold_first_gpu.py || exit 1
  logged next57s 240 30 python3 tools/sweep_fwd.py --family sm80 --hdim 64,128,256 --seqlen 8192 --causal yes \
    --any-pair --repeat 5 fold:fold_first=True
  logged next57ct 200 20 python3 tools/compile_time.py --ab fold_first --reps 3 --family sm80
fi
if has next59; then
  # Session 44: branch wip/edges-first (on wip/fqb2: fold_first with the first Q K^T before the
  # walk). A local tile walks its right edge, then its left edge, then the free blocks (Note [Edges
  # first] in fa4/mask.py), so the fold holds one masked step for both edges. The fold's tests (the
  # same bits as the separate form, which walks the same order; sm80's fold too), then the forward
  # files' window cases against the reference (the local default's bits changed with the order).
  gpu_tests next59f 330 tests/test_fold_first_gpu.py || exit 1
  gpu_tests_on 8 next59w 240 tests/test_fwd_sm90_gpu.py tests/test_fwd_splitkv_gpu.py tests/test_one_step_loop_gpu.py \
    -k "local or window" || exit 1
fi
if has next72 || has next72q; then
  # Session 50: the driver's count of resident clusters (fa4.arch.resident_clusters, which now picks the
  # persistent multicast grid), then (next72) next71.
  python3 -c "import torch; from fa4.arch import num_sms, resident_clusters; print(torch.cuda.get_device_name(), num_sms(0), 'SMs, resident clusters by size:', {s: resident_clusters(0, s) for s in (1, 2, 4, 8)})" 2>&1 | grep -v Warning | tee "$out/resident.log"
  has next72 && bash "$0" nocompile,next71
fi
if has next73; then
  # Session 51: K/V multicast under a causal mask (a pair walks the union of its ranges; on the dynamic
  # grid CTA 0 claims each pair and hands it to CTA 1, Note [Pair claims]): the multicast GPU tests
  # (and the driver's resident counts), stopping on a failure, then the multicast cases under memcheck /
  # racecheck; next73s: the causal rows against the default (d128 five rounds, d64 / d256 s8k three).
  gpu_tests next73 ${NEXT73_TIMEOUT:-180} tests/test_fwd_sm90_gpu.py -k "kv_multicast or cluster_pairs or resident" || exit 1
  sanitize_run next73 90 tools/sanitize_sm90.py --mcast
fi
if has next73s; then
  timeout 120 python3 tools/sweep_fwd.py --hdim 128 --seqlen 4096,8192,16384 --causal yes --repeat 5 mcd:kv_mcast=True > "$out/sweep73.log" 2>&1
  echo "sweep73 rc=$?"; grep -v Warning "$out/sweep73.log" | tail -8
  timeout 90 python3 tools/sweep_fwd.py --hdim 64,256 --seqlen 8192 --causal yes --repeat 3 mcd:kv_mcast=True > "$out/sweep73b.log" 2>&1
  echo "sweep73b rc=$?"; grep -v Warning "$out/sweep73b.log" | tail -6
fi
if has next74; then
  # Session 51's Next: d64 causal multicast with 3-4 K / V stages (two stages lost 3.8%: a third may
  # decouple the pair's two CTAs), five rounds; then the forward grid beside the peers, three repeats.
  timeout 200 python3 tools/sweep_fwd.py --hdim 64 --seqlen 8192,16384 --causal yes --repeat 5 mc:kv_mcast=True mc3:kv_mcast=True,num_stages=3 mc4:kv_mcast=True,num_stages=4 > "$out/sweep74.log" 2>&1
  echo "sweep74 rc=$?"; grep -v Warning "$out/sweep74.log" | tail -5
  timeout 300 python3 -m fa4.bench --mode fwd --causal both --repeats 3 > "$out/bench74.log" 2>&1
  echo "bench74 rc=$?"; grep -E "^ *[0-9]+ |^# " "$out/bench74.log" | tail -16
fi
if has next87; then
  # Session 55, the tests first: the d256 window default (one step body), the backward's pdl option, the
  # split-KV combine launched early (SPLIT_PDL, an option); then the decode rows with the early combine
  # and without, five interleaved rounds.
  gpu_tests next87w 150 tests/test_one_step_loop_gpu.py tests/test_fwd_sm90_gpu.py tests/test_fwd_splitkv_gpu.py -k "local or window"
  gpu_tests next87p 130 tests/test_bwd_gpu.py -k pdl
  gpu_tests next87c 120 tests/test_fwd_splitkv_gpu.py tests/test_combine_gpu.py -k "pdl or split_kv or decode"
  timeout 120 python3 tools/decode_sweep.py --pdl > "$out/decode87.log" 2>&1
  echo "decode87 rc=$?"; grep -v Warning "$out/decode87.log" | tail -30
fi
if has next87s; then
  # Session 55's sweeps: the backward rows with pdl and without (two interleaved rounds), then the window
  # rows with the separate loops and one step body (three rounds).
  exps=()
  for r in 1 2; do
    for row in "d128 s1024" "d128 s1024 causal" "d64 s8192" "d128 s8192"; do exps+=("$row" "$row pdl=True"); done
  done
  timeout 160 python3 tools/sweep_bwd.py "${exps[@]}" > "$out/sweep87b.log" 2>&1
  echo "sweep87b rc=$?"; grep -v Warning "$out/sweep87b.log" | tail -18
  timeout 120 python3 tools/sweep_fwd.py --hdim 128,256 --seqlen 8192 --window 1024 --repeat 3 \
    sep:one_step_loop=False osl:one_step_loop=True,fold_first=False > "$out/sweep87w.log" 2>&1
  echo "sweep87w rc=$?"; grep -v Warning "$out/sweep87w.log" | tail -4
fi
if has next88; then
  # Session 55, on a warm machine after next87: three more rounds of the backward's pdl rows (with d128
  # s16k), five of the d256 window row (one step body against the separate loops), the d256 causal one
  # step body (five rounds), the d128 s1k forward row (ten rounds: warpgroup stores, ping-pong), then the
  # host's compile times.
  exps=()
  for r in 1 2 3; do
    for row in "d128 s1024" "d128 s1024 causal" "d64 s8192" "d128 s8192" "d128 s16384 causal"; do
      exps+=("$row" "$row pdl=True")
    done
  done
  timeout 150 python3 tools/sweep_bwd.py "${exps[@]}" > "$out/sweep88b.log" 2>&1
  echo "sweep88b rc=$?"; grep -v Warning "$out/sweep88b.log" | tail -31
  timeout 90 python3 tools/sweep_fwd.py --hdim 256 --seqlen 8192 --window 1024 --repeat 5 \
    sep:one_step_loop=False osl:one_step_loop=True,fold_first=False > "$out/sweep88w.log" 2>&1
  echo "sweep88w rc=$?"; grep -v Warning "$out/sweep88w.log" | tail -2
  timeout 90 python3 tools/sweep_fwd.py --hdim 256 --seqlen 8192 --causal yes --repeat 5 \
    osl:one_step_loop=True,fold_first=False > "$out/sweep88c.log" 2>&1
  echo "sweep88c rc=$?"; grep -v Warning "$out/sweep88c.log" | tail -2
  timeout 120 python3 tools/sweep_fwd.py --hdim 128 --seqlen 1024 --repeat 10 wg:wg_store_o=True \
    pp:pingpong=True ppwg:pingpong=True,wg_store_o=True > "$out/sweep88s.log" 2>&1
  echo "sweep88s rc=$?"; grep -v Warning "$out/sweep88s.log" | tail -4
  logged ctime88 200 40 python3 tools/compile_time.py
fi
if has next97; then
  # Session 58: the ordered kernel for short causal rows (Note [The ordered kernel for short causal rows],
  # ORDERED_SHORT_MAX_SEQLEN_K = 1024, on by bench evidence only: +3.5% H200 v0.22, +8.9% H100 v0.59 at
  # d128 s1k causal): its GPU test, then six interleaved rounds against it off at d128 s1k causal, and
  # four at s2k causal with the bound raised to 2048 (the rule's reach), and the deterministic request
  # at s1k without a mask (+0.8% / +1.5% in the benches; a rule for it would need more than that).
  gpu_tests next97t 150 tests/test_bwd_gpu.py -k "short_causal_rows or test_bwd_deterministic" || exit 1
  rows=()
  for r in 1 2 3 4 5 6; do
    rows+=("d128 s1024 causal" "d128 s1024 causal const.ORDERED_SHORT_MAX_SEQLEN_K=0")
  done
  for r in 1 2 3 4; do
    rows+=("d128 s2048 causal" "d128 s2048 causal const.ORDERED_SHORT_MAX_SEQLEN_K=2048" "d128 s1024" "d128 s1024 det")
  done
  timeout 240 python3 tools/sweep_bwd.py "${rows[@]}" > "$out/sweep97.log" 2>&1
  echo "sweep97 rc=$?"; grep -v Warning "$out/sweep97.log" | grep -v exe_args | tail -42
fi
if has next96; then
  # Session 58: the deterministic backward beside the non-deterministic one and flash-attn-4's
  # (issue 8's 0.95x; last benched in v0.22-v0.25, before the pdl, split-group and stmatrix changes),
  # the cold compile times with three more rounds of the sm90 defaults (issue 7 item 7; each time's
  # compile / export / load parts), then --latency (issue 7's latency bar; last on an H200 in v0.42).
  timeout 250 python3 -m fa4.bench --mode bwd --deterministic --out "$out/det96" > "$out/det96.log" 2>&1
  echo "det96 rc=$?"; grep -E "^# (gpu|bf16|bwd)" "$out/det96.log"; tail -16 "$out/det96.log"
  logged ctime96 190 46 python3 tools/compile_time.py --reps 3
  timeout 90 python3 -m fa4.bench --latency --out "$out/latency96" > "$out/latency96.log" 2>&1
  echo "latency96 rc=$?"; tail -8 "$out/latency96.log"
fi
if has next95; then
  # Session 57's Next 1 (an H200): O rescaled before the next P V at d64 (rescale_o_before_pv), ten
  # interleaved rounds on the s4k / s8k / s16k rows without a mask and s8k causal (v0.58 on an H100:
  # -2.5% / +2.5% / +3.8% / -0.2%, inside the spreads). Its own call (about 360 s), after nocompile,next83.
  timeout 260 python3 tools/sweep_fwd.py --any-pair --hdim 64 --seqlen 4096,8192,16384 --causal no --repeat 10 \
    rb:rescale_o_before_pv=True > "$out/sweep95.log" 2>&1
  echo "sweep95 rc=$?"; grep -v Warning "$out/sweep95.log" | tail -4
  timeout 100 python3 tools/sweep_fwd.py --hdim 64 --seqlen 8192 --causal yes --repeat 10 \
    rb:rescale_o_before_pv=True > "$out/sweep95c.log" 2>&1
  echo "sweep95c rc=$?"; grep -v Warning "$out/sweep95c.log" | tail -2
fi
if has next94; then
  # Session 57: O staged by stmatrix the d256 default (STMATRIX_O_MIN_DV): the forward files' d256
  # cases (every test id with 256 in it: the sm90 forward, fold, user-function, block-sparse, one step
  # body, rescale accuracy and flash_attn.cute-call files), twelve workers.
  gpu_tests_on 12 next94 ${GPU_PART_TIMEOUT:-330} tests/test_fwd_sm90_gpu.py tests/test_fold_first_gpu.py \
    tests/test_mods_gpu.py tests/test_block_sparse_gpu.py tests/test_one_step_loop_gpu.py \
    tests/test_rescale_accuracy_gpu.py tests/test_flash_attn_cute_calls_gpu.py -k 256
fi
if has next93; then
  # Session 56's option, O staged by stmatrix (Note [O staged by stmatrix], every sm90 forward): its
  # bit-equality test against the 32-bit stores, then four interleaved rounds on the s8k grid rows and
  # d128 s1k. (The default follows if the test passes and no row loses; the forward file then runs whole
  # in a later call.)
  gpu_tests next93t 300 tests/test_fwd_sm90_gpu.py -k stmatrix
  rc=$?; [ $rc = 0 ] || [ $rc = 124 ] || exit 1
  # (At d64 also O rescaled before the next P V, which the cu13 SASS shows moving the 32 rescale FMULs
  # out of the softmax's tail, alone and with stmatrix; v0.57.)
  timeout 170 python3 tools/sweep_fwd.py --hdim 64,128,256 --seqlen 8192 --repeat 4 new:stmatrix_o=True \
    rb:rescale_o_before_pv=True,hd=64 rbst:rescale_o_before_pv=True,stmatrix_o=True,hd=64 \
    > "$out/sweep93.log" 2>&1
  echo "sweep93 rc=$?"; grep -v Warning "$out/sweep93.log" | tail -9
  timeout 50 python3 tools/sweep_fwd.py --hdim 128 --seqlen 1024 --repeat 5 new:stmatrix_o=True \
    > "$out/sweep93s.log" 2>&1
  echo "sweep93s rc=$?"; grep -v Warning "$out/sweep93s.log" | tail -4
fi
if has next92; then
  # Session 56: next91s found the backward's pdl +2.0% at d128 s16k causal (14 of 16 rounds) past the
  # 2048-key bound, and the main-kernel-only form no better anywhere. The other causal rows and d128 s4k,
  # pdl off / on, five interleaved rounds; then the split-KV and kvcache files with the combine launched
  # early (SPLIT_PDL, the default since v0.58).
  exps=()
  for r in 1 2 3 4 5; do
    for row in "d64 s8192 causal" "d128 s4096 causal" "d128 s8192 causal" "d256 s8192 causal" "d128 s4096"; do
      exps+=("$row pdl=False" "$row pdl=True")
    done
  done
  timeout 330 python3 tools/sweep_bwd.py "${exps[@]}" > "$out/sweep92b.log" 2>&1
  echo "sweep92b rc=$?"; grep -v Warning "$out/sweep92b.log" | grep -E "^(d|exp)" > "$out/sweep92b.txt"; tail -62 "$out/sweep92b.txt"
  # (SPLIT_PDL is the default since session 57's v0.58, which ran this step with it flipped in the tree copy.)
  gpu_tests next92k 260 tests/test_fwd_splitkv_gpu.py tests/test_kvcache_gpu.py
fi
if has next91; then
  # Session 56: next90's forward files cut to what session 55's next89f did not reach (the fold's file,
  # which holds the rewritten d256 window error test, the user-function, block-sparse and one step body
  # files), then next90s's tests: the backward's pdl and split-group tests, the captured training step.
  gpu_tests next91f 240 tests/test_fold_first_gpu.py tests/test_mods_gpu.py tests/test_block_sparse_gpu.py \
    tests/test_one_step_loop_gpu.py
  gpu_tests next91p 200 tests/test_bwd_gpu.py -k "pdl or split"
  gpu_tests next91g 100 tests/test_cuda_graph_gpu.py
fi
if has next91s; then
  # next90s's rounds alone (next90s runs them through this step): plain / pdl with the postprocess /
  # pdl on the main kernel only.
  exps=()
  for r in 1 2 3 4; do
    for row in "d128 s8192" "d64 s8192" "d128 s1024" "d128 s16384 causal"; do
      exps+=("$row pdl=False" "$row pdl=True" "$row pdl=True pdl_post=False")
    done
  done
  timeout 400 python3 tools/sweep_bwd.py "${exps[@]}" > "$out/sweep91b.log" 2>&1
  echo "sweep91b rc=$?"; grep -v Warning "$out/sweep91b.log" | tail -50
fi
if has next90; then
  # Session 55's unrun GPU work: the forward files under the new defaults (next89f ran out of time: 905 of
  # 1,020 ran), with the d256 window error test rewritten, and the user-function / block-sparse files.
  gpu_tests next90f ${GPU_PART_TIMEOUT:-380} tests/test_fwd_sm90_gpu.py tests/test_fold_first_gpu.py \
    tests/test_mods_gpu.py tests/test_block_sparse_gpu.py tests/test_one_step_loop_gpu.py
fi
if has next90s; then
  # The backward's pdl at long rows: plain launches (pdl=False: the default past 2048 keys, forced at s1k),
  # with the postprocess a dependent too (pdl=True, the short rows' default) and the main kernel alone
  # (pdl_post=False, flash-attn-4's form), four interleaved rounds. First the pdl and split-group tests
  # (the partials are now allocated before the preprocess); last the captured training step (a
  # backward with pdl inside a CUDA graph).
  gpu_tests next90p 200 tests/test_bwd_gpu.py -k "pdl or split"
  bash "$0" nocompile,next91s  # (the rounds; their log is sweep91b)
  gpu_tests next90g 100 tests/test_cuda_graph_gpu.py
fi
if has next89; then
  # Session 55's new defaults: warpgroup stores for the d128 causal tile without multicast (the forward
  # files that run d128 causal forwards), and the backward's pdl up to s_k 2048 (the backward and API files).
  gpu_tests next89f 280 tests/test_fwd_sm90_gpu.py tests/test_fold_first_gpu.py tests/test_mods_gpu.py \
    tests/test_block_sparse_gpu.py
  gpu_tests next89b 270 tests/test_bwd_gpu.py tests/test_api_gpu.py
fi
if has next86t; then
  # next86's tests alone, cut to the d256 windows, for a short lease.
  gpu_tests next86t 90 tests/test_one_step_loop_gpu.py tests/test_fwd_sm90_gpu.py -k "256 and (local or window)"
  gpu_tests next86p 130 tests/test_bwd_gpu.py -k pdl
fi
if has next86; then
  # Session 54, one call for both new things, tests first: the window GPU tests (the d256 window default
  # is now one_step_loop) and the backward's programmatic dependent launches; then three rounds of the
  # window rows with the separate loops as a variant, and two interleaved rounds of the backward rows
  # with pdl against it off.
  gpu_tests next86w 150 tests/test_one_step_loop_gpu.py tests/test_fwd_sm90_gpu.py tests/test_fwd_splitkv_gpu.py -k "local or window"
  gpu_tests next86p 130 tests/test_bwd_gpu.py -k pdl
  exps=()
  for r in 1 2; do
    for row in "d128 s1024" "d128 s1024 causal" "d64 s8192" "d128 s8192"; do exps+=("$row" "$row pdl=True"); done
  done
  timeout 140 python3 tools/sweep_bwd.py "${exps[@]}" > "$out/sweep86b.log" 2>&1
  echo "sweep86b rc=$?"; grep -v Warning "$out/sweep86b.log" | tail -18
  timeout 90 python3 tools/sweep_fwd.py --hdim 128,256 --seqlen 8192 --window 1024 --repeat 3 \
    sep:one_step_loop=False osl:one_step_loop=True,fold_first=False > "$out/sweep86w.log" 2>&1
  echo "sweep86w rc=$?"; grep -v Warning "$out/sweep86w.log" | tail -4
fi
if has next85; then
  # Session 54: the sm90 backward's programmatic dependent launches (Note [Programmatic dependent launch],
  # sm90.PDL off): their GPU tests (stop on a failure), then three interleaved rounds of the rows where
  # the preprocess and postprocess weigh most (s1k) and two long ones, default against pdl=True.
  gpu_tests next85 300 tests/test_bwd_gpu.py -k pdl || exit 1
  exps=()
  for r in 1 2 3; do
    for row in "d128 s1024" "d128 s1024 causal" "d64 s8192" "d128 s8192"; do exps+=("$row" "$row pdl=True"); done
  done
  timeout 280 python3 tools/sweep_bwd.py "${exps[@]}" > "$out/sweep85.log" 2>&1
  echo "sweep85 rc=$?"; grep -v Warning "$out/sweep85.log" | tail -26
fi
if has next84; then
  # Session 53's Next 2: the d128 s1k forward row alone (0.97x of the bar; cuDNN leads it), ten rounds of
  # warpgroup stores and ping-pong with them (-1.5% / +3.0% and +2.4% in two leases).
  timeout 300 python3 tools/sweep_fwd.py --hdim 128 --seqlen 1024 --repeat 10 wg:wg_store_o=True \
    pp:pingpong=True ppwg:pingpong=True,wg_store_o=True > "$out/sweep84.log" 2>&1
  echo "sweep84 rc=$?"; grep -v Warning "$out/sweep84.log" | tail -4
fi
if has next83; then
  # Session 53: the grid forward and backward beside the peers, two round-robin repeats, with the bar per
  # row (issues 7 / 8's bars are stated on an H200); then this host's cold compile times (issue 7 item 7).
  timeout 330 python3 -m fa4.bench --mode both --causal both --repeats 2 --out "$out/next83bench" \
    > "$out/next83bench.log" 2>&1
  echo "next83bench rc=$?"; grep -E "^# (gpu|bf16|fwd|bwd)" "$out/next83bench.log"; tail -26 "$out/next83bench.log"
  # Since v0.59 the six sm90 defaults get three more cold rounds each (median, minimum): one run's
  # 1.04-1.71x spread against the H100 host (v0.57) decides nothing.
  logged ctime83 235 46 python3 tools/compile_time.py --reps 3
fi
if has next82; then
  # Session 53: the d64 default with warpgroup stores (WG_STORE_O_BUCKETS): the forward GPU files (gpu2's),
  # then the user-function and block-sparse files (their d64 forwards take it too).
  gpu_tests next82 ${GPU_PART_TIMEOUT:-360} "${GPU2_FILES[@]}" || exit 1
  gpu_tests next82m 200 tests/test_mods_gpu.py tests/test_block_sparse_gpu.py
fi
if has next81; then
  # Session 53: the warpgroup stores' sanitizer cases again (next80's first case had taken split-KV,
  # which overlap_tiles refuses), then the decision rounds: wg_store_o at d64 / d128, and ping-pong
  # at d128 (flash-attn-4 brackets its two warpgroups' issues there), with and without the tile's
  # edges, with and without warpgroup stores; seven rounds on the grid's d64 / d128 rows.
  sanitize_run next81 100 tools/sanitize_sm90.py --wgstore
  timeout 400 python3 tools/sweep_fwd.py --hdim 64,128 --repeat 7 wg:wg_store_o=True pp:pingpong=True,hd=128 \
    pps:pingpong=True,pp_steps_only=True,hd=128 ppwg:pingpong=True,wg_store_o=True,hd=128 > "$out/sweep81.log" 2>&1
  echo "sweep81 rc=$?"; grep -v Warning "$out/sweep81.log" | tail -12
fi
if has next80; then
  # Session 52 (written, not run): each consumer warpgroup storing its own 64 rows of O (wg_store_o,
  # Note [Warpgroup stores]): its bit-equality tests (stop on the first failure), memcheck / racecheck
  # on its cases, the per-tile cost fit, then the d64 / d128 rows with it, and with overlapped tiles
  # too (the warpgroups out of step may let the overlap pay), five rounds.
  timeout 300 python3 -m pytest -m gpu $xd -q -x -rfE tests/test_fwd_sm90_gpu.py -k "wg_store_o" > "$out/next80t.log" 2>&1
  rc=$?; echo "next80 tests rc=$rc"; grep -E "passed|failed|FAILED|ERROR" "$out/next80t.log" | tail -8
  if [ $rc -eq 0 ]; then
    sanitize_run next80 100 tools/sanitize_sm90.py --wgstore
    timeout 120 python3 tools/tile_cost.py --hdim 128,64 wg:wg_store_o=True > "$out/tilecost80.log" 2>&1
    echo "tilecost80 rc=$?"; grep -v Warning "$out/tilecost80.log" | tail -8
    timeout 300 python3 tools/sweep_fwd.py --hdim 64,128 --seqlen 1024,4096,8192 --repeat 5 wg:wg_store_o=True \
      wgov:wg_store_o=True,overlap_tiles=True > "$out/sweep80.log" 2>&1
    echo "sweep80 rc=$?"; grep -v Warning "$out/sweep80.log" | tail -10
  fi
fi
if has next78; then
  # Session 52's Next 4 (issue 7's compile bar): the defaults over 2 s on this CPU are d256 causal (the
  # fold, 2.58 s; one_step_loop 1.98) and the d128 / d256 windows (separate first block, 2.83 / 3.58 s;
  # one_step_loop 1.54 / 2.09). Their speed with one_step_loop, five rounds, then the host's compile times.
  timeout 150 python3 tools/sweep_fwd.py --hdim 256 --seqlen 8192 --causal yes --repeat 5 \
    osl:one_step_loop=True,fold_first=False > "$out/sweep78c.log" 2>&1
  echo "sweep78c rc=$?"; grep -v Warning "$out/sweep78c.log" | tail -3
  # (Since session 54 the d256 window default is one_step_loop: the sep column is the separate loops.)
  gpu_tests next78t 240 tests/test_one_step_loop_gpu.py tests/test_fwd_sm90_gpu.py tests/test_fwd_splitkv_gpu.py -k "local or window" || exit 1
  timeout 200 python3 tools/sweep_fwd.py --hdim 128,256 --seqlen 8192 --window 1024 --repeat 5 \
    osl:one_step_loop=True,fold_first=False sep:one_step_loop=False > "$out/sweep78w.log" 2>&1
  echo "sweep78w rc=$?"; grep -v Warning "$out/sweep78w.log" | tail -4
  [ -n "$SKIP_CTIME" ] || logged ctime78 200 40 python3 tools/compile_time.py
fi
if has next79; then
  # Session 52's Next 2: where the d64 forward's warps stall beside flash-attn-4's (source counters, d64 s8k).
  NCU_FWD_SHAPES=64,8192,0 bash "$0" nocompile,ncusrc
fi
if has next77; then
  # Session 52's unrun GPU test: the packed GQA multicast default without a mask (KV_MCAST_GQA), and the
  # multicast bit-equality tests at d128 on the persistent grid; then the GQA rows beside the peers.
  gpu_tests next77 200 tests/test_fwd_sm90_gpu.py -k "gqa_default or (kv_multicast and 128)"
  timeout 150 python3 -m fa4.bench --offgrid --mode fwd --rounds 3 --cases gqa-d128-s4k,gqa-d128-s4k-causal \
    --variant "fwd.kv_mcast=False" > "$out/next77gqa.log" 2>&1
  echo "next77gqa rc=$?"; grep -v Warning "$out/next77gqa.log" | tail -8
fi
if has next76; then
  # Session 52: overlap_tiles as the default without a mask from s_k 4096 (Note [Tiles overlapped]):
  # memcheck / racecheck on its cases, the forward GPU files (gpu2's), then five rounds against it
  # off, and the forward grid beside the peers, two repeats. (Ran with the rule on; with the default
  # off since, its sweep compares off with off: set OVERLAP_TILES = True in fa4/fwd/sm90.py to rerun.)
  sanitize_run next76 120 tools/sanitize_sm90.py --overlap
  gpu_tests next76gpu ${GPU_PART_TIMEOUT:-300} "${GPU2_FILES[@]}"
  timeout 150 python3 tools/sweep_fwd.py --hdim 64,96,128 --seqlen 4096,8192,16384 --any-pair --causal no --repeat 5 \
    off:overlap_tiles=False > "$out/sweep76.log" 2>&1
  echo "sweep76 rc=$?"; grep -v Warning "$out/sweep76.log" | tail -10
  timeout 200 python3 -m fa4.bench --mode fwd --causal both --repeats 2 > "$out/bench76.log" 2>&1
  echo "bench76 rc=$?"; grep -E "^ *[0-9]+ |^# " "$out/bench76.log" | tail -16
fi
if has next75; then
  # Session 52: the next tile's first Q K^T under the epilogue (overlap_tiles, Note [Tiles
  # overlapped]): its bit-equality tests (stop on the first failure), then the per-tile cost fit
  # beside flash-attn-4, then the forward rows at d64 / d128 with and without it, three rounds.
  timeout 400 python3 -m pytest -m gpu $xd -q -x -rfE tests/test_fwd_sm90_gpu.py -k "overlap_tiles" \
    > "$out/next75t.log" 2>&1
  rc=$?; echo "next75 tests rc=$rc"; grep -E "passed|failed|FAILED|ERROR" "$out/next75t.log" | tail -8
  if [ $rc -eq 0 ]; then
    timeout 150 python3 tools/tile_cost.py --hdim 128,64 ov:overlap_tiles=True > "$out/tilecost75.log" 2>&1
    echo "tilecost rc=$?"; grep -v Warning "$out/tilecost75.log" | tail -8
    timeout 300 python3 tools/sweep_fwd.py --hdim 64,128 --seqlen 1024,4096,8192 --repeat 3 \
      ov:overlap_tiles=True > "$out/sweep75.log" 2>&1
    echo "sweep75 rc=$?"; grep -v Warning "$out/sweep75.log" | tail -14
  fi
fi
if has next71; then
  # Session 49 (RESULTS v0.50 Next 1): K/V multicast with more K / V stages (a cluster's two CTAs
  # free a stage together, so a third stage may decouple them): d64 (multicast lost 5-6% with two)
  # and d128 (the default from s4k), five rounds; GQA 4 with multicast (pack GQA, an option), three
  # rounds beside the peers; then the grid beside the peers with the v0.50 default.
  timeout 200 python3 tools/sweep_fwd.py --hdim 64,128 --seqlen 4096,8192,16384 --any-pair --causal no --repeat 5 \
    mcp:hd=64,kv_mcast=True,persistent=True,dynamic_sched=False \
    mc3:kv_mcast=True,persistent=True,dynamic_sched=False,num_stages=3 \
    mc4:hd=64,kv_mcast=True,persistent=True,dynamic_sched=False,num_stages=4 > "$out/sweep71.log" 2>&1
  echo "sweep71 rc=$?"; grep -v Warning "$out/sweep71.log" | tail -8
  timeout 120 python3 -m fa4.bench --offgrid --mode fwd --rounds 3 --cases gqa-d128-s4k \
    --variant "fwd.kv_mcast=True fwd.dynamic_sched=False" > "$out/next71gqa.log" 2>&1
  echo "next71gqa rc=$?"; grep -v Warning "$out/next71gqa.log" | tail -8
  timeout 200 python3 -m fa4.bench --mode fwd --causal both --repeats 3 --out "$out/next71bench" \
    > "$out/next71bench.log" 2>&1
  echo "next71bench rc=$?"; grep -E "^# (gpu|bf16|fwd)" "$out/next71bench.log"; tail -16 "$out/next71bench.log"
fi
if has next69; then
  # Session 48 (RESULTS v0.49 Next 0-1): K/V multicast, the d128 default from s_k 8192 (plain grid).
  # Its tests on both grids (the persistent pairs are new), then five rounds of the non-causal rows:
  # the default, multicast on the persistent grid, and the persistent grid without it, d64 / d128 /
  # d256 at s1k-s16k (the sanitizer with its three multicast cases: the step ``sanitize``).
  gpu_tests next69 240 tests/test_fwd_sm90_gpu.py -k "kv_multicast or cluster_pairs"
  timeout 300 python3 tools/sweep_fwd.py --hdim 64,128,256 --seqlen 1024,4096,8192,16384 --causal no --repeat 5 \
    mcp:persistent=True,dynamic_sched=False,kv_mcast=True pers:persistent=True,kv_mcast=False \
    > "$out/sweep69.log" 2>&1
  echo "sweep69 rc=$?"; grep -v Warning "$out/sweep69.log" | tail -14
fi
if has next67; then
  # Session 47's plan for the next lease, in order of worth, in one call (steps of one call run in
  # file order, which would put the tests first): next66's sweep (each round's table printed as it
  # ends, so a cut run keeps its rounds), the sum_chains / scale_emu GPU test, then next65's grid.
  bash "$0" nocompile,next66
  PYTESTS=tests/test_fwd_sm90_gpu.py PYTESTS_K=row_sum_and_scale PYTESTS_TIMEOUT=150 bash "$0" nocompile,pytests
  bash "$0" nocompile,next65
fi
if has next66; then
  # Session 47: the row sum's chain count (sum_chains) moves where ptxas puts the wait for P V
  # among the exponentials (d64: 32 of 66 FFMAs before it by default, 66 with 8 chains; flash-attn-4
  # 66). Five interleaved rounds at d64 / d128, causal and not; at d64 (MUFU-bound on paper: 66
  # MUFU.EX2 a thread a block, 8 cycles each, against the tensor cores' 1536) also exp2 emulation
  # of 1/16 of the columns (v0.5 measured 1/10 on an older d64 kernel only) and the two row scales'
  # exp2 emulated (scale_emu: 64 MUFU instead of 66, 15 more instructions), alone and together.
  timeout 300 python3 tools/sweep_fwd.py --hdim 64,128 --seqlen 8192,16384 --repeat 5 \
    sc8:sum_chains=8 se:scale_emu=True,hd=64 sc8se:sum_chains=8,scale_emu=True,hd=64 e16:exp2_emu_frac=0.0625,hd=64 \
    e16se:exp2_emu_frac=0.0625,scale_emu=True,hd=64 sc8e16se:sum_chains=8,exp2_emu_frac=0.0625,scale_emu=True,hd=64 \
    > "$out/sweep66.log" 2>&1
  echo "sweep66 rc=$?"; grep -v Warning "$out/sweep66.log" | tail -16
fi
if has next65; then
  # v0.47's Next 0: the grid forward and backward beside the peers, three round-robin repeats, with the
  # bar per row (fa4/bar) and its count per direction; on an H200 where one comes (issues 7 / 8's bars
  # are stated there). Then next64's DRAM / L2 counters if the time allows (run it as its own call).
  timeout 420 python3 -m fa4.bench --mode both --causal both --repeats 3 --out "$out/next65bench" \
    > "$out/next65bench.log" 2>&1
  echo "next65bench rc=$?"; grep -E "^# (gpu|bf16|fwd|bwd)" "$out/next65bench.log"; tail -26 "$out/next65bench.log"
fi
if has next64; then
  # Session 46: why fa4 runs at a lower clock than flash-attn-4 at the power cap (next63): the DRAM, L2
  # and shared-memory traffic of the d128 s16k forward of each (ncu, base clock); then ping-pong and the
  # plain grid at d128 without a mask (three interleaved rounds); then --latency.
  for impl in fa4 peer; do
    timeout 120 ncu --clock-control base --kernel-name regex:'(?i)(fwd|forward)' --launch-skip 2 --launch-count 1 \
      --metrics gpu__time_duration.sum,gpc__cycles_elapsed.max,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,lts__t_bytes.sum,smsp__inst_executed.sum \
      python3 tools/ncu_fwd.py $impl 128,16384,0 > "$out/ncu64_$impl.txt" 2>&1
    echo "ncu64 $impl rc=$?"; grep -E "duration|cycles|dram|lts|inst|shared" "$out/ncu64_$impl.txt" | cut -c1-140 | head -12
  done
  timeout 200 python3 tools/sweep_fwd.py --hdim 128 --seqlen 8192,16384 --causal no --repeat 3 \
    pp:pingpong=True pps:pingpong=True,pp_steps_only=True np:persistent=False,dynamic_sched=False > "$out/sweep64.log" 2>&1
  echo "sweep64 rc=$?"; grep -v Warning "$out/sweep64.log" | tail -12
  timeout 90 python3 -m fa4.bench --latency --out "$out/lat64" > "$out/lat64.log" 2>&1
  echo "lat64 rc=$?"; tail -5 "$out/lat64.log"
fi
if has next63; then
  # Session 46: is the forward's gap to flash-attn-4 without a mask (d128 s8k / s16k, d64) in the loop's
  # cycles or in the clocks? SM clock and power sampled beside do_bench of each (tools/clocks_fwd.py),
  # then ncu at the base clock (cycles at one fixed clock) of the d128 s8k launch of each.
  nvidia-smi -i 0 --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > "$out/smi63.csv" &
  smipid=$!
  timeout 240 python3 tools/clocks_fwd.py "$out/smi63.csv" 128,8192,0 128,16384,0 64,8192,0 > "$out/clocks63.log" 2>&1
  echo "clocks63 rc=$?"; kill $smipid; grep -v Warning "$out/clocks63.log" | tail -20
  for impl in fa4 peer; do
    timeout 120 ncu --clock-control base --kernel-name regex:'(?i)(fwd|forward)' --launch-skip 2 --launch-count 1 \
      --metrics gpu__time_duration.sum,gpc__cycles_elapsed.max,sm__cycles_active.avg,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second \
      python3 tools/ncu_fwd.py $impl 128,8192,0 > "$out/ncu63_$impl.txt" 2>&1
    echo "ncu63 $impl rc=$?"; grep -E "duration|cycles|inst_executed|hmma|per_second" "$out/ncu63_$impl.txt" | cut -c1-140 | head
  done
fi
if has next62; then
  # Session 45's Next 0 / 2: the sanitizer with the d64 window case (the folded local default), then
  # the standard grid beside the peers with the round-robin repeats (fa4.bench --repeats), forward
  # and backward; on an H200 where one comes (issue 7 / 8's bars are stated there).
  sanitize_run sanitize62 150 tools/sanitize_sm90.py
  timeout 420 python3 -m fa4.bench --mode both --causal both --repeats 3 --out "$out/next62bench" \
    > "$out/next62bench.log" 2>&1
  echo "next62bench rc=$?"; tail -30 "$out/next62bench.log"
fi
if has next61; then
  # Session 45: the edges-first order's error against the descending order's and flash-attn-4's (the
  # window tests of the sm90 forward file), then the forward grid beside the peers, three repeats.
  timeout 200 python3 -m pytest -m gpu -p no:cacheprovider $xd -q -rfE -k local_error tests/test_fwd_sm90_gpu.py \
    > "$out/next61t.log" 2>&1
  echo "next61t rc=$?"; grep -E "passed|failed|FAILED|ERROR|flash-attn-4 not" "$out/next61t.log" | cut -c1-300 | tail -12
  timeout 300 python3 -m fa4.bench --mode fwd --causal both --repeats 3 --out "$out/next61bench" > "$out/next61bench.log" 2>&1
  echo "next61bench rc=$?"; tail -45 "$out/next61bench.log"
fi
if has next60; then
  # v0.45's Next 1: why the d128 window fold loses 2.5-4.6% (the window row (1024, 0) s8k): ncu of the
  # default (separate loops, edges first) and the fold, the third launch of each.
  for impl in fa4 fa4:fold_first=True; do
    tag=${impl//[:=,]/_}
    timeout 150 ncu --clock-control none --kernel-name regex:'(?i)(fwd|forward)' --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section InstructionStats --section SchedulerStats \
      --metrics smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
      python3 tools/ncu_fwd.py $impl 128,8192,0,1024 > "$out/ncu60_$tag.txt" 2>&1
    echo "ncu60 $impl rc=$?"; grep -E "Duration|SM Busy|Issue Slots|Executed Ipc|Stall|Eligible|Registers|hmma|inst_executed" \
      "$out/ncu60_$tag.txt" | cut -c1-140 | head -30
  done
fi
if has next59q; then
  # ... the window row at d128 alone (the fold with edges first, one_step_loop, the default), three
  # rounds: next59 and this in one call where device time is short.
  logged next59qw 150 30 python3 tools/sweep_fwd.py --hdim 128 --seqlen 8192 --causal no --window 1024 \
    --any-pair --repeat 3 fold:fold_first=True osl:one_step_loop=True
fi
if has next59r; then
  # ... then the window rows (d64 / d128 / d256 s8k, (1024, 0)): the separate loops (the default,
  # edges first), the fold (prediction: within 1% now that the free loop keeps Q's descriptors and
  # holds the separate form's instructions, +5 at d128) and one_step_loop, three rounds; the causal
  # rows, the fold (the default) against the separate first block, five rounds (prediction: within
  # 1%, as main's fold was); the local fold's compile times (this CPU: -30% to -35%).
  logged next59rw 260 30 python3 tools/sweep_fwd.py --hdim 64,128,256 --seqlen 8192 --causal no --window 1024 \
    --any-pair --repeat 3 fold:fold_first=True osl:one_step_loop=True
  logged next59rc 200 30 python3 tools/sweep_fwd.py --hdim 64,128,256 --seqlen 8192 --causal yes --any-pair \
    --repeat 5 sep:fold_first=False
  logged next59rt 100 20 python3 tools/compile_time.py --ab fold_first --reps 1 --local
fi
if has next59c; then
  # ... more rounds where next59r's ranges overlap: the causal rows nine rounds, the interleaved
  # compile times with and without the fold (sm90 causal, then sm80 causal).
  logged next59cc 300 30 python3 tools/sweep_fwd.py --hdim 64,128,256 --seqlen 8192 --causal yes --any-pair \
    --repeat 9 sep:fold_first=False
  logged next59ct 150 20 python3 tools/compile_time.py --ab fold_first --reps 3
  logged next59c8 150 20 python3 tools/compile_time.py --ab fold_first --reps 3 --family sm80
fi
if has next58; then
  # Issue 7's compile bar for sliding windows (d64 / d128 / d192 / d256 local 2.3 / 3.1 / 4.2 / 4.5 s on
  # the H100 host, one_step_loop 1.5 / 1.9 / 2.4 / 3.1, fold_first 1.9 / 2.6 / 3.5 / 4.4): both
  # against the separate loops on the window rows, five interleaved rounds (one_step_loop at d192 is
  # the default already; v0.36: d256 local -1.9%; d128 / d64 local never timed).
  logged next58w 400 30 python3 tools/sweep_fwd.py --hdim 64,128,256 --seqlen 8192 --causal no --window 1024 \
    --any-pair --repeat 5 osl:one_step_loop=True fold:fold_first=True
fi
if has next56b; then
  # ... and again with more rounds (next56's five read -2.2% to +2.4%, within the rows' spread; the
  # folded kernel's free loop holds 24 more uniform-datapath instructions at d128: ptxas rebuilds Q's
  # descriptors there), and the compile times as interleaved medians on this host. (Since the causal
  # default folds, the sweeps' variant is the separate first block, "sep"; the window row's default
  # is separate, so there "sep" equals the default: run it with fold:fold_first=True for that row.)
  logged next56bc 300 30 python3 tools/sweep_fwd.py --hdim 64,128,256 --seqlen 8192 --causal yes --any-pair \
    --repeat 9 sep:fold_first=False
  logged next56bl 150 20 python3 tools/sweep_fwd.py --hdim 128 --seqlen 8192 --causal no --window 1024 --any-pair \
    --repeat 5 fold:fold_first=True
  logged next56bct 150 20 python3 tools/compile_time.py --ab fold_first --reps 3
fi
if has next55; then
  # Issue 7's compile bar through one_step_loop at d64 / d128 causal (2.40 -> 1.68 s at d128 causal on
  # the H200 host, v0.37): its cost on the standard causal rows, seven interleaved rounds (v0.36 on an
  # H100: +0.8 / -2.5% at d128, -0.7 / -2.7% at d64; the default changes if within 1% on every row),
  # then the cold compile times with d64's one_step_loop beside.
  logged next55osl 420 30 python3 tools/sweep_fwd.py --hdim 64,128 --seqlen 4096,8192 --causal yes --any-pair \
    --repeat 7 osl:one_step_loop=True
  logged next55ct 150 40 python3 tools/compile_time.py
fi
if has next51b; then
  # ... and its timings, three rounds each (about 8 min): Qwen2.5-7B's g = 7 varlen causal row with
  # partial boxes / row copies / unpacked (the default; prediction: partial boxes +3-6% over
  # unpacked, as g = 4's whole boxes); g = 8 (the TMA path takes it, the default does not:
  # PACK_WHOLE_ROWS_MAX_GROUP = 4; prediction: within 2% dense, +3-6% varlen); MQA (g = 16) again.
  logged next51g7 240 30 python3 -m fa4.bench --offgrid --mode fwd --rounds 3 --cases varlen-gqa7-d128-causal \
    --variant "fwd.qhead_per_kvhead=7 fwd.pack_tma_partial=True" --variant "fwd.qhead_per_kvhead=7"
  logged next51g8 200 40 python3 -m fa4.bench --offgrid --mode fwd --rounds 3 \
    --cases gqa8-d128-s4k-causal,varlen-gqa8-d128-causal --variant "fwd.qhead_per_kvhead=8"
  logged next51m 120 20 python3 -m fa4.bench --offgrid --mode fwd --rounds 3 \
    --cases mqa-d128-s8k-causal --variant "fwd.qhead_per_kvhead=16"
fi
if has next42t; then
  # wip/sm80-loose-plan (session 40, merged after these ran on an H200): the sm80 forward judges a varlen side without max_seqlen
  # on the average length; both families' config and launch judge the split count alike. Its tests.
  gpu_tests next42t 400 tests/test_fwd_sm80_gpu.py -k "without_lengths" || exit 1
  gpu_tests next42t2 400 tests/test_fwd_sm90_gpu.py tests/test_fwd_splitkv_gpu.py -k "loose or split or nomax" || exit 1
fi
if has next42; then
  # ... and the sm80 decode and varlen rows with and without the lengths (prediction: the same time
  # each; main's sm80 decode without them about 1.9x, as sm90's was before v0.38).
  logged next42 240 30 python3 -m fa4.bench --offgrid --mode fwd --rounds 2 --arch sm80 \
    --cases varlen-decode,varlen-decode-nomax,varlen-gqa-d128-causal,varlen-gqa-d128-causal-nomax
fi
if has next47q; then
  # next47s cut down for a short lease: the two varlen causal rows, two rounds, sections 8 to 64.
  logged next47q 200 20 python3 -m fa4.bench --offgrid --mode bwd --rounds 2 \
    --cases varlen-gqa-d128-causal,varlen-d128-causal \
    --variant "bwd.section=8" --variant "bwd.section=16" --variant "bwd.section=32" --variant "bwd.section=64"
fi
if has next43; then
  # Issue 8's rows on an H200 with three repeats (v0.37 timed the forward's there; the backward's last
  # H200 grid is older): the s8k backward rows side by side, then d128 s16k / s4k.
  timeout 240 python3 -m fa4.bench --mode bwd --hdim 64,128,256 --seqlen 8192 --repeats 3 --out "$out/next43bench" \
    > "$out/next43bench.log" 2>&1
  echo "next43bench rc=$?"; grep -E "^ *[0-9]+ +[0-9]+ +[0-9]+ " "$out/next43bench.log" | tail -14
  timeout 200 python3 -m fa4.bench --mode bwd --hdim 128 --seqlen 4096,16384 --repeats 3 --out "$out/next43b" \
    > "$out/next43b.log" 2>&1
  echo "next43b rc=$?"; grep -E "^ *[0-9]+ +[0-9]+ +[0-9]+ " "$out/next43b.log" | tail -10
fi
if has next44; then
  # Session 38, branch wip/bwd-block-skip with main's fa4 in baseline/ (as next39): the sm90
  # backward narrows each K block's m_blocks to those it is visible to (Note [Block skip in the
  # backward]). Its block-sparse GPU tests, then the block-sparse document lists' backward beside
  # main, three times in turn (prediction: 7.3-7.5 ms -> 2.0-2.4 ms; 27% of the steps remain).
  gpu_tests next44tests 300 tests/test_block_sparse_gpu.py || exit 1
  beside_main next44 3 --mode bwd --rounds 2 --cases mods-blockdoc-d128
  # ... and deterministic (the branch: through the dQ pass, BLOCK_SPARSE_DET_DQ_PASS; main: every block).
  beside_main next44d 2 --mode bwd --rounds 2 --deterministic --cases mods-blockdoc-d128
fi
if has next45; then
  # Session 38, branch wip/dropin: contiguous outputs, the lse in training without return_lse, head
  # dims 8-24 padded to 32, the varlen scheduling knobs, backward-only refusals in the backward,
  # 16-bit combine partials. The API and flash_attn.cute-call GPU tests
  # (the new ones among them), then the fast path's and the autograd path's own files.
  gpu_tests next45tests 360 tests/test_api_gpu.py tests/test_flash_attn_cute_calls_gpu.py tests/test_cuda_graph_gpu.py \
    tests/test_kvcache_gpu.py tests/test_combine_gpu.py tests/test_mods_gpu.py || exit 1
fi
if has next46; then
  # Session 38's lead: the sm80 forward with a user function spills in its K-block loop at d128
  # (128 threads: a 240-byte frame with the table mask; 256 threads: 218 registers, no frame). The
  # user-function rows on the sm80 family, its default against 256 threads, two rounds
  # (prediction: 256 threads faster on these rows if the spills cost).
  logged next46 240 20 python3 -m fa4.bench --offgrid --arch sm80 --mode fwd --rounds 2 \
    --cases mods-docmask-d128,mods-relbias-d128-causal,mods-blockdoc-d128 --variant "fwd.num_threads=256"
fi
if has ctime; then
  # Issue 7 item 7: cold compile times on this host (the H100 host needed more than 70 s for the list, v0.35).
  logged ctime 200 40 python3 tools/compile_time.py
fi
if has latency; then
  timeout 120 python3 -m fa4.bench --latency --out "$out/latency" > "$out/latency.log" 2>&1
  echo "latency rc=$?"; tail -12 "$out/latency.log"
fi

if has sweep; then
  timeout ${SWEEP_TIMEOUT:-300} python3 tools/sweep_bwd.py ${SWEEP:---plan v1} > "$out/sweep.log" 2>&1
  echo "sweep rc=$?"; cat "$out/sweep.log" | grep -v Warning | tail -40
fi
if has ncu; then
  timeout 200 ncu --clock-control none --kernel-name regex:fa4_bwd_sm90 --launch-count 2 \
    --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section LaunchStats python3 tools/ncu_bwd.py ${NCU_SHAPES:-} \
    > "$out/ncu.txt" 2>&1
  echo "ncu rc=$?"; grep -E "fa4_bwd|Duration|Throughput|Pipe|Stall|Issue|Eligible|Active Warps|Registers|L2 Hit|Mem Busy|Max Bandwidth" "$out/ncu.txt" | cut -c1-150 | head -70
fi
if has ncufwd; then
  # fa4 and flash-attn-4 forward side by side (NCU_FWD_SHAPES: d,s,causal ...); the third launch of each.
  for impl in fa4 peer; do
    timeout 150 ncu --clock-control none --kernel-name regex:'(?i)(fwd|forward)' --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats \
      --section LaunchStats --section Occupancy --section SchedulerStats --metrics smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_xu.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_alu.sum \
      python3 tools/ncu_fwd.py $impl ${NCU_FWD_SHAPES:-128,8192,0} > "$out/ncufwd_$impl.txt" 2>&1
    echo "ncufwd $impl rc=$?"; grep -E "Kernel|Duration|SM Busy|Issue Slots|Executed Ipc|Stall|Eligible|Registers|hmma|inst_executed|No Eligible|Theoretical Occ" "$out/ncufwd_$impl.txt" | cut -c1-140 | head -40
  done
fi
if has ncubwd; then
  # fa4 and flash-attn-4 backward main kernels side by side (NCU_BWD_SHAPES: d,s,causal ...; one launch per
  # shape): SM active share of elapsed cycles (the tail), IPC, tensor pipe, instruction mix.
  shapes=(${NCU_BWD_SHAPES:-128,16384,1})
  for impl in fa4 peer; do
    timeout 200 ncu --clock-control none --kernel-name regex:'(?i)bwd_sm90' --launch-count ${#shapes[@]} \
      --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats \
      --section LaunchStats --section Occupancy --section SchedulerStats --section MemoryWorkloadAnalysis \
      --metrics smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_active.avg,sm__cycles_elapsed.avg,smsp__inst_executed_pipe_lsu.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_xu.sum,lts__t_sectors_srcunit_tex_op_red.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum \
      python3 tools/ncu_bwd.py $impl ${NCU_BWD_DET:+det} "${shapes[@]}" > "$out/ncubwd_$impl.txt" 2>&1
    echo "ncubwd $impl rc=$?"; grep -E "bwd_sm90|Duration|SM Busy|Issue Slots|Executed Ipc|Eligible|Registers|hmma|inst_executed|cycles_active|cycles_elapsed|No Eligible|Theoretical Occ|L2 Hit|bank|red.sum|Block Size|Grid Size" "$out/ncubwd_$impl.txt" | cut -c1-140 | head -60
  done
fi
if has sweepfwd; then
  timeout ${SWEEP_TIMEOUT:-300} python3 tools/sweep_fwd.py ${SWEEP_FWD:-} > "$out/sweepfwd.log" 2>&1
  echo "sweepfwd rc=$?"; grep -v Warning "$out/sweepfwd.log" | grep -v "exe_args" | tail -60
fi
if has ncustall; then
  # Stall reasons per issued instruction, fa4 and flash-attn-4 forwards (NCU_FWD_SHAPES as ncufwd).
  for impl in fa4 peer; do
    timeout 150 ncu --clock-control none --kernel-name regex:'(?i)(fwd|forward)' --launch-skip 2 --launch-count 1 \
      --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
      python3 tools/ncu_fwd.py $impl ${NCU_FWD_SHAPES:-128,8192,0} > "$out/ncustall_$impl.txt" 2>&1
    echo "ncustall $impl rc=$?"
  done
  paste <(grep stalled "$out/ncustall_fa4.txt" | awk '{print $1, $NF}') <(grep stalled "$out/ncustall_peer.txt" | awk '{print $NF}') \
    | sed 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | awk '$2 > 0.05 || $3 > 0.05'
fi
if has ncusrc; then
  # Source-level stall sampling of the fa4 and flash-attn-4 forwards (NCU_FWD_SHAPES as ncufwd): the SASS
  # lines where warps wait, for the mainloop gap of RESULTS v0.8. Full reports land in $OUT.
  # NCUSRC_IMPLS: the implementations (default "fa4 peer"; "fa4:field=value,..." overrides config fields).
  csvs=()
  for impl in ${NCUSRC_IMPLS:-fa4 peer}; do
    tag=$(echo "$impl" | tr -c 'A-Za-z0-9_\n' '_')
    timeout 200 ncu --clock-control none --kernel-name regex:'(?i)(fwd|forward)' --launch-skip 2 --launch-count 1 \
      --section SourceCounters --section WarpStateStats --export "$out/ncusrc_$tag" \
      python3 tools/ncu_fwd.py $impl ${NCU_FWD_SHAPES:-128,8192,0} > "$out/ncusrc_$tag.txt" 2>&1
    echo "ncusrc $impl rc=$?"; grep -iE "stall|sampl" "$out/ncusrc_$tag.txt" | cut -c1-150 | head -20
    ncu --import "$out/ncusrc_$tag.ncu-rep" --page source --csv --print-source sass > "$out/ncusrc_${tag}_sass.csv" 2>/dev/null
    csvs+=("$out/ncusrc_${tag}_sass.csv")
  done
  python3 tools/ncu_src_top.py "${csvs[@]}" --top 20 2>&1 | cut -c1-150
fi
if has ncusrcbwd; then
  # The same for the backward main kernels, fa4 and flash-attn-4 (NCU_BWD_SHAPE, default d128 s8k;
  # NCU_BWD_DET=1: deterministic; NCU_BWD_IMPLS: two of fa4, peer, fa4-up, default "fa4 peer"). The
  # reports are removed once exported (too many files come back).
  impls=(${NCU_BWD_IMPLS:-fa4 peer})
  for impl in "${impls[@]}"; do
    timeout 200 ncu --clock-control none --kernel-name regex:'(?i)bwd_sm90' --launch-count 1 \
      --section SourceCounters --section WarpStateStats --export "$out/ncusrcbwd_$impl" \
      python3 tools/ncu_bwd.py ${impl/-/ } ${NCU_BWD_DET:+det} ${NCU_BWD_SHAPE:-128,8192,0} > "$out/ncusrcbwd_$impl.txt" 2>&1
    echo "ncusrcbwd $impl rc=$?"; grep -E "Kernel|Duration|==PROF==|rror" "$out/ncusrcbwd_$impl.txt" | cut -c1-150 | head -8
    ncu --import "$out/ncusrcbwd_$impl.ncu-rep" --page source --csv --print-source sass > "$out/ncusrcbwd_${impl}_sass.csv" 2>/dev/null
  done
  python3 tools/ncu_src_top.py "$out/ncusrcbwd_${impls[0]}_sass.csv" "$out/ncusrcbwd_${impls[1]}_sass.csv" --top 20 2>&1 | cut -c1-150
  rm -f "$out"/ncusrcbwd_*.ncu-rep
fi
if has next8; then
  # Written in session 8, not yet run (RESULTS v0.10, "Next"): lse ahead of the wgmmas with the d64
  # default's 128-row steps (bit identity, then its timing), and where the deterministic d128 backward waits.
  timeout 200 python3 -m pytest -m gpu -p no:cacheprovider $xd -q -rfE \
    "tests/test_bwd_gpu.py::test_bwd_sm90_stats_early_same_bits" > "$out/next8.log" 2>&1
  echo "next8 tests rc=$?"; grep -E "passed|failed|FAILED|ERROR" "$out/next8.log" | tail -10
  timeout 300 python3 tools/sweep_bwd.py --plan v13 > "$out/next8_v13.log" 2>&1
  echo "next8 v13 rc=$?"; grep -v Warning "$out/next8_v13.log" | grep -v exe_args | tail -26
  OUT="$out/det" NCU_BWD_DET=1 bash "$0" ncusrcbwd,nocompile
fi
if has next9; then
  # Session 9: the writer's slots from 32 lanes (Note [Writer slots]): same bits, the deterministic
  # tests, then the A/B sweep (v14), which runs only when the tests pass.
  gpu_tests next9 330 tests/test_bwd_gpu.py -k "lane_slots or deterministic or rotated or ordered_direct" &&
    logged next9_v14 300 40 python3 tools/sweep_bwd.py --plan v14
fi
if has next10; then
  # Session 9, second run: the rotated order with stagger 1 (the publish-lag cycle, fixed), then at d64 (v15).
  gpu_tests next10 200 tests/test_bwd_gpu.py -k "stagger_one or lane_slots or rotated" &&
    logged next10_v15 240 22 python3 tools/sweep_bwd.py --plan v15
fi
if has next11; then
  # Session 9, third run: d64 deterministic rotates (TUNING); its deterministic tests, then the det bench.
  gpu_tests next11 240 tests/test_bwd_gpu.py -k "deterministic or rotated or lane_slots or stagger_one" &&
    logged det64 150 8 python3 -m fa4.bench --mode bwd --deterministic --hdim 64 --out "$out/det64"
fi
if has next13; then
  # Written in session 9, run in session 10: ping-pong with the turns around the K-block steps only (the
  # peer's placement, FwdSm90Config.pp_steps_only): the GPU tests, then fa4-only timing, 3 rounds.
  gpu_tests next13 200 tests/test_fwd_sm90_gpu.py -k "pp_steps_only" &&
    logged next13_sweep 330 20 python3 tools/sweep_fwd.py --hdim 64,128 --repeat 3 pp:hd=128,pingpong=True \
      ppso:hd=128,pingpong=True,pp_steps_only=True pp3so:hd=64,pingpong=True,pp_steps_only=True
fi
if has next14; then
  # Written in session 9, run in session 10: where the causal deterministic d128 backward waits (ncu), then
  # its launch sections and lane slots (sweep v16).
  OUT="$out/detc" NCU_BWD_DET=1 NCU_BWD_SHAPE=128,8192,1 bash "$0" ncusrcbwd,nocompile
  logged next14_v16 300 30 python3 tools/sweep_bwd.py --plan v16
fi
if has v012b; then
  # Session 10: the new defaults timed side by side (d64 forward ping-pong around the steps; causal
  # deterministic sections of 16 pairs) and the decode table with flash-attn-4 on the paged cache.
  logged v012_fwd64 200 8 python3 -m fa4.bench --mode fwd --hdim 64 --out "$out/fwd64"
  logged v012_det128 300 10 python3 -m fa4.bench --mode bwd --deterministic --hdim 128 --out "$out/det128"
  logged v012_det64 150 6 python3 -m fa4.bench --mode bwd --deterministic --hdim 64 --out "$out/det64"
  logged v012_decode 200 8 python3 -m fa4.bench --decode --out "$out/decode"
fi
if has next15; then
  # Written in session 10 (the tests and a 4-row timing ran there, the sweep not): the up order of the
  # deterministic backward (DET_UP; Note [Up order]): its GPU tests (a hang fails them through the
  # watchdog), then sweep v20.
  gpu_tests next15 240 tests/test_bwd_gpu.py -k "up_order" &&
    logged next15_v20 300 30 python3 tools/sweep_bwd.py --plan v20
fi
if has next17; then
  # Written in session 10, not yet run: dV issued after dS^T (dv_late) with dS from the float32 P at
  # d64, and step_cursor: the experiment tests, sweep v21, then dv_late's accuracy against the
  # default and flash-attn-4.
  gpu_tests next17 240 tests/test_bwd_gpu.py -k "experiments or step_cursor" &&
    logged next17_v21 300 40 python3 tools/sweep_bwd.py --plan v21 &&
    logged next17_acc 200 12 python3 tools/bwd_accuracy.py "d64" "d64 ds_from_p16=False dv_late=True" "d64 peer" \
      "d64 causal" "d64 causal ds_from_p16=False dv_late=True" "d64 causal peer"
fi
if has next18; then
  # Session 11: the dQ writer's peeked slot (publish_peek, Note [Publish peek]): its same-bits tests
  # (lag / no lag / peek; rotated with stagger 1, local), then sweep v24.
  gpu_tests next18 200 tests/test_bwd_gpu.py -k "publish_lag_same_bits or publish_peek_same_bits" &&
    logged next18_v24 200 40 python3 tools/sweep_bwd.py --plan v24
fi
if has next20; then
  # Session 12: the peeked slot as the deterministic writer's default (PUBLISH_PEEK): its same-bits
  # tests against the lag and no lag, the deterministic suite, the det bench, then sweep v25.
  gpu_tests next20 200 tests/test_bwd_gpu.py -k "publish_lag_same_bits or publish_peek_same_bits" &&
    gpu_tests next20_det 200 tests/test_bwd_gpu.py -k "(deterministic and sm90) or rotated" &&
    logged next20_bench 300 24 python3 -m fa4.bench --mode bwd --deterministic --hdim 128,64 --out "$out/det" &&
    logged next20_v25 300 50 python3 tools/sweep_bwd.py --plan v25
fi
if has next22; then
  # Session 12, final code: sweep v27 (causal deterministic sections with the peek default), a second
  # det bench.
  logged next22_v27 200 40 python3 tools/sweep_bwd.py --plan v27
  logged next22_det 300 14 python3 -m fa4.bench --mode bwd --deterministic --hdim 128,64 --out "$out/det2"
fi
if has next16; then
  # Written in session 10, not yet run: where the up order (DET_UP, 15-29% slower) loses against the
  # down order, causal deterministic d128 s8k (ncu source counters of both).
  OUT="$out/up" NCU_BWD_IMPLS="fa4 fa4-up" NCU_BWD_DET=1 NCU_BWD_SHAPE=128,8192,1 bash "$0" ncusrcbwd,nocompile
fi
if has firststore; then
  # Session 17: the first store of each dq_accum slot (Note [First store], no zeroed accumulator):
  # its tests, then where the backward's time goes (tools/bwd_profile.py), fa4 against the peers.
  gpu_tests firststore 300 tests/test_bwd_gpu.py -k "first_store" &&
    logged firststore_prof 240 40 python3 tools/bwd_profile.py
fi
if has claims; then
  # Session 18: the non-deterministic first store's relaxed claim, rotated without a mask (CLAIM_ROTATE):
  # its tests, then the backward profile with fa4-claims / fa4-claims-plain (tools/bwd_profile.py --claims).
  gpu_tests claims 300 tests/test_bwd_gpu.py -k "first_store" &&
    logged claims_prof 300 60 python3 tools/bwd_profile.py --claims ${CLAIMS_ROWS:-128,1024,1 128,1024,0 128,4096,1 128,16384,0 64,8192,0}
fi
if has bwdprof; then
  # Session 22: a backward call's time: bench, device span, host time per call, kernels (BWDPROF_ROWS).
  logged bwdprof 300 60 python3 tools/bwd_profile.py ${BWDPROF_ROWS:-128,1024,0 128,1024,1 128,4096,1 64,8192,0}
fi
if has hostprof; then
  # Session 22: the host's time per call and its cProfile (tools/host_profile.py $HOSTPROF_ARGS).
  logged hostprof 200 200 python3 tools/host_profile.py ${HOSTPROF_ARGS:-bwd 128,1024,1}
fi
if has next25; then
  # Written in session 24 for the next lease (RESULTS v0.25 Next 0): the review's edits of the emulation
  # tests and default rule, then sweep plan v57 (d64 without a mask at 1/16 and 1/8 emulated, five rounds).
  gpu_tests next25 300 tests/test_bwd_gpu.py -k "exp2_emulation or head_dim_32 or head_dim_v or two_cta"
  logged next25sweep 300 40 python3 tools/sweep_bwd.py --plan v57
fi
if has offgrid; then
  # Session 25: fa4 against flash-attn-4 / cuDNN off the standard grid (tools/offgrid.py $OFFGRID_ARGS),
  # then the deterministic backward on the varlen / GQA cases.
  logged offgrid 300 40 python3 -m fa4.bench --offgrid ${OFFGRID_ARGS:-}
  logged offgriddet 200 20 python3 -m fa4.bench --offgrid --mode bwd --deterministic \
    --cases varlen-d128-causal,varlen-gqa-d128-causal,gqa-d128-s4k-causal,d128-s2k-causal
fi
if has next26; then
  # Session 25: the split GQA group (Note [Split GQA group]): its GPU tests and the covering array's
  # MQA rows, sweep v58, then the off-grid GQA / MQA rows side by side.
  gpu_tests next26 240 tests/test_bwd_gpu.py -k "kv_split or mqa"
  logged next26sweep 240 50 python3 tools/sweep_bwd.py --plan v58
  logged next26offgrid 150 20 python3 -m fa4.bench --offgrid --mode bwd \
    --cases mqa-d128-s8k-causal,gqa-d128-s4k-causal,gqa-d128-s4k,varlen-gqa-d128-causal,prefill-cache-d128
fi
if has next27; then
  # Written in session 25 for the next lease (RESULTS v0.26 Next 0-2), in two calls (each under 10
  # minutes): next27 = the forward suites under the new pack rule and the split's new tests (sm90
  # deterministic, sm80 forced, batch invariance with MQA); next27b = the timings.
  gpu_tests next27fwd 300 tests/test_fwd_sm90_gpu.py tests/test_fwd_splitkv_gpu.py tests/test_flash_attn_cute_calls_gpu.py
  gpu_tests next27bwd 240 tests/test_bwd_gpu.py -k "kv_split or batch_invariant"
fi
if has next27b; then
  logged next27offgrid 200 20 python3 -m fa4.bench --offgrid --cases varlen-gqa-d128-causal,gqa-d128-s4k-causal,varlen-d128
  logged next27sweep 240 30 python3 tools/sweep_bwd.py --plan v59
  logged next27sweep80 240 20 python3 tools/sweep_bwd.py --family sm80 --plan v60
  # The varlen forward rows on the dynamic grid (claims balance sequences of different lengths).
  for dyn in False True; do
    logged next27varlen_$dyn 120 8 python3 -m fa4.bench --offgrid --mode fwd --set fwd.dynamic_sched=$dyn \
      --cases varlen-d128,varlen-d128-causal,varlen-d64-causal,varlen-gqa-d128-causal
  done
fi
if has next28; then
  # Written in session 26 for the next lease (RESULTS v0.27 Next 0): the forward tests under the new
  # grid rules (ragged rows on the dynamic grid; masked varlen rows with one-pair sections).
  # (All of the three files: paged decode with seqused_k also takes the dynamic grid past s_k 1024.)
  gpu_tests next28fwd 330 tests/test_fwd_sm90_gpu.py tests/test_flash_attn_cute_calls_gpu.py tests/test_fwd_splitkv_gpu.py
  # The split's partials now summed by a fixed add tree (common.sum_partials), bwd_kv_split checked early.
  gpu_tests next28bwd 240 tests/test_bwd_gpu.py tests/test_api_gpu.py -k "kv_split or batch_invariant or MQA or mqa or option"
fi
if has next28b; then
  # ... and the timings (tools/offgrid.py --variant, interleaved rounds in one process): the v0.27 rules
  # confirmed against their alternatives; the backward's launch sections on varlen rows; the GQA s4k
  # forward's sections (one lease read 16 MB 610, one pair 581-587, 64 MB 560 / 655).
  logged next28fwd_sections 200 30 python3 -m fa4.bench --offgrid --mode fwd --rounds 3 \
    --cases varlen-d128-causal,varlen-gqa-d128-causal,varlen-d64-causal,gqa-d128-s4k-causal \
    --variant "fwd.l2_section_mb=16" --variant "fwd.l2_section_mb=0" --variant "fwd.l2_section_mb=32"
  logged next28fwd_dynamic 120 10 python3 -m fa4.bench --offgrid --mode fwd --rounds 3 --cases varlen-d128,varlen-d64 \
    --variant "fwd.dynamic_sched=False"
  # Claims past empty varlen tiles (Note [Skipped claims]): prediction +1-4% on the varlen rows.
  logged next28fwd_skip 150 12 python3 -m fa4.bench --offgrid --mode fwd --rounds 3 \
    --cases varlen-d128,varlen-d128-causal,varlen-gqa-d128-causal,varlen-d64-causal --variant "fwd.skip_empty=True"
fi
if has next28c; then
  logged next28bwd_sections 240 20 python3 -m fa4.bench --offgrid --mode bwd --rounds 2 \
    --cases varlen-d64-causal,varlen-d128-causal,varlen-gqa-d128-causal \
    --variant "bwd.section=1" --variant "bwd.section=4" --variant "bwd.section=64"
  # Decode: the tile's K rows, stages and grid (tools/decode_sweep.py --grid; issue 9's b64 tie).
  logged next28decode 240 20 python3 tools/decode_sweep.py --grid
fi
if has next29; then
  # Session 27 (RESULTS v0.28): the decode tiles' grid (64-row K blocks, one CTA per tile), the sm80
  # family's deterministic bwd_kv_split, the backward's compact varlen grid: tests, then timings.
  has skipfwd || gpu_tests next29fwd 200 tests/test_fwd_splitkv_gpu.py tests/test_flash_attn_cute_calls_gpu.py \
    tests/test_fwd_sm90_gpu.py -k "splitkv or cute or s1x or varlen or paged or decode" || exit 1
  gpu_tests next29bwd 150 tests/test_bwd_gpu.py -k "kv_split_option or compact_grid or empty_tiles_varlen" || exit 1
  logged next29compact 150 12 python3 -m fa4.bench --offgrid --mode bwd --rounds 2 \
    --cases varlen-d64-causal,varlen-d128-causal,varlen-gqa-d128-causal,varlen-d128 --variant "bwd.compact_grid=True"
  logged next29decode 100 12 python3 tools/decode_sweep.py --grid
  logged next29bench 100 12 python3 -m fa4.bench --decode
fi
if has next30; then
  # Sessions 27-28's work for the next lease (RESULTS v0.29 Next), tests: the decode rule's last form
  # (v0.29: every decode tile one CTA per tile, 64-row blocks without seqused_k / paging) under the
  # paged bit-for-bit tests, the paged CUDA-graph replays and the split suite (with the decode tile's
  # accuracy test), the forward's compact varlen grid ...
  gpu_tests next30fwd 300 tests/test_fwd_splitkv_gpu.py tests/test_flash_attn_cute_calls_gpu.py \
    "tests/test_fwd_sm90_gpu.py::test_compact_grid" "tests/test_fwd_sm90_gpu.py::test_loose_bound_rule" \
    tests/test_cuda_graph_gpu.py -k "not graph or paged" || exit 1
fi
if has next30m; then
  # Session 29: score_mod / mask_mod in the sm90 forward (fa4/mods.py), never run on a GPU yet.
  gpu_tests next30mods 300 tests/test_mods_gpu.py || exit 1
  logged next30modsbench 240 24 python3 -m fa4.bench --offgrid --mode fwd,bwd --rounds 2 \
    --cases mods-alibi-d128,mods-docmask-d128,mods-relbias-d128-causal
fi
if has next31; then
  # Session 30: every user-function GPU test (session 29's, aux_scalars) and block sparsity, never run yet.
  gpu_tests next31mods 360 tests/test_mods_gpu.py tests/test_block_sparse_gpu.py || exit 1
fi
if has sanitizebs; then
  # Session 30: block sparsity's skip path in the sm90 forward under racecheck and memcheck.
  sanitize_run sanitizebs 200 tools/sanitize_bsparse.py
fi
if has next31b; then
  # The document mask with its block lists: the sm90 forward skipping blocks, and not (block_skip=()).
  logged next31bsparse 200 12 python3 -m fa4.bench --offgrid --mode fwd --rounds 2 \
    --cases mods-blockdoc-d128,mods-docmask-d128 --variant "fwd.block_skip=()"
  logged next31modsbench 240 24 python3 -m fa4.bench --offgrid --mode fwd,bwd --rounds 2 \
    --cases mods-alibi-d128,mods-docmask-d128,mods-relbias-d128-causal
fi
if has next30v; then
  # ... and the whole varlen backward suite with the compact grid on by default (this copy only).
  sed -i 's/^COMPACT_VARLEN = False/COMPACT_VARLEN = True/' fa4/bwd/sm90.py
  gpu_tests next30bwd 300 tests/test_bwd_gpu.py tests/test_api_gpu.py -k "varlen or compact or seqused"
  rc=$?; sed -i 's/^COMPACT_VARLEN = True/COMPACT_VARLEN = False/' fa4/bwd/sm90.py; [ $rc = 0 ] || exit 1
fi
if has next30b; then
  # ... timings: the backward's compact grid over three rounds; the varlen forward on one tile per CTA,
  # plain and compact, against the dynamic persistent grid (flash-attn-4 runs one tile per CTA on a
  # compact varlen grid).
  logged next30compact 200 16 python3 -m fa4.bench --offgrid --mode bwd --rounds 3 \
    --cases varlen-d64-causal,varlen-d128-causal,varlen-gqa-d128-causal,varlen-d128 --variant "bwd.compact_grid=True"
  logged next30fwd_grid 240 20 python3 -m fa4.bench --offgrid --mode fwd --rounds 3 \
    --cases varlen-d64,varlen-d128,varlen-d64-causal,varlen-gqa-d128-causal \
    --variant "fwd.persistent=False fwd.dynamic_sched=False" \
    --variant "fwd.persistent=False fwd.dynamic_sched=False fwd.compact_grid=True" \
    --variant "fwd.num_stages=2"  # the default's own config under a variant's label: an A/A control (v0.28)
  # flash-attn-4 packs the GQA rows of its varlen forward (one tile per CTA, compact): the same here.
  logged next30fwd_gqa 150 10 python3 -m fa4.bench --offgrid --mode fwd --rounds 3 --cases varlen-gqa-d128-causal \
    --variant "fwd.persistent=False fwd.dynamic_sched=False fwd.compact_grid=True fwd.qhead_per_kvhead=4" \
    --variant "fwd.persistent=False fwd.dynamic_sched=False fwd.compact_grid=True"
fi
if has next30c; then
  # v0.29's decode rule (seqused_k / paged calls one CTA per tile with the table's blocks), then the
  # issue's decode bench with its copy bandwidth.
  logged next30decode 150 20 python3 tools/decode_sweep.py --grid
  logged next30decbench 150 12 python3 -m fa4.bench --decode
  # Issue 7's compile bar is on this host: v0.29's first-call path (no host engine), one process.
  logged next30ctime 150 26 python3 tools/compile_time.py
fi
if has next30d; then
  # v0.29, issue 7's compile time: one step body (one_step_loop, -20-26% compile at d256 causal) costs
  # 0-5% on the GPU by v0.9's sweep (d256 causal 0%); the kernel has changed since. Three rounds at
  # the head dims whose causal / local compile is over 2 s.
  logged next30osl 240 40 python3 tools/sweep_fwd.py --hdim 192,256 --seqlen 1024,4096,8192 --causal yes --any-pair \
    --repeat 3 osl:one_step_loop=True
  logged next30osl128 150 20 python3 tools/sweep_fwd.py --hdim 128 --seqlen 4096,8192 --causal yes --repeat 3 \
    osl:one_step_loop=True
  # Sliding windows: three loops by default (local d256: 3.7 s to compile on the CPU, 2.1 s with one body).
  logged next30osl_local 190 20 python3 tools/sweep_fwd.py --hdim 128,256 --seqlen 4096,8192 --window 1024 --any-pair \
    --repeat 3 osl:one_step_loop=True
fi
if has next30e; then
  # v0.29: flash_attn.cute-style varlen calls without max_seqlen_q / max_seqlen_k: fa4 sizes its grids
  # by the packed token count (an upper bound; varlen-d128: 128 m_blocks per sequence instead of 30),
  # so most tile slots / backward CTAs are empty. The compact grids do not depend on it. Default
  # against the compact grids (forward one tile per CTA), with max_seqlen and without.
  logged next30nomax 280 24 python3 -m fa4.bench --offgrid --mode fwd,bwd --rounds 2 \
    --cases varlen-d128,varlen-d128-nomax,varlen-gqa-d128-causal-nomax \
    --variant "fwd.persistent=False fwd.dynamic_sched=False fwd.l2_section_mb=0 fwd.compact_grid=True bwd.compact_grid=True"
  # Decode without max_seqlen_q: the bound (64 queries) leaves GQA rows unpacked (one row per tile).
  logged next30nomaxdec 150 12 python3 -m fa4.bench --offgrid --mode fwd --rounds 3 \
    --cases varlen-decode,varlen-decode-nomax --variant "fwd.qhead_per_kvhead=4" \
    --variant "fwd.qhead_per_kvhead=4 fwd.compact_grid=True"
fi
if has hostbd; then
  # Session 24: the backward's host time piece by piece (tools/host_breakdown.py $HOSTBD_ROWS).
  logged hostbd 200 200 python3 tools/host_breakdown.py ${HOSTBD_ROWS:-}
fi
echo "total $(( $(date +%s) - t0 ))s"
