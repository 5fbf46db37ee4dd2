"""Tensor parallelism on CPU: gloo processes, fp32, against the same model on one process.

Random-weight models draw every tensor whole and each rank keeps its shard, so TP=1 and
TP=N run the same weights. Sharding changes only the order of sums (each rank's partial
matmul, then the all-reduce), so logits agree to float rounding. Measured max |diff|:
1.5e-7 on tiny-llama at TP=2 (logits within 0.64), 1.2e-4 on SmolLM2's real weights at
TP=3 (logits up to 36, so 3e-6 relative); the bounds are 1e-5 and 1e-3. Greedy tokens
must be equal.
"""

import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.distributed import building_for, destroy_tensor_parallel
from kiln.distributed.launcher import Workers, join_as_rank0
from kiln.forward_context import set_forward_context
from kiln.loader import load_source
from kiln.models import build_model

PROMPTS = [[1, 5, 9, 200, 301, 17], [7, 8], list(range(3, 40))]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
TOKENS = torch.tensor([1, 15, 300, 7, 42, 99, 3, 250])


def _logits(model_name: str, ids: torch.Tensor) -> torch.Tensor:
    """One forward of the whole prompt (no KV cache) on the model built for the current rank."""
    source = load_source(model_name)
    model = build_model(source.config, torch.float32, torch.device("cpu"), frozenset(),
                        source.weights() if source.weights else None)
    with torch.inference_mode(), set_forward_context(None, {}):
        return model.compute_logits(model(ids, torch.arange(len(ids))))


def _logits_worker(state, conn, model_name: str, ids: torch.Tensor) -> None:
    with building_for(state):
        conn.send(_logits(model_name, ids))
    conn.recv()  # None: stop


@contextlib.contextmanager
def _tensor_parallel_logits(size: int, model_name: str, ids: torch.Tensor):
    """Logits of every rank of a `size`-rank group, this process being rank 0."""
    workers = Workers(size, "cpu", _logits_worker, (model_name, ids))
    try:
        state = join_as_rank0(workers)
        with building_for(state):
            rank0 = _logits(model_name, ids)
        yield [rank0, *workers.gather()]
    finally:
        workers.shutdown()
        destroy_tensor_parallel()


@pytest.mark.parametrize("model_name, size, atol", [("tiny-llama", 2, 1e-5), ("smollm2", 3, 1e-3)])
def test_tensor_parallel_logits_match_one_process(model_name, size, atol):
    want = _logits(model_name, TOKENS)
    with _tensor_parallel_logits(size, model_name, TOKENS) as per_rank:
        for rank, got in enumerate(per_rank):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=f"rank {rank}")
        assert all(torch.equal(got, per_rank[0]) for got in per_rank), "ranks disagree on the gathered logits"
    assert torch.equal(_logits(model_name, TOKENS), want), "the process is not back to one rank"


@pytest.fixture(scope="module")
def one_process_tokens():
    llm = LLM("tiny-llama", device="cpu", num_kv_blocks=64)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_llm_generate_tp2_equals_tp1(one_process_tokens):
    llm = LLM("tiny-llama", device="cpu", num_kv_blocks=64, tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == one_process_tokens
        # Continuous batching across steps: a second round on the same engine and workers.
        assert [o.token_ids for o in llm.generate(PROMPTS[::-1], GREEDY)] == one_process_tokens[::-1]
    finally:
        llm.shutdown()
    assert not multiprocessing.active_children()


def test_llm_generate_tp2_compiled(one_process_tokens):
    """-O2 on two ranks: the row-parallel all-reduce is traced as an op inside the compiled
    pieces (not a split point), and the tokens are those of one eager process."""
    llm = LLM("tiny-llama", device="cpu", num_kv_blocks=64, max_num_batched_tokens=64,
              tensor_parallel_size=2, compilation={"mode": 3})
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == one_process_tokens
        program = llm.engine.runner.compiled.backend.program
        assert len(program.slots) == llm.engine.source.config.num_layers + 1  # split at attention only
        reduces = [n for piece in program.uniques for n in piece.graph.graph.nodes
                   if n.op == "call_function" and "kiln.all_reduce" in str(n.target)]
        assert reduces, "no all-reduce inside the compiled pieces"
    finally:
        llm.shutdown()


def test_indivisible_model_is_a_startup_error():
    # SmolLM2 has 9 heads and 3 kv heads: two ranks cannot share them.
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide num_heads=9, "
                                         r"num_kv_heads=3.*sizes that divide all .*: 1, 3$"):
        LLM("smollm2", device="cpu", tensor_parallel_size=2)
    assert not multiprocessing.active_children(), "workers were started before the check"


@pytest.mark.parametrize("size", [0, -1, True, 1.5, "2"])
def test_bad_tensor_parallel_size(size):
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM("tiny-llama", device="cpu", tensor_parallel_size=size)


