# O2 cold: new (key in parallel, workers given it) with 12 and 6 Triton workers, and base (HEAD).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|Model name"
use() { cp -r gpu_snap/$1/kiln .; echo "=== $1 $(date +%T)"; }
one() {
  tag=$1; shift; mkdir -p $OUT/$tag
  timeout 200 python benchmarks/fresh_start.py --out $OUT/$tag "$@" 2>&1 | grep -v "INFO\|WARN" > $OUT/$tag/log.txt
  python - $OUT/$tag/fresh_start_cuda.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for m, cases in d["modes"].items():
    r = cases["cold"]
    p = r["phases_s"]
    print(f"  {m:8s} ready {r['engine_ready_s']:.2f} " + " ".join(f"{k} {v:.2f}" for k, v in p.items() if v > 0.03)
          + f" | workers {r['precompile_workers']} precompile {r['precompile_s']:.2f} last done {max(k[2] for k in r['precompile_kernels']):.2f}"
          + f" kernel s {r['precompile_kernel_s']:.1f} | compile workers warm {r['compile_workers_warm_s']:.2f} jobs {r['compile_workers_jobs_s']:.2f}")
PY
}
for round in 1 2; do
  for v in new new6 base; do use $v; one $v$round --modes O2 --no-reference --cold-only; done
done
use new
