"""What `kiln bisect` prints: each stage's numerics and tokens against eager, and the verdict."""

from __future__ import annotations

from kiln.tools.bisect.stages import REFERENCE, BisectReport, StageResult


def render(report: BisectReport) -> str:
    r = report
    lines = [
        f"kiln bisect: {r.model}, {r.dtype} on {r.device}; prompt {r.prompt!r} ({r.prompt_tokens} tokens)",
        f"graph: {r.pieces} pieces around {r.regions} opaque regions (split at {', '.join(r.split_ops)})",
        f"tolerance: relative error ‖a−b‖/‖b‖ <= {r.tolerance:.0e}; "
        f"tokens: {r.new_tokens} greedy, against eager",
        "",
        f"{'stage':<13} {'numerics (relative error)':<52} {'tokens':<24} whole model ran as",
    ]
    reference = r.stages[0].tokens or []
    for s in r.stages:
        lines.append(f"{s.name:<13} {_numerics(s, r.tolerance):<52} {_tokens(s, reference):<24} {s.token_route}")
    lines.append("")
    lines += _verdict(r, reference)
    return "\n".join(lines)


def _numerics(s: StageResult, tol: float) -> str:
    if s.name == REFERENCE:
        return "reference"
    if s.failed:
        return "COMPILE FAILED"
    verdict = "ok" if s.error <= tol else "DIVERGES"
    if s.worst_piece is None:
        return f"{s.error:.1e} (whole model) {verdict}"
    return f"{s.error:.1e} (worst: {s.worst_piece}; model {s.model_error:.1e}) {verdict}"


def _tokens(s: StageResult, reference: list[int]) -> str:
    if s.name == REFERENCE:
        return "reference"
    if s.tokens is None:
        return "not run"
    at = _first_difference(s.tokens, reference)
    return "equal" if at is None else f"DIFFER from token {at}"


def _verdict(r: BisectReport, reference: list[int]) -> list[str]:
    lines = []
    first = r.first_divergence
    if first is None:
        lines.append(f"numerics: every stage within {r.tolerance:.0e}")
        for s in r.stages[2:]:
            if s.model_error is not None and s.model_error > r.tolerance:
                lines.append(f"  {s.name}: each piece is within it, but the errors add up to {s.model_error:.1e} "
                             f"over the whole model (pieces chained)")
    elif first.failed:
        lines.append(f"numerics: {first.name} could not compile {first.failed}")
    elif first.divergence is None:
        lines.append(f"numerics: first divergence at {first.name}: the whole model, {first.error:.1e}")
    else:
        d = first.divergence
        lines += [f"numerics: first divergence at {first.name}, piece {d.piece} ({d.error:.1e})",
                  f"  piece {d.piece}: {d.where.modules}", f"    starts at {d.where.source}"]
        if d.op is None:
            lines.append("  no single op diverges on its own: the piece diverges only compiled as a whole")
        else:
            o = d.op
            lines += [f"  first op: {o.node} = {o.op}({o.args})  ({o.error:.1e})",
                      f"    in {o.where.modules or '?'} at {o.where.source or '?'}"]
    for s in r.stages[1:]:
        if s.tokens is not None and _first_difference(s.tokens, reference) is not None:
            at = _first_difference(s.tokens, reference)
            lines.append(f"tokens: {s.name} differs from eager at generated token {at}: "
                         f"{_text(r, reference[at:])!r} vs {_text(r, s.tokens[at:])!r}")
    if all(s.tokens is None or _first_difference(s.tokens, reference) is None for s in r.stages):
        lines.append(f"tokens: every stage equals eager: {_text(r, reference)!r}")
    return lines


def _text(r: BisectReport, tokens: list[int]) -> str:
    return r.decode(tokens) if r.decode else " ".join(map(str, tokens))


def _first_difference(a: list[int], b: list[int]) -> int | None:
    shorter = None if len(a) == len(b) else min(len(a), len(b))
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), shorter)


def to_json(report: BisectReport) -> dict:
    from dataclasses import asdict, replace

    out = asdict(replace(report, decode=None))
    out.pop("decode")
    out["first_divergence"] = report.first_divergence.name if report.first_divergence else None
    return out
