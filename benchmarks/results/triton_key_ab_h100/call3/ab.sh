# A/B of the Triton key in parallel with the driver, and the workers given the parent's key:
# cold starts (default and -O2), new / base / new / base, one fresh_start.py each.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
use() { cp -r gpu_snap/$1/kiln .; echo "=== $1 $(date +%T)"; }
one() {  # tag, fresh_start args
  tag=$1; shift; mkdir -p $OUT/$tag
  timeout 200 python benchmarks/fresh_start.py --out $OUT/$tag "$@" 2>&1 | grep -v "INFO\|WARN" | tee $OUT/$tag/log.txt | tail -4
  python - $OUT/$tag/fresh_start_cuda.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for m, cases in d["modes"].items():
    r = cases["cold"]
    p = r["phases_s"]
    print(f"  {m:8s} ready {r['engine_ready_s']:.2f} triton_driver {p.get('triton_driver', 0):.2f} kernels {p.get('kernels', 0):.2f} "
          f"kernels_wait {p.get('kernels_wait', 0):.2f} precompile {r['precompile_s']:.2f} (kernel s {r['precompile_kernel_s']:.1f})")
PY
}
for round in 1 2; do
  use new; one new$round --modes default O2 --no-reference --cold-only
  use base; one base$round --modes default O2 --no-reference --cold-only
done
use new
