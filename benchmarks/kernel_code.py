"""The machine code of kiln's attention, one-row GEMV, RMSNorm and rotary kernels for sm_90
(H100/H200), compiled on a machine without a GPU: instructions, barriers, registers, late loads and
(attention) shared memory per launch configuration (a measurement, not a test).

    python benchmarks/kernel_code.py --out benchmarks/results

Attention: each case is a configuration a Llama-3-8B step launches (32 query heads, 8 kv heads,
head dim 128, bf16, 16-token blocks), with the tiles and split count paged_attention would choose.
GEMV: every one-row FMA config at Llama-3-8B's qkv shape (N 6144, K 4096), and the down
projection's (K 14336, SiLU-and-mul on the loads) on the configs that fit it. RMSNorm, plain and
with the residual add, at hidden size 4096 (16 warps): the global loads issued after the sum's
first barrier, each a memory round trip the row waits for. Rotary with the KV write (Llama-3-8B's
heads): the global loads issued after its first store, the round trips left at its end.

Triton compiles each to a cubin for sm_90 (ptxas ships with Triton) and nvdisasm lists its SASS;
a loop is a backward branch, and its body the instructions between its target and the branch.
Counts are static: a loop's body runs once per key tile (attention) or weight chunk (GEMV), the
rest once per program. They say how much work a change removes, not how fast a kernel runs;
time it on the GPU (benchmarks/decode_attention.py, benchmarks/gemv.py, benchmarks/profile_step.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile  # noqa: E402

from kiln.ops.triton import gemv  # noqa: E402
from kiln.ops.triton.attention import choose_tiles  # noqa: E402
from kiln.ops.triton.kernels.attention import paged_attention_kernel  # noqa: E402
from kiln.ops.triton.kernels.gemv import gemv_fma_kernel  # noqa: E402
from kiln.ops.triton.kernels.norm import fused_add_rms_norm_kernel, rms_norm_kernel  # noqa: E402
from kiln.ops.triton.kernels.rotary import rotary_kernel  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16
TARGET = GPUTarget("cuda", 90, 32)
SM_COUNT = 132
# (name, batch, query tokens per sequence, kv splits): decode at 1 (split 16 ways, as in a graph captured with
# Llama-3-8B's 8192-token bound), 64 and 256; a 2048-token prefill.
CASES = [("decode b1", 1, 1, 16), ("decode b64", 64, 1, 1), ("decode b256", 256, 1, 1), ("prefill 2048", 1, 2048, 1)]
ARG_TYPES = dict(
    query_ptr="*bf16", key_cache_ptr="*bf16", value_cache_ptr="*bf16", out_ptr="*bf16", block_tables_ptr="*i32",
    seq_lens_ptr="*i32", query_start_loc_ptr="*i32", partial_acc_ptr="*fp32", partial_max_ptr="*fp32",
    partial_sum_ptr="*fp32", counter_ptr="*i32", num_seqs="i32", scale_log2="fp32", window="i32",
    softcap_log2="fp32", block_size="i32",  # block_size: the attention kernel's before e97386a
    x_ptr="*bf16", w_ptr="*bf16", ws_ptr="*fp32", residual_ptr="*bf16", weight_ptr="*bf16",
    new_residual_ptr="*bf16", eps="fp32", positions_ptr="*i64", q_ptr="*bf16", k_ptr="*bf16", cache_ptr="*fp32",
    q_out_ptr="*bf16", k_out_ptr="*bf16", v_ptr="*bf16", slot_mapping_ptr="*i64")  # the rest: strides, sizes (i32)
GEMV_SHAPES = [("qkv", 6144, 4096, ""), ("down", 4096, 14336, "silu")]


def compile_kernel(kernel, constants: dict, num_warps: int, num_stages: int, max_registers: int | None = None):
    names = kernel.arg_names
    constants = {k: v for k, v in constants.items() if k in names}  # a kernel of another commit may lack one
    signature, attrs = {}, {}
    for index, name in enumerate(names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        signature[name] = ARG_TYPES.get(name, "i32")
        # As the launcher marks real ones: pointers, strides, and sizes that are multiples of 16.
        if signature[name].startswith("*") or "stride" in name or name in ("N", "K", "hidden_size"):
            attrs[(index,)] = [["tt.divisibility", 16]]
    return compile(ASTSource(kernel, signature, constants, attrs), target=TARGET,
                   options={"num_warps": num_warps, "num_stages": num_stages,
                            **({"maxnreg": max_registers} if max_registers else {})})


def compile_attention(batch: int, query_len: int, splits: int, offsets_64: bool):
    tiles = choose_tiles(query_len, HEADS // KV_HEADS, DIM, batch * KV_HEADS)
    constants = dict(GROUP=HEADS // KV_HEADS, HEAD_DIM=DIM, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                     BLOCK_DIM=DIM, BLOCK_SIZE=BLOCK, KV_SPLITS=splits, DOT_PRECISION="tf32",
                     ONE_QUERY=query_len == 1, HAS_WINDOW=False, HAS_SOFTCAP=False, HEADS_FIRST=tiles.heads_first,
                     OFFSETS_64=offsets_64)
    return compile_kernel(paged_attention_kernel, constants, tiles.num_warps, tiles.num_stages or 3,
                          tiles.max_registers), tiles


def sass_stats(cubin: bytes, workdir: Path) -> dict:
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    path = workdir / "kernel.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run([str(tools / "nvdisasm"), "-c", str(path)], capture_output=True, text=True,
                          check=True).stdout
    usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", str(path)], capture_output=True,
                           text=True, check=True).stdout
    instructions, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"\s*\.L_x_(\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
        code = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if code:
            instructions.append(code.group(1))
    loops = []
    for index, text in enumerate(instructions):
        branch = re.search(r"BRA\s+`\(\.L_x_(\d+)\)", text)
        if branch and labels.get(branch.group(1), index + 1) <= index:
            body = instructions[labels[branch.group(1)]: index + 1]
            if len(body) > 1:  # not the final self-loop
                ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0] for i in body)
                loops.append({"instructions": len(body), "integer_multiply_adds": ops["IMAD"],
                              "mma": ops["HMMA"] + ops["HGMMA"], "exp2": ops["MUFU"], "barriers": ops["BAR"],
                              "shared_memory": ops["STS"] + ops["LDS"]})
    registers, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    first_barrier = next((i for i, text in enumerate(instructions) if "BAR.SYNC" in text), len(instructions))
    first_store = next((i for i, text in enumerate(instructions) if "STG" in text), len(instructions))
    return {"instructions": len(instructions), "registers": int(registers.group(1)) if registers else None,
            "stack_bytes": int(stack.group(1)) if stack else None,  # spilled registers live there
            "loops": loops,
            "loads_after_first_barrier": sum("LDG" in text for text in instructions[first_barrier:]),
            "loads_after_first_store": sum("LDG" in text for text in instructions[first_store:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--tag", default="", help="suffix of the JSON's name (e.g. a commit)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, batch, query_len, splits in CASES:
        for offsets_64 in (False, True):
            kernel, tiles = compile_attention(batch, query_len, splits, offsets_64)
            stats = sass_stats(kernel.asm["cubin"], out)
            # Shared memory is the pipeline's K and V buffers (and q): it bounds the programs an SM holds.
            shared = kernel.metadata.shared
            rows.append({"case": name, "offsets_64": offsets_64, "block_m": tiles.block_m, "block_n": tiles.block_n,
                         "num_warps": tiles.num_warps, "num_stages": kernel.metadata.num_stages, "kv_splits": splits,
                         "max_registers": tiles.max_registers,
                         "shared_bytes": shared, **stats})
            print(f"attention {name:13s} {'64' if offsets_64 else '32'}-bit offsets: {stats['instructions']:5d} "
                  f"instructions, {stats['registers']} registers ({stats['stack_bytes']} B stack), "
                  f"{shared / 1024:.0f} KB shared, key loops "
                  f"{[loop['instructions'] for loop in stats['loops']]}")
    gemv_rows = []
    for name, n, k, activation in GEMV_SHAPES:
        for config in gemv.FMA_CONFIGS:
            if not gemv.config_fits(config, 1, n, k, SM_COUNT, fma=True) or k % config.kwargs["BLOCK_K"]:
                continue
            kernel = compile_kernel(gemv_fma_kernel, dict(BLOCK_M=1, EVEN_K=True, ACTIVATION=activation,
                                                         **config.kwargs), config.num_warps, config.num_stages)
            stats = sass_stats(kernel.asm["cubin"], out)
            weights = config.kwargs["BLOCK_N"] * config.kwargs["BLOCK_K"] / (32 * config.num_warps)
            loop = max(stats["loops"], key=lambda loop: loop["instructions"])
            gemv_rows.append({"shape": name, "N": n, "K": k, **config.kwargs, "num_warps": config.num_warps,
                              "num_stages": config.num_stages, "weights_per_thread": weights,
                              "loop_instructions_per_weight": loop["instructions"] / weights, **stats})
            print(f"gemv {name:5s} {tuple(config.kwargs.values())} {config.num_warps} warps: loop "
                  f"{loop['instructions']} instructions ({loop['instructions'] / weights:.2f} a weight), "
                  f"{loop['barriers']} barriers, {stats['registers']} registers")
    norm_rows = []
    for kernel in (rms_norm_kernel, fused_add_rms_norm_kernel):
        stats = sass_stats(compile_kernel(kernel, dict(BLOCK=4096, UNIT_OFFSET=False), 16, 3).asm["cubin"], out)
        norm_rows.append({"kernel": kernel.__name__, **stats})
        print(f"{kernel.__name__}: {stats['instructions']} instructions, {stats['loads_after_first_barrier']} "
              f"global loads after the first barrier")
    rotary = sass_stats(compile_kernel(rotary_kernel, dict(HEAD_DIM=DIM, ROTARY_DIM=DIM, BLOCK_DIM=DIM,
                                                          BLOCK_Q_HEADS=HEADS, BLOCK_KV_HEADS=KV_HEADS, WRITE_KV=True),
                                       8, 3).asm["cubin"], out)
    print(f"rotary_kernel (KV write): {rotary['instructions']} instructions, {rotary['loads_after_first_store']} "
          f"global loads after the first store")
    (out / "kernel.cubin").unlink(missing_ok=True)
    report = {"target": "sm_90", "triton": triton.__version__,
              "attention": {"shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM, "block_size": BLOCK},
                            "cases": rows},
              "gemv_fma_one_row": gemv_rows, "rms_norm_hidden_4096": norm_rows, "rotary_kv_write": rotary}
    path = out / f"kernel_code_sm90{'_' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(report, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
