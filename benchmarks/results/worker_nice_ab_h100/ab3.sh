# O2 and default cold starts: HEAD (new) against HEAD with its compile workers at nice 5 (nice), alternating, 3 rounds.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
use() { cp -r gpu_snap/$1/kiln .; echo "=== $1 $(date +%T)"; }
one() {
  tag=$1; shift; mkdir -p $OUT/$tag
  timeout 100 python benchmarks/fresh_start.py --out $OUT/$tag "$@" 2>&1 | grep -v "INFO\|WARN" > $OUT/$tag/log.txt
  python - $OUT/$tag/fresh_start_cuda.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for m, cases in d["modes"].items():
    r = cases["cold"]
    p = r["phases_s"]
    print(f"  {m:8s} ready {r['engine_ready_s']:.2f} host {d['host_python_s'][0]:.3f} " + " ".join(f"{k} {v:.2f}" for k, v in p.items() if v > 0.03)
          + f" | precompile {r['precompile_s']:.2f} last done {max(k[2] for k in r['precompile_kernels']):.2f}"
          + f" kernel s {r['precompile_kernel_s']:.1f} | compile workers warm {r['compile_workers_warm_s']:.2f} jobs {r['compile_workers_jobs_s']:.2f}")
PY
  rm -f $OUT/$tag/log.txt
}
for round in 1 2 3; do
  for v in new nice; do use $v; one $v$round --modes O2 --no-reference --cold-only; done
done
use new
