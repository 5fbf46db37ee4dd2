import sys, time, importlib.util
from kiln.ops.cpu import extension
spec = importlib.util.spec_from_file_location("kiln_cpu_kernels", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod); extension._loaded = mod
from kiln import LLM, SamplingParams
llm = LLM(None, device="cpu", dtype="bfloat16", max_model_len=4096)
prompts = [list(range(100 + 3000 * i, 100 + 3000 * i + 2000)) for i in range(8)]
llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
for _ in range(2):
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=65, temperature=0, ignore_eos=True), use_tqdm=False)
    print(f"8 x 2000 ctx, 64 decode steps: {(time.perf_counter() - t) / 64 * 1e3:.1f} ms/step", flush=True)
