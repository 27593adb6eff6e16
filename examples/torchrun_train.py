"""A launch script for torchrun: every process runs this file and joins the group torchrun formed.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_train.py
    # two nodes: torchrun --nnodes 2 --node-rank 0|1 --nproc-per-node 1 --rdzv-backend c10d \\
    #     --rdzv-endpoint HOST:29500 examples/torchrun_train.py

Without torchrun (``python examples/torchrun_train.py``) the same script starts
its 2 ranks itself. torchrun's world must be the run's: here 2 stages x 1.
"""

import os
import tempfile

import pipeweave

STEPS = 6

config = pipeweave.TrainConfig(schedule="interleaved-1f1b", num_stages=2, num_chunks=2, num_microbatches=4,
                               batch_size=8, steps=STEPS, optimizer="adamw", lr=3e-3,
                               model=pipeweave.models.ModelSpec(kind="gpt", layers=4, hidden=32, heads=2, seq_len=16))

if __name__ == "__main__":
    record = pipeweave.train(config, quiet=True, out=tempfile.mkdtemp())  # under torchrun: joins its group
    if record is not None:  # rank 0 holds the gathered record
        where = "under torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "spawned"
        print(f"{config.schedule.name} on {len(record.ranks)} ranks ({where}): "
              f"loss {record.losses[0]:.3f} -> {record.losses[-1]:.3f} after {STEPS} steps")
