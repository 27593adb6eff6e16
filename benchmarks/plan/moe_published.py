"""The planner's prediction of a published mixture-of-experts run, set beside its published throughput.

DeepSeek-V3 (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv 2412.19437, 2024): 2048 H800 GPUs, 8 a
node (NVLink ~160 GB/s, InfiniBand 50 GB/s per GPU: its section 3.1); PP 16 with DualPipe, EP 64 over 8
nodes, ZeRO-1 data parallelism, no TP (section 3.2); sequences of 4096, a batch growing to 15,360 (section
4.2); 180K H800 GPU hours per trillion tokens (section 1), i.e. 1e12 / (180e3 x 3600) = 1543 tokens a second
a GPU. Its shape, as the planner can write it (a llama with experts): 61 blocks, h 7168, 128 heads, experts
of SwiGLU 2048, 256 routed, top-8, and the shared expert counted as a ninth routed one (k = 9); vocabulary
129,280. What the planner's shape leaves out: MLA (taken as multi-head attention of 128 heads of 56), the
first three blocks' dense MLP (18,432 = 9 x 2048: the same FLOPs), multi-token prediction, FP8 GEMMs (the
prediction is given at the BF16 peak and at FP8's, twice it), the node-limited routing.

Run: PYTHONPATH=src python benchmarks/plan/moe_published.py
"""

from __future__ import annotations

from pipeweave.planner.candidate import Config
from pipeweave.planner.costs import Cluster
from pipeweave.planner.efficiency import A100_CALIBRATED
from pipeweave.planner.evaluate import Evaluator
from pipeweave.planner.hardware import custom_gpu
from pipeweave.planner.transformer import LLAMA, Transformer

DEEPSEEK_V3 = Transformer(
    name="deepseek-v3",
    layers=61,
    hidden=7168,
    heads=128,
    ffn_hidden=2048,
    seq_len=4096,
    vocab=129280,
    moe_experts=256,
    moe_top_k=9,
    **LLAMA,
)
PUBLISHED_TOKENS_PER_GPU = 1e12 / (180e3 * 3600)
BATCH = 15360


def predict(peak_tflops: float) -> tuple[float, float, bool]:
    """(tokens a second a GPU, step seconds, whether the planner's memory fits 80 GiB) at ``peak_tflops``."""
    gpu = custom_gpu(
        peak_tflops=peak_tflops,
        memory_gib=80,
        intra_node_gbps=160 * 8,
        inter_node_gbps=400,
        gpus_per_node=8,
        memory_tbps=3.35,
    )
    evaluator = Evaluator(
        cluster=Cluster(model=DEEPSEEK_V3, gpu=gpu, efficiency=A100_CALIBRATED), batch=BATCH, overlap=True
    )
    config = Config(
        tp=1,
        pp=16,
        dp=128,
        ep=64,
        chunks=1,
        microbatch_size=1,
        microbatches=BATCH // 128,
        schedule="dualpipe",
        recompute="none",
        zero=1,
    )
    result = evaluator.evaluate(config, time_unfit=True)
    assert result is not None
    tokens = BATCH * DEEPSEEK_V3.seq_len / result.step_time / config.gpus
    return tokens, result.step_time, result.fits


def main() -> None:
    print(f"DeepSeek-V3 published: {PUBLISHED_TOKENS_PER_GPU:.0f} tokens/s/GPU")
    for label, peak in (("BF16 peak 989 TFLOP/s", 989.0), ("FP8 peak 1979 TFLOP/s", 1979.0)):
        tokens, step, fits = predict(peak)
        off = 100 * (tokens / PUBLISHED_TOKENS_PER_GPU - 1)
        print(f"predicted at {label}: {tokens:.0f} tokens/s/GPU ({off:+.1f} %), step {step:.2f} s, fits: {fits}")


if __name__ == "__main__":
    main()
