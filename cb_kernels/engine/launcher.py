"""Starting the ranks of a tensor-parallel run on one machine (the CLI and the tests use it when
not under torchrun): torch.multiprocessing processes, each with a gloo process group."""
from __future__ import annotations

import datetime
import os
import socket

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, size: int, port: int, timeout_s: float, threads: int, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
    fn(rank, *args)
    # Leave together, with no engine (whose groups sit in reference cycles) left for the
    # interpreter's teardown: gloo objects freed that late can abort the process.
    import gc

    torch.distributed.barrier()
    gc.collect()
    torch.distributed.destroy_process_group()


def spawn(fn, size: int, args: tuple = (), timeout_s: float = 300.0) -> None:
    """Run fn(rank, *args) in `size` new processes on this machine (torch.multiprocessing), each
    with a gloo process group of `size` ranks and 1/size of the CPU threads; returns when all end,
    raises if one fails (torch.multiprocessing.ProcessRaisedException names the rank)."""
    import torch.multiprocessing as mp

    threads = max(1, torch.get_num_threads() // size)
    mp.start_processes(_rank_main, args=(size, free_port(), timeout_s, threads, fn, args),
                       nprocs=size, join=True, start_method="spawn")