def test_tp_decode_benchmark_runs_on_cpu(tmp_path):
    """benchmarks/tp_decode.py's CPU path (the GPU run is the lead's): one row per TP size."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "tp_decode.py"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--model", "tiny-llama", "--tp", "1", "2",
                           "--modes", "eager", "--batches", "2", "--context", "16", "--steps", "2",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "tp_decode_tiny-llama_cpu.json").read_text())
    assert [(r["tp"], r["mode"], len(r["points"])) for r in result["runs"]] == [(1, "eager", 1), (2, "eager", 1)]
    assert set(result["floor"]) == {"tp1", "tp2"}


def _failing_worker(state, conn) -> None:
    raise RuntimeError("worker boom")


def test_a_worker_failure_reaches_rank0_with_its_traceback():
    workers = Workers(2, "cpu", _failing_worker, ())
    try:
        state = join_as_rank0(workers)
        with pytest.raises(RuntimeError, match=r"(?s)rank 1 failed:.*worker boom"):
            # Rank 0's collective fails once the worker has gone; the worker's own error is the news.
            try:
                torch.ops.kiln.all_reduce(torch.ones(2), state.group_name)
            except RuntimeError:
                workers.raise_failure(timeout_s=5)
                raise
    finally:
        workers.shutdown()
        destroy_tensor_parallel()


def test_a_failed_worker_leaves_at_once_and_rank0_notices(caplog):
    """A worker that fails exits without tearing its group down (an NCCL teardown would wait
    for rank 0, which may be waiting for it); rank 0's watch sees it go."""
    import logging
    import time

    workers = Workers(2, "cpu", _failing_worker, ())
    try:
        join_as_rank0(workers)
        with caplog.at_level(logging.ERROR, logger="kiln"), workers.watching():
            proc = workers._procs[0]
            proc.join(timeout=60)
            assert proc.exitcode == 1
            time.sleep(1.0)  # the watch polls twice a second
        assert "tensor-parallel rank 1 exited (code 1) while rank 0 was starting" in caplog.text
        with pytest.raises(RuntimeError, match=r"(?s)rank 1 failed:.*worker boom"):
            workers.raise_failure(timeout_s=5)
    finally:
        workers.shutdown()
        destroy_tensor_parallel()


def test_a_worker_killed_mid_request_fails_the_open_requests_and_stops_the_engine():
    import asyncio
    import os
    import signal

    from kiln.config import EngineConfig
    from kiln.engine.async_engine import AsyncEngine, EngineNotReady, RequestAborted
    from kiln.engine.errors import EngineDead

    long = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
    lost = r"the engine stopped: tensor-parallel rank 1 exited \(killed by SIGKILL\) during a step"

    async def main():
        failures = []
        engine = AsyncEngine(EngineConfig(model="tiny-llama", device="cpu", dtype="float32", tensor_parallel_size=2))
        engine.start(failures.append)
        while not engine.ready:
            assert engine.failure is None
            await asyncio.sleep(0.05)
        streams = [await engine.add_request(prompt, long) for prompt in ([1, 2, 3], [4, 5])]
        await streams[0].__anext__()  # both run now
        workers = engine.engine.runner.workers
        os.kill(workers._procs[0].pid, signal.SIGKILL)
        for stream in streams:
            with pytest.raises(RequestAborted, match=lost):
                async for _ in stream:
                    pass
        for _ in range(100):  # on_failure runs in the engine thread, after the streams got their errors
            if failures:
                break
            await asyncio.sleep(0.05)
        assert isinstance(engine.failure, EngineDead) and failures == [engine.failure]
        assert "start it again" in str(engine.failure)
        with pytest.raises(EngineNotReady, match="the engine failed: tensor-parallel rank 1 exited"):
            await engine.add_request([1], long)
        await engine.shutdown()
        assert workers._procs == []  # the engine let go of its (dead) worker and left the group

    asyncio.run(main())


def test_a_script_without_a_main_guard_runs_tensor_parallel(tmp_path):
    """The workers are spawned without re-running the caller's script (kiln.compile.spawn): no
    `if __name__ == "__main__"` guard is needed around a tensor-parallel LLM (with plain
    spawn this script hung: each worker ran it and started workers of its own)."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        "print('main ran', flush=True)\n"
        "from kiln import LLM, SamplingParams\n"
        "llm = LLM('tiny-llama', device='cpu', num_kv_blocks=64, tensor_parallel_size=2)\n"
        "out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))\n"
        "print('tokens', len(out[0].outputs[0].token_ids), flush=True)\n"
        "llm.shutdown()\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KILN_LOGGING_LEVEL": "WARNING"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["main ran", "tokens 3"]
