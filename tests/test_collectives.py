"""kiln's collective ops on two gloo processes: values, and torch.library.opcheck (schema,
fake implementations, AOT dispatch with dynamic shapes) on a real two-rank group."""

import tempfile

import torch
import torch.multiprocessing as mp

ROWS, COLS = 6, 4


def _check_on_rank(rank: int, size: int, init_method: str) -> None:
    from kiln.distributed import destroy_tensor_parallel, init_tensor_parallel

    state = init_tensor_parallel(rank, size, "gloo", init_method)
    ops = torch.ops.kiln
    # Rank r holds x + r, so the sum over ranks is size * x + sum(range(size)).
    x = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    mine = x + rank
    total = size * x + sum(range(size))
    rows = ROWS // size
    torch.testing.assert_close(ops.all_reduce(mine, state.group_name), total)
    torch.testing.assert_close(ops.reduce_scatter(mine, state.group_name), total[rank * rows:(rank + 1) * rows])
    torch.testing.assert_close(ops.all_gather(mine, state.group_name),
                               torch.cat([x + r for r in range(size)]))
    for op in (ops.all_reduce, ops.reduce_scatter, ops.all_gather):
        torch.library.opcheck(op, (mine, state.group_name))
    destroy_tensor_parallel()


def test_collectives_on_two_gloo_ranks():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_check_on_rank, args=(2, f"file://{tmp}/store"), nprocs=2)
