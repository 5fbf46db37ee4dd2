"""The logical-bytes model of fused residual-add + RMSNorm against its decomposition.

A model, not a measurement: it counts the bytes each op must read and write if every
intermediate of the reference decomposition is materialized in memory (what eager
PyTorch does), against one fused kernel that reads each input once and writes each
output once. Caches, partial fusion by a compiler and launch costs are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.models.config import ModelArchConfig

FP32 = 4


@dataclass(frozen=True)
class Op:
    name: str
    read: int  # bytes
    write: int

    @property
    def bytes(self) -> int:
        return self.read + self.write


def fused_add_rms_norm_fused(hidden: int, elem: int) -> list[Op]:
    """One kernel: read x, residual and weight; write the normed output and the new residual."""
    row = hidden * elem
    return [Op("fused_add_rms_norm", read=3 * row, write=2 * row)]


def fused_add_rms_norm_reference(hidden: int, elem: int) -> list[Op]:
    """The fp32-accumulating decomposition, one materialized tensor per op (per token)."""
    row, row32 = hidden * elem, hidden * FP32
    return [
        Op("x.float()", row, row32),
        Op("residual.float()", row, row32),
        Op("x + residual", 2 * row32, row32),
        Op("residual = sum.to(dtype)", row32, row),
        Op("pow(2)", row32, row32),
        Op("mean(-1)", row32, FP32),
        Op("+ eps", FP32, FP32),
        Op("rsqrt", FP32, FP32),
        Op("x * rsqrt", row32 + FP32, row32),
        Op(".to(dtype)", row32, row),
        Op("* weight", 2 * row, row),
    ]


def call_sites(cfg: ModelArchConfig) -> int:
    """Fused add + norm calls per forward: before attention and MLP of every layer but the
    first layer's input norm (no residual yet), plus the final norm."""
    return 2 * cfg.num_layers - 1 + 1


def active_experts(cfg: ModelArchConfig, batch: int) -> float:
    """Experts a decode step of `batch` tokens is expected to reach, each token choosing
    num_experts_per_tok of them uniformly (random weights route about so)."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** batch)


def decode_weight_bytes(cfg: ModelArchConfig, elem: int, batch: int = 1) -> int:
    """Bytes of weights one decode step reads: every weight but the embedding table, which
    decode only gathers a row of (a tied LM head is still read whole, as the head). Of a
    mixture of experts, the router and the experts the batch reaches (active_experts)."""
    c = cfg
    attn = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    if c.num_experts:
        mlp = round(active_experts(c, batch) * 3 * c.hidden_size * c.moe_intermediate_size) + c.num_experts * c.hidden_size
    else:
        mlp = 3 * c.hidden_size * c.intermediate_size
    norms = 2 * c.hidden_size
    layers = c.num_layers * (attn + mlp + norms)
    return (layers + c.hidden_size + c.vocab_size * c.hidden_size) * elem


@dataclass(frozen=True)
class TrafficReport:
    hidden: int
    elem: int
    fused_per_call: int  # bytes, one token
    reference_per_call: int
    sites: int
    weight_bytes: int

    @property
    def ratio(self) -> float:
        return self.reference_per_call / self.fused_per_call

    @property
    def extra_per_token(self) -> int:
        """Bytes the decomposition moves beyond the fused kernel, all call sites, one token."""
        return (self.reference_per_call - self.fused_per_call) * self.sites

    def extra_share(self, tokens: int) -> float:
        """Extra elementwise bytes of a step with `tokens` tokens, as a share of its weight bytes."""
        return self.extra_per_token * tokens / self.weight_bytes

    def tokens_for_share(self, share: float) -> float:
        return share * self.weight_bytes / self.extra_per_token

    def weight_floor_ms(self, bandwidth_tb_s: float) -> float:
        return self.weight_bytes / (bandwidth_tb_s * 1e12) * 1e3


def traffic(cfg: ModelArchConfig, elem: int) -> TrafficReport:
    fused = sum(op.bytes for op in fused_add_rms_norm_fused(cfg.hidden_size, elem))
    reference = sum(op.bytes for op in fused_add_rms_norm_reference(cfg.hidden_size, elem))
    return TrafficReport(cfg.hidden_size, elem, fused, reference, call_sites(cfg), decode_weight_bytes(cfg, elem))


def render(name: str, report: TrafficReport, token_counts: list[int], bandwidth: float,
           shares: list[float]) -> str:
    r = report
    lines = [
        f"kiln traffic: a logical-bytes MODEL for {name}, not a measurement (no caches, no partial",
        "fusion, no launch costs; every intermediate of the decomposition is assumed materialized).",
        "",
        f"fused_add_rms_norm, hidden {r.hidden}, {r.elem}-byte elements, one token:",
        f"  fused kernel payload        {r.fused_per_call:>12,} bytes",
        f"  reference decomposition     {r.reference_per_call:>12,} bytes  ({r.ratio:.1f}x)",
        "    " + ", ".join(f"{op.name} {op.bytes:,}" for op in fused_add_rms_norm_reference(r.hidden, r.elem)),
        f"  difference over {r.sites} call sites  {r.extra_per_token / 1e6:>9.2f} MB per token",
        "",
        f"decode-step weight bytes (all but the embedding table): {r.weight_bytes / 1e9:.2f} GB; "
        f"weight floor {r.weight_floor_ms(bandwidth):.2f} ms at {bandwidth} TB/s",
        "",
        f"  {'tokens':>7}  {'extra bytes':>12}  {'share of weight bytes':>22}",
    ]
    for n in token_counts:
        lines.append(f"  {n:>7}  {r.extra_per_token * n / 1e9:>10.2f} GB  {r.extra_share(n):>21.1%}")
    lines.append("")
    for share in shares:
        lines.append(f"elementwise extra reaches {share:.0%} of weight traffic at "
                     f"{r.tokens_for_share(share):.0f} tokens")
    return "\n".join(lines)


def register(commands) -> None:
    p = commands.add_parser("traffic", help="logical-bytes model of fused add+RMSNorm vs its decomposition")
    p.add_argument("--model", default="llama-3-8b", help="a preset, .gguf or HF folder (only its shape is read)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    p.add_argument("--bandwidth", type=float, default=3.35, help="memory bandwidth in TB/s for the floor")
    p.add_argument("--share", type=float, nargs="+", default=[0.1, 0.25],
                   help="report the token count where extra elementwise bytes reach this share of weight bytes")
    p.set_defaults(func=run)


def run(args) -> int:
    from kiln.loader import load_source

    cfg = load_source(args.model).config
    report = traffic(cfg, {"bf16": 2, "fp16": 2, "fp32": 4}[args.dtype])
    print(render(args.model, report, args.tokens, args.bandwidth, args.share))
    return 0
