"""What a full garbage collection costs an engine's process after start-up, with the heap frozen
at ready (every engine's `freeze_heap`) and thawed again (as it was before that). A benchmark,
not a test.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/gc_pause_serving.py --out benchmarks/results

Each case is a fresh process: build the engine (`LLM`, as `kiln serve`'s engine thread does),
thaw its heap or not, then time `gc.collect()` twice. While serving, every stream waits out such a
collection (the collector holds the GIL). JSON to --out/gc_pause_serving_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CASE = """
import gc, json, sys, time
from kiln import LLM
from kiln.compile.config import CompilationConfig
from kiln.compile.gc_pause import thaw_heap
mode, heap, model, device = sys.argv[1:5]
llm = LLM(model, device=device, **({"compilation": CompilationConfig.level(2)} if mode == "O2" else {}))
if heap == "thawed":
    thaw_heap()
tracked = len(gc.get_objects())  # what a full collection walks: frozen objects are not among them
times, found = [], []
for _ in range(2):
    start = time.perf_counter()
    found.append(gc.collect())
    times.append(time.perf_counter() - start)
print(json.dumps({"mode": mode, "heap": heap, "tracked_objects": tracked, "frozen": gc.get_freeze_count(),
                  "full_collection_s": times, "garbage_found": found}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--modes", nargs="+", default=["default", "O2"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    env_root = str(Path(__file__).resolve().parent.parent)
    cases = []
    for mode in args.modes:
        for heap in ("thawed", "frozen"):
            done = subprocess.run([sys.executable, "-c", CASE, mode, heap, args.model,
                                   args.device], capture_output=True, text=True, cwd=env_root,
                                  env={**os.environ, "KILN_LOGGING_LEVEL": "WARNING"})
            if done.returncode != 0:
                raise SystemExit(f"{mode} {heap}: {done.stderr.strip().splitlines()[-1]}")
            case = json.loads(done.stdout.strip().splitlines()[-1])
            cases.append(case)
            print(f"{mode:8s} {case['heap']:7s} {case['tracked_objects']:8d} tracked objects, full collection "
                  + " / ".join(f"{1e3 * t:.1f}" for t in case["full_collection_s"]) + " ms", flush=True)
    report = {"model": args.model, "device": args.device, "cases": cases, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.out:
        path = Path(args.out) / f"gc_pause_serving_{args.device}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
