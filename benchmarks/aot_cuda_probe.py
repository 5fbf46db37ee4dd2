"""Which AOTInductor packages torch's loader can load and run on this GPU, and under a CUDA-graph
capture: the probe behind `kiln.compile.aot_piece.refused_on("cuda")`.

On an H100 with torch 2.11 (2026-12-07) constructing a loader for an -O2 Llama piece crashed the
process (SIGSEGV); the piece called kiln::rms_norm and kiln::skinny_linear through AOTInductor's
proxy executor, and the same kind of piece loads on the CPU. This builds small packages that
differ in one thing each (no custom op; a custom op of our own with a defaulted argument; kiln's
rms_norm; kiln's skinny_linear) and loads each in a child process (a crash is a return code, not
the end of the probe), with the runner single-threaded and not, then runs it, then captures and
replays it in a CUDA graph. The first child to die by a signal is run again under gdb, where the
machine has it, for its C++ frames. Writes aot_cuda_probe.json. On an H200 with the same torch
(2026-12-07) every child crashed in the loader's constructor, the plain package's too
(benchmarks/results/aot_cuda_probe_h200/):

    python benchmarks/aot_cuda_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

# An op of our own, defined in the child too: the loader looks every op's schema up.
OWN_OP = """
@torch.library.custom_op("kiln_probe::scale", mutates_args=())
def scale(x: torch.Tensor, factor: float, shift: bool = False) -> torch.Tensor:
    return x * factor + (1 if shift else 0)

@scale.register_fake
def _(x, factor, shift=False):
    return torch.empty_like(x)
"""

CHILD = """
import sys, torch
import kiln.ops  # registers kiln's ops
""" + OWN_OP + """
path, inputs_path, single = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
torch.cuda.init()
inputs = torch.load(inputs_path)
print("loader", flush=True)
loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", single, 1, 0)
print("run", flush=True)
expected = loader.run(inputs)
torch.cuda.synchronize()
print("capture", flush=True)
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    loader.run(inputs)  # a second run before the capture, as kiln's warm-up does
torch.cuda.current_stream().wait_stream(stream)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    captured = loader.run(inputs)
graph.replay()
torch.cuda.synchronize()
same = all(torch.equal(a, b) for a, b in zip(expected, captured))
print("replayed", "equal" if same else "differs", flush=True)
"""


ROOT = Path(__file__).resolve().parents[1]  # kiln, for this process and the children, where it is not installed


def _own_op():
    scope = {"torch": torch}
    exec(OWN_OP, scope)
    return scope["scale"]


def _variants():
    """name -> (module, example inputs), each one difference from the one before."""
    from kiln.ops.linear import skinny_linear_op
    from kiln.ops.norm import rms_norm_op

    scale = _own_op()

    class Plain(torch.nn.Module):
        def forward(self, x, w):
            return (torch.nn.functional.silu(x @ w.t()) * 2,)

    class OwnOp(torch.nn.Module):
        def forward(self, x, w):
            return (scale(x @ w.t(), 2.0),)

    class RmsNorm(torch.nn.Module):
        def forward(self, x, w):
            return (rms_norm_op(x, w[0].contiguous(), 1e-5),)

    class SkinnyLinear(torch.nn.Module):
        def forward(self, x, w):
            return (skinny_linear_op(x, w),)

    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    return {"plain": (Plain(), (x, w)), "own_custom_op": (OwnOp(), (x, w)), "kiln_rms_norm": (RmsNorm(), (x, w)),
            "kiln_skinny_linear": (SkinnyLinear(), (x, w))}


def native_stack(command: list[str]) -> list[str]:
    """The C++ frames of a child that died by a signal, rerun under gdb where the machine has it
    (faulthandler shows the Python frames only)."""
    if shutil.which("gdb") is None:
        return ["gdb is not installed here"]
    try:  # gdb reads libtorch's symbols first: bounded, so a slow machine still gets the probe's JSON
        done = subprocess.run(["gdb", "-batch", "-ex", "run", "-ex", "bt 40", "--args", *command],
                              capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return ["gdb took over 180 s"]
    return [line for line in done.stdout.splitlines() if line.startswith("#")][:40] or done.stdout[-2000:].splitlines()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--variants", nargs="+", help="only these, in this order (default: all)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    work = Path(tempfile.mkdtemp(prefix="kiln-aot-probe-"))
    report = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "variants": {}}
    variants = _variants()
    stacks_taken = False
    for name in args.variants or list(variants):
        module, inputs = variants[name]
        row = report["variants"][name] = {}
        try:
            program = torch.export.export(module, inputs, strict=False)
            package = torch._inductor.aoti_compile_and_package(program, package_path=str(work / f"{name}.pt2"))
        except Exception as e:  # noqa: BLE001 - the probe reports every failure
            row["build"] = f"{type(e).__name__}: {e}"[:500]
            print(name, row, flush=True)
            continue
        torch.save(list(inputs), work / f"{name}.inputs.pt")
        for single in (False, True):
            child = [sys.executable, "-X", "faulthandler", "-c", CHILD, package, str(work / f"{name}.inputs.pt"),
                     "1" if single else "0"]
            done = subprocess.run(child, capture_output=True, text=True, timeout=300)
            steps = done.stdout.split("\n")
            result = row["single_threaded" if single else "default_runner"] = {
                "returncode": done.returncode, "reached": [s for s in steps if s],
                "stderr_tail": done.stderr[-800:] if done.returncode else ""}
            if done.returncode < 0 and not stacks_taken:  # one gdb run: each costs a minute or more
                result["native_stack"] = native_stack(child)
                stacks_taken = True
        print(name, json.dumps(row, indent=1), flush=True)
    out = Path(args.out) / "aot_cuda_probe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
