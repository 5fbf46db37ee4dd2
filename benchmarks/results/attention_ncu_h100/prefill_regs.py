"""Registers, spills and wgmma of the prefill attention kernel per tile config, compiled for sm_90 here."""
import sys, itertools, re
sys.path.insert(0, "benchmarks")
from kernel_code import compile_kernel, BLOCK, DIM, HEADS, KV_HEADS
from kiln.ops.triton.kernels.attention import paged_attention_kernel
for bm, bn, w, st in [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 2), (128, 32, 4, 3), (256, 64, 8, 3)]:
    c = dict(GROUP=HEADS // KV_HEADS, HEAD_DIM=DIM, BLOCK_M=bm, BLOCK_N=bn, BLOCK_DIM=DIM, BLOCK_SIZE=BLOCK,
             KV_SPLITS=1, DOT_PRECISION="tf32", ONE_QUERY=False, HAS_WINDOW=False, HAS_SOFTCAP=False,
             HEADS_FIRST=True, OFFSETS_64=False, PDL=False)
    k = compile_kernel(paged_attention_kernel, c, w, st)
    ptx = k.asm["ptx"]
    import subprocess, triton, pathlib
    tools = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    pathlib.Path("/tmp/k.cubin").write_bytes(k.asm["cubin"])
    usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", "/tmp/k.cubin"], capture_output=True, text=True).stdout
    usage = re.search(r"REG:.*", usage).group(0)
    print(f"m{bm} n{bn} w{w} st{st}: {usage} shared {k.metadata.shared} "
          f"wgmma {len(re.findall('wgmma.mma_async', ptx))} mma.sync {len(re.findall('mma.sync', ptx))} "
          f"cp.async {len(re.findall('cp.async', ptx))}", flush=True)
