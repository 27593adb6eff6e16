"""A schedule written by hand as CSV: read, validated, simulated, then trained on 2 ranks.

    python examples/custom_schedule.py

One row per rank, one action per cell: ``<stage><op><microbatch>`` with F
forward, I and W the two halves of a backward (B: both), U the optimizer
update -- torch.distributed.pipelining's CSV form. This one is ZB-H1 (Qi et
al. 2024) written out: the last rank sends each input gradient I at once and
runs the weight gradient W later, where it would otherwise wait, so rank 0's
backward starts sooner. The same from the command line:
``pipeweave simulate --schedule-file FILE`` and ``pipeweave train --schedule-file FILE``.
"""

import tempfile
from pathlib import Path

import pipeweave
from pipeweave.schedule import read_csv

CSV = """\
0F0,0F1,0I0,0W0,0F2,0I1,0W1,0F3,0I2,0W2,0I3,0W3,0U0
1F0,1I0,1F1,1I1,1W0,1F2,1I2,1W1,1F3,1I3,1W2,1W3,1U0
"""

if __name__ == "__main__":
    path = Path(tempfile.mkdtemp()) / "zb_by_hand.csv"
    path.write_text(CSV)
    schedule = read_csv(path)  # validated when simulated and before a run is built
    sim = pipeweave.simulate(schedule, cost=pipeweave.CostModel(f=1.0, b=1.0, w=1.0))
    print(sim.text(width=60))
    onef1b = pipeweave.simulate("1f1b", 2, 4, cost=pipeweave.CostModel(f=1.0, b=1.0, w=1.0))
    print(f"bubble: by hand {sim.metrics.bubble_ratio:.3f}, 1f1b {onef1b.metrics.bubble_ratio:.3f}")

    config = pipeweave.TrainConfig(schedule_path=str(path), batch_size=8, steps=4,
                                   model=pipeweave.models.ModelSpec(kind="mlp", layers=4, hidden=16))
    record = pipeweave.train(config, quiet=True, out=tempfile.mkdtemp())
    print(f"trained {path.name}: loss {record.losses[0]:.4f} -> {record.losses[-1]:.4f}")
