"""Keep your own training loop: ``pipeweave.Pipeline`` trains one mini-batch per ``step(batch)`` call.

    python examples/own_loop.py                                            # starts 2 processes itself
    torchrun --standalone --nproc-per-node 2 examples/own_loop.py          # or under torchrun

As torch.distributed.pipelining's ``schedule.step()``: every rank builds the
``Pipeline`` from the same configuration once its process group exists, and
calls ``step((inputs, targets))`` with the same mini-batch (the ranks of the
first and last stages read it); the loss comes back on the rank of the last
stage, None on the others. The loop -- data, how many steps, logging,
stopping -- is yours.
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pipeweave

RANKS, STEPS, BATCH = 2, 8, 16


def batches():
    """Your own data: mini-batches of (inputs, targets) for the gpt's next-token loss (tokens are bytes)."""
    text = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 64))
    windows = text.unfold(0, 17, 5)  # (samples, 17) windows of the text
    for k in range(STEPS):
        chunk = windows[(k * BATCH) % (len(windows) - BATCH):][:BATCH]
        yield chunk[:, :-1], chunk[:, 1:]


def train(rank: int, world: int) -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    config = pipeweave.TrainConfig(schedule="1f1b", num_stages=RANKS, num_microbatches=4, batch_size=BATCH,
                                   optimizer="adamw", lr=3e-3, model=pipeweave.models.ModelSpec(
                                       kind="gpt", layers=2, hidden=32, heads=2, seq_len=16))
    pipe = pipeweave.Pipeline(config)
    for step, batch in enumerate(batches()):
        loss = pipe.step(batch)
        if loss is not None:  # the rank of the last stage
            print(f"step {step} loss {loss:.4f} (rank {dist.get_rank()})", flush=True)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    if "RANK" in os.environ:  # torchrun started this process and set the rendezvous
        dist.init_process_group("gloo")
        train(dist.get_rank(), dist.get_world_size())
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        mp.spawn(train, args=(RANKS,), nprocs=RANKS)
