"""What the planner leaves out of a prediction, said for the run at hand (``plan --explain``, ``--json``).

A prediction is a simulated schedule under modelled costs (``planner.costs``,
``planner.memory``); what those costs do not hold is listed here, each effect
only where the run has it: the effects of its model (FlashAttention, a large
vocabulary, a profile), of its configuration (TP, ZeRO, recomputation, a split
backward, a pipeline) and of its cluster (another GPU than the calibration's,
several nodes).
"""

from __future__ import annotations

from pipeweave.planner.candidate import Config
from pipeweave.planner.costs import Cluster
from pipeweave.planner.transformer import Transformer

CALIBRATED_ON = ("a100-80gb", "a100-40gb")
"""The GPUs of Megatron-LM's Table 1, on which the GEMM efficiency is fitted."""


def not_modelled(cluster: Cluster, config: Config | None) -> list[str]:
    """The effects the prediction of ``config`` on ``cluster`` leaves out (module docstring); ``config`` None:
    those of the model and the cluster only.

    Example:
        >>> from pipeweave.planner.efficiency import A100_CALIBRATED
        >>> from pipeweave.planner.hardware import GPUS
        >>> from pipeweave.planner.transformer import MODELS
        >>> c = Cluster(model=MODELS["llama3-8b"], gpu=GPUS["h100-sxm"], efficiency=A100_CALIBRATED)
        >>> any("causal" in line for line in not_modelled(c, None))
        True
    """
    out = [
        "kernel launches and the framework's time between actions, beyond what the GEMM efficiency fitted on "
        "Megatron-LM's Table 1 holds",
        "the data loader, stragglers, clock throttling and step-to-step variance",
    ]
    out += _model(cluster)
    if cluster.gpu.name not in CALIBRATED_ON:
        out.append(
            f"a GEMM efficiency of {cluster.gpu.name}'s own: the A100 fit (eta_max "
            f"{cluster.efficiency.eta_max}, n_half {cluster.efficiency.n_half:g}) is reused as a fraction of its peak"
        )
    if cluster.gpu.name == "mi300x":
        out.append("RCCL's reach over the xGMI mesh: the links' datasheet aggregate is taken as one link's rate")
    if config is not None:
        out += _config(cluster, config)
    return out


def _model(cluster: Cluster) -> list[str]:
    model = cluster.model
    if not isinstance(model, Transformer):
        return ["what one FLOP-rate ratio cannot capture of a profiled model (planner/profiled.py lists it)"]
    out = []
    if model.flash:
        out.append(
            "FlashAttention's causal skipping of the masked half of the scores (its products counted whole, as "
            "Megatron-LM counts them) and its own kernel efficiency (timed as GEMMs of the head size)"
        )
    if model.norm == "rmsnorm" or model.positions == "rotary":
        out.append("fusion of RMSNorm and rotary kernels (their memory traffic counted unfused)")
    out.append("the cross-entropy's temporaries beyond the stored FP32 logits, and kernels' scratch buffers")
    if model.moe_experts:
        out.append(
            "load imbalance among the experts (every expert is given k b s / E tokens of each microbatch, the "
            "busiest rank waits for none), tokens a --moe-capacity would drop, and the router's top-k and "
            "permutation kernels (their memory traffic)"
        )
    return out


def _config(cluster: Cluster, config: Config) -> list[str]:
    out = []
    if config.tp > 1:
        out.append("overlap of the TP collectives with the GEMMs (they are counted as blocking)")
    if config.dp > 1:
        out.append(
            "contention of the DP reduction with pipeline and TP traffic on the links, and NCCL's trees (its "
            "collectives are rings, hierarchical across nodes)"
        )
    if config.zero == 2:
        out.append(
            "ZeRO 2's T reduce-scatters crowding each other on the links (timed back to back from the part's "
            "first weight gradient)"
        )
    if config.zero == 3:
        out.append("FSDP's prefetch contending with compute for memory bandwidth, and its reshard's cost")
    if config.recompute != "none":
        out.append("the RNG state a recomputed forward keeps, and a replay's peak beyond one block")
    if config.ep > 1:
        out.append(
            "the all-to-all's uneven splits and the inter-node share of an EP group that spans nodes (all of its "
            "bytes move at the slower link); expert gradients reduced over DP / EP ranks, counted over DP"
        )
    if config.cp > 1:
        out.append(
            "ring attention's per-step kernel launches and its causal chunks' uneven steps (each step 1/C of "
            "the attention); the ring's bytes beside the DP and TP traffic on the links"
        )
    if config.tp * config.cp * config.pp * config.dp > cluster.gpu.gpus_per_node:
        out.append("the network's topology beyond nodes and links (rail-optimised fabrics, oversubscription)")
    return out
