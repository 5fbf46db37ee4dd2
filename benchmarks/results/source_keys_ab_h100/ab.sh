# A/B of the recorded source keys: new, base (HEAD 09c9baa's files), new; fresh_start each time.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
use() { cp -r gpu_snap/$1/kiln .; echo "=== $1 $(date +%T)"; }
one() {  # tag, fresh_start args
  tag=$1; shift; mkdir -p $OUT/$tag
  timeout 280 python benchmarks/fresh_start.py --out $OUT/$tag "$@" 2>&1 | grep -v "INFO\|WARN" | tee $OUT/$tag/log.txt | tail -9
}
use new; one new1 --modes default O2
use base; one base --modes default O2 --no-reference
use new; one new2 --modes O2 --no-reference --warm-only
