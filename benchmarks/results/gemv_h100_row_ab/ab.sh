nvidia-smi --query-gpu=name --format=csv,noheader
run() { v=$1; shift; p=gpu_snap/$v; [ $v = new ] && p=.; PYTHONPATH=$p "$@"; }
i=0
for v in new old new old; do
  i=$((i+1)); d=$OUT/engine_${v}_$i; mkdir -p $d
  echo "== engine $v"; run $v timeout 110 python benchmarks/decode_vs_reference.py --modes default --no-reference --batches 1 8 64 --out $d 2>&1 | grep -v Warn | grep "engine step\|match\|GEMV"
done
