"""kiln beside vLLM's CPU build on this machine: batch and single-stream decode, ready time,
and kiln's long-prompt prefill (a benchmark, not a test).

    python benchmarks/cpu_peer.py --vllm-python /path/to/venv-with-vllm-cpu/bin/python

The workload of issue #20: SmolLM2-135M-Instruct, 16 chat prompts x 64 forced tokens (greedy, or
chat sampling with --sampling chat; EOS ignored), 3 batches a run, then one prompt alone; every
run a fresh process, the engines and modes taking turns. The prompts are the same token ids
for both engines (kiln's chat template). vLLM reads an HF folder that transformers writes from
the embedded GGUF (the weights kiln dequantizes). Each engine's compile cache starts empty in
the first run of a mode (cold) and is kept for its later runs (warm); kiln's C++ CPU attention
is built first (what `kiln prewarm` or an install does). Without --vllm-python (or vllm
importable here), only kiln runs.

Also, kiln only: one ~8k-token prompt prefilled (--long-prompt tokens, a single output token)
in each dtype and kiln mode, with the default chunking and with --max-num-batched-tokens 8192,
its time and the peak resident memory above the ready engine's. --long-prompt-only runs just
that and writes cpu_peer_long_prompt.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BATCHES, BATCH_TOKENS, SINGLE_TOKENS = 3, 64, 64
# --sampling: greedy (the workload), or what a chat client typically asks for (seeded per
# request in neither engine).
SAMPLING = {"greedy": dict(temperature=0), "chat": dict(temperature=0.8, top_k=50, top_p=0.95)}


# ------------------------------------------------------------------ workers (one process each)

def _peak_rss_reset() -> None:
    # Linux: writing 5 to clear_refs resets VmHWM, so the peak counts from here.
    Path("/proc/self/clear_refs").write_text("5")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def kiln_worker(job: dict) -> dict:
    from kiln import LLM, SamplingParams

    engine_args = {"max_num_batched_tokens": job["max_num_batched_tokens"]} if job.get("max_num_batched_tokens") else {}
    if job.get("max_model_len"):
        engine_args["max_model_len"] = job["max_model_len"]
    llm = LLM("smollm2", device="cpu", dtype=job["dtype"], compilation_config=2 if job["mode"] == "O2" else 0,
              max_num_seqs=16, **engine_args)
    ready = time.time() - job["t0"]

    def generate(prompts, tokens):
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, **SAMPLING[job["sampling"]])
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    return {"ready_s": ready, **run_workload(job, generate)}


def vllm_worker(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(job["hf_folder"], dtype=job["dtype"], enforce_eager=job["mode"] == "eager", max_num_seqs=16,
              max_model_len=2048, seed=0)
    ready = time.time() - job["t0"]

    def generate(prompts, tokens):
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, **SAMPLING[job["sampling"]])
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return {"ready_s": ready, **run_workload(job, generate)}


def run_workload(job: dict, generate) -> dict:
    prompts = json.loads(Path(job["prompts"]).read_text())
    if job.get("long_prompt"):
        base = _status_kb("VmRSS")
        _peak_rss_reset()
        start = time.perf_counter()
        generate([prompts["long"]], 1)
        return {"prefill_s": time.perf_counter() - start, "prompt_tokens": len(prompts["long"]),
                "peak_rss_above_ready_mb": (_status_kb("VmHWM") - base) / 1024}
    batch_rates, tokens = [], None
    for _ in range(BATCHES):
        start = time.perf_counter()
        tokens = generate(prompts["chats"], BATCH_TOKENS)
        batch_rates.append(sum(map(len, tokens)) / (time.perf_counter() - start))
    start = time.perf_counter()
    single = generate(prompts["chats"][:1], SINGLE_TOKENS)
    return {"batch_tok_s": batch_rates, "single_tok_s": len(single[0]) / (time.perf_counter() - start),
            "first_tokens": tokens[0][:16]}


# ------------------------------------------------------------------ the parent

def write_prompts(path: Path, long_tokens: int) -> None:
    from benchmarks.greedy_agreement import PROMPTS
    from kiln.loader import load_source

    tokenizer = load_source("smollm2").tokenizer
    chats = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:16]]
    text = " ".join(PROMPTS) + "\n"
    long = tokenizer.encode(text * (long_tokens // len(tokenizer.encode(text)) + 1))[:long_tokens]
    path.write_text(json.dumps({"chats": chats, "long": long}))


def write_hf_folder(folder: Path) -> None:
    """The embedded GGUF as an HF folder (fp32 safetensors, config, tokenizer) for vLLM."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from kiln.loader import embedded_gguf_path

    gguf = embedded_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # one tensor under two names: safetensors keeps one
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):  # dequantized already: plain fp32 weights
        del config.quantization_config
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def spawn(python: str, job: dict, env: dict, timeout: float) -> dict:
    job = {**job, "t0": time.time()}
    run = subprocess.run([python, __file__, "--worker", json.dumps(job)], capture_output=True, text=True,
                         env=env, timeout=timeout, cwd=job.get("cwd"))
    for line in run.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": (run.stderr.strip().splitlines() or ["no output"])[-1][:300], "rc": run.returncode}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--vllm-python", default=None, help="a Python with vllm (the CPU build) importable")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--runs", type=int, default=2, help="runs of every (engine, mode, dtype), taking turns")
    p.add_argument("--long-prompt", type=int, default=8000, help="tokens of the long prompt (0: skip it)")
    p.add_argument("--long-prompt-only", action="store_true",
                   help="only the long prompt (no batches, no vLLM): writes cpu_peer_long_prompt.json")
    p.add_argument("--sampling", default="greedy", choices=list(SAMPLING),
                   help=f"the batches' sampling: {SAMPLING} (chat writes cpu_peer_chat.json)")
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "kiln-cpu-peer"))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    sys.path.insert(0, str(REPO))  # kiln and benchmarks/, for this process and kiln's workers alike
    if args.worker:
        job = json.loads(args.worker)
        result = (vllm_worker if job["engine"] == "vllm" else kiln_worker)(job)
        print("RESULT " + json.dumps(result), flush=True)
        return

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.json"
    write_prompts(prompts, args.long_prompt)
    vllm_python = args.vllm_python
    if args.long_prompt_only:
        if not args.long_prompt:
            p.error("--long-prompt-only with --long-prompt 0 leaves nothing to run")
        vllm_python, args.runs = None, 0
    elif vllm_python is None:
        if importlib.util.find_spec("vllm") is not None:
            vllm_python = sys.executable
        else:
            print("vllm is not importable here and no --vllm-python was given: kiln only", flush=True)
    engines = [("kiln", "eager"), ("kiln", "O2")]
    if vllm_python:
        hf = work / "smollm2-hf"
        if not (hf / "model.safetensors").exists():
            write_hf_folder(hf)
        engines += [("vllm", "eager"), ("vllm", "compiled")]
    # One compile cache per benchmark run and engine: a mode's first run is cold, later ones warm.
    caches = Path(tempfile.mkdtemp(prefix="caches-", dir=work))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # each engine's own thread policy
    env.update({"KILN_CACHE_ROOT": str(caches / "kiln"), "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
                "VLLM_CACHE_ROOT": str(caches / "vllm"), "VLLM_CPU_KVCACHE_SPACE": "1",
                "PYTHONPATH": str(REPO)})
    # kiln's C++ attention is built at install/prewarm time, as a deployment would have it.
    subprocess.run([sys.executable, "-c", "from kiln.ops.cpu.extension import build; build()"], env=env,
                   check=True, cwd=work)
    results = {f"{e} {m} {d}": [] for d in args.dtypes for e, m in engines}
    for run in range(args.runs):
        for dtype in args.dtypes:
            for engine, mode in engines:
                job = {"engine": engine, "mode": mode, "dtype": dtype, "prompts": str(prompts),
                       "sampling": args.sampling,
                       "hf_folder": str(work / "smollm2-hf"), "cwd": str(work)}
                python = vllm_python if engine == "vllm" else sys.executable
                r = spawn(python, job, env, args.timeout)
                r["run"] = run
                results[f"{engine} {mode} {dtype}"].append(r)
                if "error" in r:
                    print(f"{engine:4s} {mode:8s} {dtype:8s} run {run}: {r['error']}", flush=True)
                else:
                    print(f"{engine:4s} {mode:8s} {dtype:8s} run {run}: ready {r['ready_s']:5.1f} s, 16x64 "
                          f"{' '.join(f'{x:5.1f}' for x in r['batch_tok_s'])} tok/s, single "
                          f"{r['single_tok_s']:5.1f} tok/s", flush=True)
    long = []
    if args.long_prompt:
        for dtype, mode, chunk in ((d, m, c) for d in args.dtypes for m in ("eager", "O2") for c in (None, 8192)):
            job = {"engine": "kiln", "mode": mode, "dtype": dtype, "prompts": str(prompts), "sampling": "greedy",
                   "long_prompt": True, "max_num_batched_tokens": chunk, "max_model_len": 8192, "cwd": str(work)}
            r = {**spawn(sys.executable, job, env, args.timeout), "dtype": dtype, "mode": mode,
                 "max_num_batched_tokens": chunk or "default"}
            long.append(r)
            print(f"kiln long prompt ({args.long_prompt} tokens, {dtype}, {mode}, max_num_batched_tokens "
                  f"{chunk or 'default'}): "
                  + (r["error"] if "error" in r else
                     f"{r['prefill_s']:.1f} s, peak RSS +{r['peak_rss_above_ready_mb']:.0f} MB"), flush=True)
    # This VM kind's speed varies by instance (the 8k fp32 prompt: 18.4 s on one, 14.5 s on another):
    # its float32 matmul rate, to read an absolute time against.
    import torch

    from kiln.tools.bench import measure_matmul

    sgemm = measure_matmul("cpu", torch.float32)
    print(f"this CPU's float32 matmul rate (1024^2, best of 5): {sgemm / 1e9:.0f} GFLOP/s", flush=True)
    report = {"runs": results, "long_prompt": long, "summary": summarize(results, args.dtypes),
              "sgemm_flop_s": sgemm,
              "workload": f"16 chats x {BATCH_TOKENS} tokens, {BATCHES} batches a run; one chat x {SINGLE_TOKENS}",
              "sampling": SAMPLING[args.sampling],
              "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    for line in report["summary"]["lines"]:
        print(line)
    name = "cpu_peer.json" if args.sampling == "greedy" else f"cpu_peer_{args.sampling}.json"
    path = Path(args.out) / ("cpu_peer_long_prompt.json" if args.long_prompt_only else name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")


def summarize(results: dict, dtypes: list[str]) -> dict:
    """Per dtype and engine: the best mode's median batch rate and single-stream rate, warm ready
    times, and kiln / vLLM ratios."""
    import statistics

    out: dict = {"lines": []}
    for dtype in dtypes:
        best = {}
        for name, runs in results.items():
            engine, mode, d = name.split()
            ok = [r for r in runs if "error" not in r]
            if d != dtype or not ok:
                continue
            row = {"mode": mode, "batch_tok_s": statistics.median(x for r in ok for x in r["batch_tok_s"]),
                   "single_tok_s": statistics.median(r["single_tok_s"] for r in ok),
                   "ready_cold_s": ok[0]["ready_s"] if ok[0]["run"] == 0 else None,
                   "ready_warm_s": statistics.median([r["ready_s"] for r in ok if r["run"] > 0] or [ok[0]["ready_s"]])}
            for key in ("batch_tok_s", "single_tok_s"):
                if engine not in best or row[key] > best[engine].get(key, 0):
                    best.setdefault(engine, {})[key] = row[key]
                    best[engine][key.replace("tok_s", "mode")] = mode
            best.setdefault(engine, {}).setdefault("modes", {})[mode] = row
        out[dtype] = best
        if "vllm" in best and "kiln" in best:
            k, v = best["kiln"], best["vllm"]
            ratios = {"batch": k["batch_tok_s"] / v["batch_tok_s"], "single": k["single_tok_s"] / v["single_tok_s"]}
            out[dtype]["kiln_over_vllm"] = ratios
            out["lines"].append(f"{dtype}: 16x64 kiln {k['batch_tok_s']:.1f} ({k['batch_mode']}) vs vLLM "
                                f"{v['batch_tok_s']:.1f} ({v['batch_mode']}) tok/s = {ratios['batch']:.2f}x; single "
                                f"{k['single_tok_s']:.1f} vs {v['single_tok_s']:.1f} = {ratios['single']:.2f}x")
        for engine, row in best.items():
            if engine in ("kiln", "vllm"):
                for mode, m in row["modes"].items():
                    out["lines"].append(f"{dtype}: {engine} {mode}: 16x64 {m['batch_tok_s']:.1f} tok/s, single "
                                        f"{m['single_tok_s']:.1f}, ready cold {m['ready_cold_s'] or float('nan'):.1f} s "
                                        f"/ warm {m['ready_warm_s']:.1f} s")
    return out


if __name__ == "__main__":
    main()
