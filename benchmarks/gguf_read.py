"""Reading the embedded SmolLM2 GGUF's header: the gguf package's reader against kiln's
(a benchmark, not a test): prints, writes JSON.

    OMP_NUM_THREADS=1 python benchmarks/gguf_read.py --out benchmarks/results

Both read metadata and the tensor index (no weights are dequantized); each is run
--repeats times in this process, alternating, and the medians are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    import gguf

    from kiln.loader import embedded_gguf_path
    from kiln.loader.gguf_header import read_gguf

    path = embedded_gguf_path()
    times = {"gguf.GGUFReader": [], "kiln read_gguf": []}
    for _ in range(args.repeats):
        start = time.perf_counter()
        reader = gguf.GGUFReader(str(path))
        {name: f.contents() for name, f in reader.fields.items()}
        times["gguf.GGUFReader"].append(time.perf_counter() - start)
        start = time.perf_counter()
        read_gguf(path)
        times["kiln read_gguf"].append(time.perf_counter() - start)
    medians = {k: statistics.median(v) for k, v in times.items()}
    result = {"file": path.name, "repeats": args.repeats, "median_s": medians,
              "speedup": medians["gguf.GGUFReader"] / medians["kiln read_gguf"]}
    for name, seconds in medians.items():
        print(f"{name:16s} {seconds * 1e3:8.1f} ms")
    print(f"speed-up {result['speedup']:.1f}x")
    out = Path(args.out) / "gguf_read_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
