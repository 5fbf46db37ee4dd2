"""What a busy Python thread costs a thread that leaves the GIL often, at the interpreter's switch
interval and at the one kiln starts with (kiln.engine.gil_handoff).

Two workloads, each alone and beside a thread looping in Python (as the compile preload's imports
are during a start): Triton's key (a sha256 of its ~400 MB library in 1 MB updates, each leaving
the GIL) and torch ops of ~1 ms (a large allocation or copy on a GPU takes that long).

    python benchmarks/gil_handoff.py [--out DIR]     (any machine; ~15 s)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

from kiln.engine.gil_handoff import START_UP_SWITCH_INTERVAL

CHUNK = bytes(1 << 20)


def triton_key_like() -> None:
    digest = hashlib.sha256()
    for _ in range(400):
        digest.update(CHUNK)


def millisecond_ops(x=torch.empty(1 << 18)) -> None:
    for _ in range(200):
        x.normal_()


def loop_in_python(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def timed(work, interval: float, beside_busy: bool) -> float:
    sys.setswitchinterval(interval)
    stop = threading.Event()
    busy = threading.Thread(target=loop_in_python, args=(stop,))
    if beside_busy:
        busy.start()
        time.sleep(0.05)
    start = time.perf_counter()
    work()
    seconds = time.perf_counter() - start
    stop.set()
    if beside_busy:
        busy.join()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".")
    args = p.parse_args()
    torch.set_num_threads(1)
    default = sys.getswitchinterval()
    rows = []
    for name, work in [("sha256 400 x 1 MB", triton_key_like), ("200 torch ops of ~1 ms", millisecond_ops)]:
        for interval in (default, START_UP_SWITCH_INTERVAL, default, START_UP_SWITCH_INTERVAL):
            row = {"work": name, "switch_interval_s": interval, "alone_s": timed(work, interval, False),
                   "beside_busy_thread_s": timed(work, interval, True)}
            rows.append(row)
            print(f"{name:24s} interval {interval * 1e3:5.2f} ms: alone {row['alone_s']:.3f} s, "
                  f"beside a busy thread {row['beside_busy_thread_s']:.3f} s", flush=True)
    sys.setswitchinterval(default)
    path = Path(args.out) / "gil_handoff.json"
    path.write_text(json.dumps({"torch": torch.__version__, "python": sys.version.split()[0], "cpus": os.cpu_count(), "rows": rows},
                               indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
