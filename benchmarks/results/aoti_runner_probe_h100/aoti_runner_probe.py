"""Does torch 2.11's CUDA AOTI *runner* (not the package loader) load a .so on this GPU?
python gpu_snap/aoti_runner_probe.py DIR   (builds, then loads in fresh processes)."""
import os
import subprocess
import sys
import zipfile

d = sys.argv[1]
os.makedirs(d, exist_ok=True)
build = f"""
import torch, os
class M(torch.nn.Module):
    def forward(self, x, w):
        return (torch.nn.functional.silu(x @ w.t()) * 2,)
x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16); w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
p = torch.export.export(M(), (x, w), strict=False)
print(torch._inductor.aoti_compile_and_package(p, package_path="{d}/plain.pt2"), flush=True)
torch.save([x, w], "{d}/in.pt")
so = torch._inductor.aot_compile(p.module(), (x, w), options={{"aot_inductor.output_path": "{d}/legacy.so"}})
print("legacy", so, flush=True)
"""
r = subprocess.run([sys.executable, "-c", build], capture_output=True, text=True)
print("build rc", r.returncode, r.stdout[-2000:], r.stderr[-3000:])
with zipfile.ZipFile(f"{d}/plain.pt2") as z:
    z.extractall(f"{d}/unz")
sos = [os.path.join(root, f) for root, _, fs in os.walk(f"{d}/unz") for f in fs if f.endswith(".so")]
print("unzipped", sorted(os.path.relpath(os.path.join(r_, f), d) for r_, _, fs in os.walk(f"{d}/unz") for f in fs))
tail = f"x = torch.load('{d}/in.pt'); print('loaded', flush=True); out = r.run(x); torch.cuda.synchronize(); " \
       f"ref = torch.nn.functional.silu(x[0] @ x[1].t()) * 2; print('ran', (out[0] - ref).abs().max().item(), flush=True)"
cases = {
    "runner_on_unzipped_so": f"import torch; r = torch._C._aoti.AOTIModelContainerRunnerCuda('{sos[0] if sos else ''}', 1, 'cuda', "
                             f"'{os.path.dirname(sos[0]) if sos else ''}'); " + tail,
    "runner_on_unzipped_so_no_cubin_dir": f"import torch; r = torch._C._aoti.AOTIModelContainerRunnerCuda('{sos[0] if sos else ''}', 1, 'cuda'); " + tail,
    "runner_on_legacy_so": f"import torch; r = torch._C._aoti.AOTIModelContainerRunnerCuda('{d}/legacy.so', 1, 'cuda'); " + tail,
    "package_loader_control": f"import torch; r = torch._C._aoti.AOTIModelPackageLoader('{d}/plain.pt2', 'model', False, 1, 0); " + tail,
}
for name, code in cases.items():
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True)
    print(f"=== {name}: rc {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-2500:]}", flush=True)
