"""How many intra-op threads a CPU engine runs with.

Measured on the 2-core dev machine (benchmarks/cpu_threads.py, SmolLM2 fp32): alone, 2 threads
serve 16 streams at 1.7x the speed of 1 (212-218 against 120-130 tok/s); beside a process that
keeps one core busy, 2 threads drop to 18-21 tok/s (every parallel region waits for the thread
whose core is taken) while 1 thread holds 129-130. So the default takes the CPUs this process may run on
that no other process keeps busy when the engine starts, shared among the tensor-parallel ranks.
An explicit --cpu-threads, or OMP_NUM_THREADS in the environment, wins.
"""

from __future__ import annotations

import os
import time

import torch

BUSY = 0.5  # a CPU busier than this over the sample is taken by someone else
SAMPLE_S = 0.1  # added to a CPU start without --cpu-threads or OMP_NUM_THREADS


def _cpu_times() -> dict[int, tuple[int, int]]:
    """Per CPU: (busy, total) jiffies since boot, from /proc/stat ({} where there is none)."""
    try:
        lines = open("/proc/stat").read().splitlines()
    except OSError:
        return {}
    times = {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            values = [int(v) for v in fields]
            idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
            times[int(name[3:])] = (sum(values) - idle, sum(values))
    return times


def busy_cpus(cpus: set[int], seconds: float = SAMPLE_S) -> int:
    """How many of `cpus` other processes keep busy: sampled over `seconds` while this one waits."""
    before = _cpu_times()
    time.sleep(seconds)
    after = _cpu_times()
    count = 0
    for cpu in cpus:
        if cpu in before and cpu in after:
            busy, total = (a - b for a, b in zip(after[cpu], before[cpu]))
            count += total > 0 and busy / total > BUSY
    return count


def choose_threads(requested: int | None, ranks: int = 1) -> tuple[int, str]:
    """(threads for each rank's process, why): see the module docstring."""
    if requested is not None:
        return requested, "--cpu-threads"
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads(), "OMP_NUM_THREADS"
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    busy = busy_cpus(cpus)
    threads = max(1, (len(cpus) - busy) // ranks)
    return threads, (f"{len(cpus)} CPUs this process may use, {busy} busy with other processes"
                     + (f", shared by {ranks} ranks" if ranks > 1 else ""))
