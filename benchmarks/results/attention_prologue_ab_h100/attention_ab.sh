# A/B of the decode attention prologue: old (HEAD's kernel, gpu_snap/old), dec (the working tree with
# attention_prologue.patch), st2 (gpu_snap/st2: dec with decode tiles at num_stages 2)
nvidia-smi --query-gpu=name --format=csv,noheader
A=benchmarks/decode_attention.py
run() { v=$1; shift; p=gpu_snap/$v; [ $v = dec ] && p=.; PYTHONPATH=$p "$@"; }
for v in old dec st2; do
  mkdir -p $OUT/quick_$v
  echo "== quick $v"; run $v timeout 90 python $A --quick --out $OUT/quick_$v 2>&1 | grep -v Warn | grep -v "^ " | tail -17
done
for v in dec st2 old; do
  mkdir -p $OUT/engine_$v
  echo "== engine $v"; run $v timeout 100 python benchmarks/decode_vs_reference.py --modes default --no-reference --batches 1 8 64 256 --out $OUT/engine_$v 2>&1 | grep -v Warn | grep "engine step\|match"
done
