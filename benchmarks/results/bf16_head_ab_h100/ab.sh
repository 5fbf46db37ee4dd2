card=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$card"
run() { v=$1; shift; p=gpu_snap/$v; [ $v = new ] && p=.; PYTHONPATH=$p "$@"; }
i=0
for v in new old new old; do
  i=$((i+1)); d=$OUT/greedy_${v}_$i; mkdir -p $d
  echo "== greedy $v"; run $v timeout 100 python benchmarks/decode_vs_reference.py --modes default --no-reference --batches 1 64 256 --out $d 2>&1 | grep -v Warn | grep "engine step\|match"
done
for v in new old; do
  i=$((i+1)); d=$OUT/sampled_${v}_$i; mkdir -p $d
  echo "== sampled $v"; run $v timeout 100 python benchmarks/decode_vs_reference.py --modes default --no-reference --sampled --batches 1 64 256 --out $d 2>&1 | grep -v Warn | grep "engine step\|match"
done
