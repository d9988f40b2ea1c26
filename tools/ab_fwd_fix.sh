# A/B of Note [Empty tiles and o_in_q]: the forward d256 causal s8k (no empty tiles) on the fixed
# code and on the code before the fix (tools/ab_old_fwd_sm90.py), interleaved, one process each.
# Before the device call: git show 9e858a5:fa4/fwd/sm90.py > tools/ab_old_fwd_sm90.py (not kept in the tree).
export FA4_CACHE_DIR=/tmp/fa4c
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r fa4 /tmp/old/ && cp tools/ab_old_fwd_sm90.py /tmp/old/fa4/fwd/sm90.py
for r in 1 2 3; do
  for tree in . /tmp/old; do
    (cd $tree && PYTHONPATH=$tree:$PYTHONPATH timeout 100 python3 -c "import fa4,sys; print(fa4.__file__, file=sys.stderr); from fa4.bench import main; main()"  --mode fwd --hdim 256 --causal yes 2>&1 \
      | grep -E "fwd fa4:|fwd flash-attn-4:|__init__" | sed "s#^#$tree r$r #")
  done
done
