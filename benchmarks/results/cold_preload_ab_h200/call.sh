export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
loop() { python -c "import time;t=time.perf_counter();s=0
for i in range(3_000_000): s+=i
print('loop', round(time.perf_counter()-t,3))"; }
nvidia-smi --query-gpu=name --format=csv,noheader; loop
python parse_probe.py 2>&1 | tail -8
i=0
for v in new old new old new old; do
  i=$((i+1))
  [ $v = old ] && patch -s -p1 -R < ab2_s25.patch
  timeout 120 python benchmarks/fresh_start.py --modes O2 --no-reference --cold-only --out $OUT/ab/$i-$v 2>&1 | grep "engine ready" | sed "s/^/$i $v /"
  [ $v = old ] && patch -s -p1 < ab2_s25.patch
done
loop
git diff --stat | tail -1
bash benchmarks/gpu_suite.sh fresh 2>&1 | grep -v "^===" | tail -9
