"""Start the other ranks of a tensor-parallel group from the calling process.

The caller is rank 0; ranks 1..size-1 are spawned here (kiln.compile.spawn: a
forked CUDA context is unusable), one per GPU on CUDA or one gloo process
each on CPU. Every rank joins the same process group through a file store in a temporary
directory, so no port has to be free. Rank 0 talks to each worker through a pipe: a
message goes out, a worker answers when asked to, and a worker that fails sends its
traceback back instead, so the error shows in the caller, not only on a worker's stderr.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.distributed.parallel_state import TensorParallelState, destroy_tensor_parallel, init_tensor_parallel
from kiln.compile.spawn import SpawnContext

logger = logging.getLogger("kiln")

# How long shutdown waits for a worker to leave its loop before terminating it.
_JOIN_TIMEOUT_S = 30.0


@dataclass
class WorkerFailure:
    rank: int
    traceback: str


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


class Workers:
    """Ranks 1..size-1 of a tensor-parallel group, each running `target(state, conn, *args)`.

    `target` runs in the worker after it joined the group; it reads messages from `conn`
    (None means stop) and may send replies. It must be importable by name (spawn pickles it).
    """

    def __init__(self, size: int, device_type: str, target: Callable, args: tuple):
        ctx = SpawnContext()  # not mp.get_context("spawn"): see kiln.compile.spawn
        self.size = size
        self.backend = backend_for(device_type)
        self._store_dir = tempfile.mkdtemp(prefix="kiln-tp-")
        self.init_method = f"file://{self._store_dir}/store"
        self._conns, self._procs = [], []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, name=f"kiln-tp-rank{rank}",
                               args=(target, rank, size, self.backend, self.init_method, theirs, args))
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)
        atexit.register(self.shutdown)

    def send(self, message) -> None:
        """The same message to every worker."""
        for conn in self._conns:
            conn.send(message)

    def gather(self) -> list:
        """One reply from every worker, in rank order; a worker's failure is raised here."""
        replies = []
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            try:
                reply = conn.recv()
            except EOFError:
                proc.join(timeout=5)
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.exitcode}) "
                                   f"without answering; its stderr says why") from None
            if isinstance(reply, WorkerFailure):
                raise RuntimeError(f"tensor-parallel rank {reply.rank} failed:\n{reply.traceback}")
            replies.append(reply)
        return replies

    @contextlib.contextmanager
    def watching(self):
        """While inside, a worker that exits makes rank 0's collectives fail instead of
        waiting for it forever: NCCL has no notion of a dead peer, so the group is aborted
        (gloo's collectives fail by themselves when a peer's connection closes)."""
        stop = threading.Event()

        def watch():
            while not stop.wait(0.5):
                dead = [(rank, p.exitcode) for rank, p in enumerate(self._procs, start=1) if p.exitcode is not None]
                if dead:
                    logger.error("tensor-parallel rank %d exited (code %s) while rank 0 was starting; its "
                                 "traceback is above. Aborting the process group.", *dead[0])
                    abort = getattr(torch.distributed.distributed_c10d, "_abort_process_group", None)
                    if self.backend == "nccl" and abort is not None:
                        abort()
                    return

        watcher = threading.Thread(target=watch, name="kiln-tp-watch", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            stop.set()
            watcher.join()

    def raise_failure(self, timeout_s: float) -> None:
        """Raise the first failure a worker reported within `timeout_s`, if any: rank 0's own
        error (a collective whose peer left) says less than the worker's traceback."""
        for conn in self._conns:
            try:
                reply = conn.recv() if conn.poll(timeout_s) else None
            except (EOFError, OSError):
                continue
            if isinstance(reply, WorkerFailure):
                raise RuntimeError(f"tensor-parallel rank {reply.rank} failed:\n{reply.traceback}")

    def exited(self, timeout_s: float) -> list[tuple[int, str]]:
        """(rank, how it exited) of every worker that has exited, waiting up to `timeout_s` for the
        first (a killed process is reaped a moment after its sockets close)."""
        deadline = time.monotonic() + timeout_s
        while True:
            gone = [(rank, _exit_status(p.exitcode)) for rank, p in enumerate(self._procs, start=1)
                    if p.exitcode is not None]
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.05)

    def shutdown(self) -> None:
        """Ask every worker to stop, wait for it, terminate the ones that do not."""
        atexit.unregister(self.shutdown)
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass  # already gone
        # Leave the group while the workers leave theirs, not after they exit: if tearing down
        # an NCCL communicator waits for its peers (suspected of the hang seen on 2xH200, not
        # confirmed), rank 0 waiting on the workers first would deadlock with it.
        destroy_tensor_parallel()
        for proc in self._procs:
            proc.join(timeout=_JOIN_TIMEOUT_S)
            if proc.is_alive():
                logger.warning("tensor-parallel worker %s did not stop in %.0f s; terminating it",
                               proc.name, _JOIN_TIMEOUT_S)
                proc.terminate()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        shutil.rmtree(self._store_dir, ignore_errors=True)


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def join_as_rank0(workers: Workers) -> TensorParallelState:
    """The calling process joins the group its workers are joining, as rank 0."""
    if workers.backend == "nccl":
        torch.cuda.set_device(0)
    return init_tensor_parallel(0, workers.size, workers.backend, workers.init_method)


def _worker_main(target: Callable, rank: int, size: int, backend: str, init_method: str, conn,
                 args: tuple) -> None:
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        state = init_tensor_parallel(rank, size, backend, init_method)
        target(state, conn, *args)
    except EOFError:
        pass  # rank 0 went away: nothing left to serve
    except BaseException:
        traceback.print_exc()
        try:
            conn.send(WorkerFailure(rank, traceback.format_exc()))
        except (BrokenPipeError, OSError):
            pass
        # Leave without tearing the group down: rank 0 may be waiting in a collective with
        # this rank, and an NCCL teardown would wait for it (the hang seen on 2xH200). Rank 0
        # sees this process exit (Workers.watching) and aborts its side.
        sys.stderr.flush()
        os._exit(1)
    destroy_tensor_parallel()
