"""``pipeweave train``: train a model with a schedule on local ranks (or under torchrun), measured.

With no arguments it trains the byte-level gpt on the Python standard
library's sources, on 2 ranks with a zero-bubble schedule where the registry
has one (1F1B otherwise), shows a progress bar, and ends with a summary --
loss first -> last, throughput, measured beside simulated bubble, memory per
rank -- and a JSON record, a Chrome trace and a timeline plot under
``./pipeweave-out/``.

Asynchronous schedules (pipedream, pipedream-2bw, pipemare, spectrain, xpipe,
ampnet, wpipe, avgpipe) run as one stream of ``--steps`` mini-batches
(``runtime.stream``), drained and restarted where ``--eval-every`` or
``--save-every`` stop it; their options are in the "asynchronous schedules" group
of ``--help``, and the summary shows the steady-state bubble and the weight
bytes held (every version and buffer) beside the simulator's.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipeweave.commands.stash_options import add_stash_arguments
from pipeweave.commands.partition import add_model_arguments, add_partition_arguments
from pipeweave.commands.recompute_options import add_recompute_argument
from pipeweave.commands.schedule_file import add_schedule_file_argument
from pipeweave.commands.stream_options import add_async_arguments

DEFAULT_OUT = Path("pipeweave-out")


# An argparse declaration, kept as one list of options (exempt from the 60-line rule for functions).
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "train", help="train a model with a pipeline schedule on local ranks, measured",
        description="Train on torch.distributed with any schedule; measure bubble, memory, throughput. "
        "An asynchronous schedule runs as one stream of --steps mini-batches, drained where --eval-every or "
        "--save-every stop it.",
    )
    p.add_argument("-s", "--schedule", help="schedule name (default: zb-h1 if registered, else 1f1b)")
    add_schedule_file_argument(p)
    p.add_argument("--stages", type=int, help="D, pipeline ranks (default 2)")
    p.add_argument("--microbatches", type=int, help="T, microbatches per step (default 4)")
    p.add_argument("--chunks", type=int, help="v, chunks per rank, for schedules that take it")
    add_model_arguments(p)
    add_partition_arguments(p)
    p.add_argument("--data-parallel", type=int, default=1, metavar="P",
                   help="pipeline replicas, gradients all-reduced across them; ranks P x D (default 1)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="processes splitting every stage's layers (Megatron's tensor parallelism); "
                        "processes P x D x N on one device mesh (default 1)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tensor-parallel N > 1 (gpt): layer norms and residual adds on 1/N of the sequence, "
                        "all-gather/reduce-scatter instead of all-reduce (Korthikanti et al. 2022)")
    p.add_argument("--zero", type=int, default=0, metavar="STAGE",
                   help="ZeRO stage of data parallelism: 0 (none), 1 (optimizer state sharded over the P "
                        "replicas) or 3 (parameters too: gathered before each F, B, I and freed after) (default 0)")
    p.add_argument("--bucket-mb", type=float, default=25.0, metavar="MIB",
                   help="MiB of gradients per all-reduce across replicas (default 25)")
    p.add_argument("--batch", "--batch-size", dest="batch", type=int, default=16,
                   help="samples per step, split into T microbatches (default 16)")
    p.add_argument("--data", metavar="FILE", help="gpt: a text file to train on (default: the stdlib sources)")
    p.add_argument("--min-seq-len", type=int, metavar="N",
                   help="sequences of variable length (gpt, hf:TYPE, your own model of sequences), as a dataset "
                        "without packing gives them: each microbatch cut to its own length drawn from [N, --seq-len "
                        "or the dataset's length], sent between ranks as it is, not padded")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--lr", type=float, help="learning rate (default 3e-3 for adamw, 0.1 for sgd)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), help="default sgd for the mlp, adamw otherwise")
    p.add_argument("--lr-schedule", choices=("constant", "cosine", "linear"), default="constant",
                   help="after --lr-warmup, keep --lr or decay it to a tenth by --lr-decay-steps (default constant); "
                        "an asynchronous schedule counts each stage's updates as steps")
    p.add_argument("--lr-warmup", type=int, default=0, metavar="N",
                   help="steps of linear warm-up to --lr (default 0)")
    p.add_argument("--lr-decay-steps", type=int, metavar="N",
                   help="the step where the decay ends (default: the last step, or a stream's last update, of "
                        "this run; give the same one when resuming)")
    add_recompute_argument(p, auto=True)
    add_stash_arguments(p, bandwidth=False)
    p.add_argument("--precision", default="fp32", metavar="fp32|bf16",
                   help="bf16: mixed precision, every forward under torch.autocast to bfloat16 (parameters, "
                        "gradients and optimizer state float32); default fp32")
    p.add_argument("--clip-grad-norm", type=float, default=None, metavar="NORM",
                   help="clip the global gradient norm; steps are post-validated (optimistic step, exact "
                        "rollback on NaN/inf or clipping), so no global barrier precedes the update; a NaN/inf "
                        "norm stops the run, or skips the step with --on-nonfinite skip; with "
                        "--tensor-parallel/--data-parallel: one all-reduce of the norm at each update instead")
    p.add_argument("--on-nonfinite", choices=("stop", "skip"), default="stop",
                   help="a step whose loss (or, with --clip-grad-norm, gradient norm) is NaN or inf: stop the run "
                        "there, exit code 1, the last checkpoint kept (default); or skip that step's update on every "
                        "stage and go on (synchronous schedules)")
    p.add_argument("--eval-every", type=int, metavar="N",
                   help="every N steps and after the last, the mean loss of held-out batches through a "
                        "forward-only pipeline (gpt: one block in 20 of the corpus, never trained on; a custom "
                        "model: its eval_dataset); an asynchronous schedule drains its stream there")
    p.add_argument("--eval-batches", type=int, default=4, metavar="K",
                   help="held-out batches per evaluation, the same every time (default 4)")
    p.add_argument("--save-pretrained", metavar="DIR",
                   help="hf:TYPE: after training, write the model with transformers' save_pretrained into DIR "
                        "(from_pretrained loads it)")
    p.add_argument("--save", metavar="DIR",
                   help="after the last step, write a checkpoint into DIR: a folder DIR/step-NNNNNN of every "
                        "part's parameters and optimizer state (and an asynchronous policy's state), made current "
                        "atomically once whole; a DIR holding another run's checkpoint is refused")
    p.add_argument("--save-every", type=int, metavar="N",
                   help="with --save: also write a checkpoint every N steps; an asynchronous schedule drains its "
                        "stream there")
    p.add_argument("--keep-checkpoints", type=int, default=2, metavar="K",
                   help="the newest checkpoints of this run kept in --save DIR (default 2)")
    p.add_argument("--overwrite", action="store_true",
                   help="save into a DIR holding another run's checkpoints, removing them once this run's first "
                        "checkpoint is whole")
    p.add_argument("--resume", metavar="DIR|auto",
                   help="start from the newest checkpoint in DIR (or from DIR/step-NNNNNN) and train --steps more "
                        "steps, the data going on from where it stopped; any schedule, D or partition of the same "
                        "model. auto: from the newest checkpoint in --save DIR if there is one, else from scratch, "
                        "--steps counting the whole training (for torchrun --max-restarts)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (default 1)")
    # Under torchrun no launcher watches the other node: the process-group timeout
    # is what ends a rank whose remote peer died, so it stays under the 30 s promise.
    p.add_argument("--timeout", type=float, default=25.0,
                   help="seconds a rank may wait on a peer before failing (default 25)")
    p.add_argument("--transport", choices=("auto", "gloo", "shm"), default="auto",
                   help="point-to-point messages of spawned CPU ranks: shm, shared-memory rings between the "
                        "ranks on this host (collectives stay on gloo), or gloo; auto (default): shm on x86-64 "
                        "with room in /dev/shm, gloo otherwise and under torchrun, NCCL on CUDA")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder of the default outputs (default ./pipeweave-out)")
    p.add_argument("--json", metavar="FILE", help="write the JSON record here (default OUT/train.json)")
    p.add_argument("--plot", metavar="FILE", help="write the measured timeline plot here (default OUT/timeline.png)")
    p.add_argument("--trace", metavar="FILE", help="write the Chrome trace here (default OUT/trace.json)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    p.add_argument("--log-dir", metavar="DIR",
                   help="write every step's loss, learning rate, throughput, bubble and memory as TensorBoard event "
                        "files into DIR (tensorboard --logdir DIR); needs pip install 'pipeweave[tensorboard]'")
    add_async_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Train (``commands.train_run``: imported here, so that parsing any subcommand needs no torch)."""
    from pipeweave.commands.train_run import train

    return train(args)
