"""Megatron-LM's Table 1 (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC21): ten GPT models on DGX A100 nodes, their split and their measured TFLOP/s per GPU.

The table gives the model, TP, PP, GPUs, batch and TFLOP/s; the microbatch size,
the interleaving (layers per virtual stage) and the data-parallel implementation
of each run are those of the paper's own launch script,
``examples/sc21/run_table_1.sh`` in NVIDIA/Megatron-LM: every run recomputes
every block ("--recompute-method uniform"), the four runs without a pipeline use
PyTorch's DDP (gradient all-reduce overlapped with the backward), the six with
one Megatron's "local" DDP (the all-reduce after the backward), and 76B, 145B,
310B and 530B interleave 5, 5, 3 and 1 layers per virtual stage (v = 3, 2, 2, 3).
TFLOP/s count equation 3 (``planner.flops.step_flops`` with full recomputation).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeweave.planner.candidate import Config
from pipeweave.planner.transformer import MODELS, Transformer


@dataclass(frozen=True)
class Row:
    """One row of Table 1 and its run's settings."""

    model: str
    tp: int
    pp: int
    gpus: int
    batch: int
    microbatch_size: int
    chunks: int
    tflops_per_gpu: float
    """Published: achieved TFLOP/s per GPU."""

    @property
    def transformer(self) -> Transformer:
        return MODELS[self.model]

    @property
    def overlap_dp(self) -> bool:
        """PyTorch DDP (overlapped) without a pipeline, Megatron's local DDP (after the backward) with one."""
        return self.pp == 1

    def config(self) -> Config:
        """The published configuration in the planner's terms."""
        dp = self.gpus // (self.tp * self.pp)
        schedule = "1f1b" if self.chunks == 1 else "interleaved-1f1b"
        return Config(
            tp=self.tp,
            pp=self.pp,
            dp=dp,
            chunks=self.chunks,
            microbatch_size=self.microbatch_size,
            microbatches=self.batch // (dp * self.microbatch_size),
            schedule=schedule,
            recompute="full",
            zero=0,
        )


TABLE_1 = (
    Row("gpt-1.7b", 1, 1, 32, 512, 16, 1, 137.0),
    Row("gpt-3.6b", 2, 1, 64, 512, 16, 1, 138.0),
    Row("gpt-7.5b", 4, 1, 128, 512, 16, 1, 142.0),
    Row("gpt-18b", 8, 1, 256, 1024, 8, 1, 135.0),
    Row("gpt-39b", 8, 2, 512, 1536, 4, 1, 138.0),
    Row("gpt-76b", 8, 4, 1024, 1792, 2, 3, 140.0),
    Row("gpt-145b", 8, 8, 1536, 2304, 2, 2, 148.0),
    Row("gpt-310b", 8, 16, 1920, 2160, 1, 2, 155.0),
    Row("gpt-530b", 8, 35, 2520, 2520, 1, 3, 163.0),
    Row("gpt-1t", 8, 64, 3072, 3072, 1, 1, 163.0),
)
"""The ten rows; the first four have no pipeline (calibration), the last six have one (prediction)."""
CALIBRATION = TABLE_1[:4]
PREDICTION = TABLE_1[4:]
