"""One configuration's predicted step: its schedule simulated under the cluster's costs, the DP reduction's
tail, throughput and memory.

The schedule is simulated (``sim.timeline.simulate``) with per-part F, I, W from
``planner.costs`` and one hop time for every pipeline message (the slowest: inter-node
as soon as a pipeline spans two nodes). The data-parallel reduction of each part
then follows ``sim.parallel``'s model (hierarchical across nodes), from the
timeline: it starts when the part's last weight gradient ends
(``overlap=False``; Megatron-LM's "local" DDP) or, with DDP's bucketed overlap,
when the action producing the part's last weight gradients starts (a B, or a
split backward's W: its I produces none), its buckets going out as it produces
them; reductions on one rank run one after another; each ``U`` waits for its
part's reduction, then runs the optimizer step (memory-bound:
``planner.costs.update_time``) and ZeRO's all-gather. ZeRO 2 reduce-scatters
a part's gradient after each of its T backwards (``runtime.replicas``): T
reductions of ZeRO 1's bytes on the rank's stream, the first T - 1 from the
end of the part's first weight gradient on, the last from the end of its
last (a lower bound where they crowd each other). ZeRO 3 also gathers a
part's parameters before each of its F and I (FSDP, resharding after each use); prefetched, the gather hides behind the
action's compute and only what exceeds it counts. The step ends at the last ``U`` (steps end in a barrier: the
gradient norm's all-reduce).

Throughput: TFLOP/s per GPU as Megatron-LM counts it (the FLOPs executed,
recomputation included: its equation 3 for full recomputation) over step time
and GPUs; MFU counts the model's FLOPs only (no recomputation; PaLM's
definition, Chowdhery et al. 2022, appendix B) against the GPU's peak.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeweave.planner.candidate import Config
from pipeweave.planner.costs import (
    BlockTimes,
    Cluster,
    block_times,
    deferral_times,
    head_times,
    hop_time,
    part_times,
    transformer,
    update_time,
)
from pipeweave.planner.flops import step_flops
from pipeweave.planner.memory import PARAM_BYTES, GPUMemory, block_activation_bytes, gpu_memory
from pipeweave.planner.moe import fb_hidden, fb_pairs, moe_terms
from pipeweave.planner.pipeline import Pipeline, Summary, Times, auto_options
from pipeweave.planner.split import blocks_of
from pipeweave.schedule.ir import Op, Schedule
from pipeweave.schedule.registry import SCHEDULES
from pipeweave.sim.parallel import Layout, gather_time, reduction_time


@dataclass(frozen=True)
class Result:
    """The prediction for one configuration."""

    config: Config
    step_time: float
    """Seconds per step."""
    tflops_per_gpu: float
    mfu: float
    bubble_ratio: float
    memory: GPUMemory
    fits: bool
    compute: float
    """Seconds of the busiest rank's F, I and W, TP all-reduces excluded."""
    tp_comm: float
    """Seconds the busiest rank spends in TP all-reduces."""
    dp_exposed: float
    """Seconds the DP reduction, the optimizer step and ZeRO's all-gather add past the pipeline's end."""
    terms: dict[str, float] = field(default_factory=dict)
    """The step's time term by term, in seconds (``Evaluator.terms``): what ``plan --explain`` prints."""

    def as_dict(self) -> dict[str, object]:
        """The configuration and its figures; those of a configuration not simulated (it does not fit) null."""
        out = self.config.as_dict()
        timed = {
            "step_time_s": self.step_time,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "bubble_ratio": self.bubble_ratio,
            "compute_s": self.compute,
            "tp_comm_s": self.tp_comm,
            "dp_exposed_s": self.dp_exposed,
        }
        out.update({k: v if math.isfinite(self.step_time) else None for k, v in timed.items()})
        out["terms_s"] = dict(self.terms) if math.isfinite(self.step_time) else None
        out.update(memory_gib=round(self.memory.total / 2**30, 3), fits=self.fits, memory=self.memory.as_dict())
        return out


@dataclass(frozen=True, kw_only=True)
class Evaluator:
    """Predicts configurations of one model on one cluster, caching schedules and timelines by shape."""

    cluster: Cluster
    batch: int
    """B, samples per step (global batch)."""
    overlap: bool = True
    """DDP's overlap of the reduction with the last backward (False: after it)."""
    pipeline: Pipeline = field(default_factory=Pipeline)
    """Schedules, memory peaks and timeline summaries, cached by shape."""
    known_times: dict[tuple[object, ...], Times] = field(default_factory=dict, repr=False)
    """``times``' answers (the search asks for each configuration's several times)."""
    known_reductions: dict[tuple[object, ...], float] = field(default_factory=dict, repr=False)
    """``planner.bound.reduction_bound``'s answers, by what they depend on."""

    def layout(self, config: Config) -> Layout:
        return Layout(
            tp=config.tp,
            dp=config.dp * config.cp,  # a cp group reduces its gradients as replicas do (planner.moe)
            zero=min(config.zero, 1) if config.zero == 2 else config.zero,  # ZeRO 2: ZeRO 1's bytes T times
            network=self.cluster.gpu.network(),
            sequence_parallel=self.cluster.sequence_parallel,
        )

    def times(self, config: Config, num_parts: int) -> Times:
        """``(f, i, w, hop)`` of the configuration's parts."""
        key = (
            config.tp,
            config.pp,
            config.dp,
            num_parts,
            config.microbatch_size,
            config.recompute,
            config.zero == 3,
            config.blocks,
            SCHEDULES[config.schedule].splits_backward,
            config.ep,
            config.cp,
            config.schedule if fb_pairs(config.schedule) else "",
        )
        found = self.known_times.get(key)
        if found is None:
            found = self.known_times[key] = self._times(config, num_parts)
        return found

    def _times(self, config: Config, num_parts: int) -> Times:
        f, i, w = self.part_times(config, num_parts)
        f, i = self.fb_overlap(config, num_parts, f, i)
        if config.zero == 3:  # FSDP gathers a part's parameters before each F and each I, prefetched
            layout = self.layout(config)
            params = self.param_bytes(config, num_parts)
            gather = [gather_time(layout, p, num_ranks=config.pp) for p in params]
            f, i = tuple(map(max, f, gather)), tuple(map(max, i, gather))
        return f, i, w, self.hop(config, num_parts)

    def part_times(self, config: Config, num_parts: int) -> tuple[tuple[float, ...], ...]:
        """Per part, seconds of F, I and W on one TP rank (``planner.costs``)."""
        return part_times(
            self.cluster,
            num_parts=num_parts,
            tp=config.tp,
            microbatch_size=config.microbatch_size,
            recompute=config.recompute,
            blocks=config.blocks,
            split_backward=SCHEDULES[config.schedule].splits_backward,
            ep=config.ep,
            cp=config.cp,
            pp=config.pp,
        )

    def fb_overlap(
        self, config: Config, num_parts: int, f: tuple[float, ...], i: tuple[float, ...]
    ) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """``f`` and ``i`` less the experts' all-to-all the schedule's F&B pairs hide (``planner.moe.fb_hidden``),
        on the share of its F that run paired; as they are where it has no pairs or no all-to-all."""
        if config.ep <= 1 or not fb_pairs(config.schedule) or not getattr(self.cluster.model, "moe_experts", 0):
            return f, i
        block = self.block(config)
        schedule = self.pipeline.schedule(config, {})
        forwards = sum(1 for row in schedule.actions for a in row if a[1] is Op.F) if schedule else 0
        if not forwards or not schedule.pairs:
            return f, i
        hide_f, hide_i = fb_hidden(
            a2a_f=block.a2a,
            a2a_i=block.a2a,
            compute_f=block.f - block.a2a,
            compute_i=block.i - block.a2a,
            paired=len(schedule.pairs) / forwards,
        )
        counts = blocks_of(transformer(self.cluster), num_parts, config.blocks)
        return tuple(x - n * hide_f for x, n in zip(f, counts)), tuple(x - n * hide_i for x, n in zip(i, counts))

    def block(self, config: Config) -> BlockTimes:
        """One block's times under the configuration (``planner.costs.block_times``)."""
        return block_times(
            self.cluster,
            tp=config.tp,
            microbatch_size=config.microbatch_size,
            recompute=config.recompute,
            ep=config.ep,
            cp=config.cp,
            pp=config.pp,
        )

    def hop(self, config: Config, num_parts: int) -> float:
        """Seconds of a pipeline message (inter-node as soon as a pipeline spans two nodes)."""
        del num_parts  # every GPT part sends one activation
        inter = config.tp * config.pp > self.cluster.gpu.gpus_per_node
        return hop_time(
            self.cluster, tp=config.tp, microbatch_size=config.microbatch_size, inter_node=inter, cp=config.cp
        )

    def param_bytes(self, config: Config, num_parts: int) -> Sequence[float]:
        """Per part, the BF16 parameter (and gradient) bytes one TP rank holds."""
        return self.pipeline.tp_rank_param_bytes(config, transformer(self.cluster), num_parts)

    def auto_options(self, config: Config, times: Times) -> dict[str, object]:
        """The options of a searched schedule (zb-auto), none for the others."""
        return auto_options(config, self.cluster, times) if config.searched else {}

    def memory(self, config: Config, schedule: Schedule, layout: Layout) -> GPUMemory:
        """The fullest GPU's bytes (``planner.memory``)."""
        peaks = self.pipeline.peaks(config, schedule, transformer(self.cluster), self.cluster.sequence_parallel)
        extra = {"ep": config.ep, "cp": config.cp} if config.ep > 1 or config.cp > 1 else {}
        return gpu_memory(
            schedule,
            transformer(self.cluster),
            layout,
            microbatch_size=config.microbatch_size,
            recompute=config.recompute,
            peaks=peaks,
            state=self.cluster.state,
            zero2=config.zero == 2,
            blocks=config.blocks,
            **extra,
        )

    def least_activation(self, config: Config) -> float:
        """Bytes of one microbatch's activations on one part: what any rank holds at least."""
        held = block_activation_bytes(
            transformer(self.cluster),
            tp=config.tp,
            recompute=config.recompute,
            sequence_parallel=self.cluster.sequence_parallel,
            cp=config.cp,
        )[0]
        fewest = min(blocks_of(transformer(self.cluster), self.num_parts(config), config.blocks))
        return held * fewest * config.microbatch_size

    def step_flops(self, recompute: str) -> float:
        """FLOPs of a step as Megatron-LM counts them (``planner.flops``)."""
        return step_flops(transformer(self.cluster), self.batch, recompute=recompute)

    @staticmethod
    def num_parts(config: Config) -> int:
        """Parts of the configuration's schedule: D x v (chunks of a looped or V placement), D otherwise."""
        return config.pp * config.chunks

    def evaluate(self, config: Config, *, time_unfit: bool = False) -> Result | None:
        """The prediction, or None when the schedule family cannot serve this (D, T, v). The memory comes
        first: a configuration that does not fit is not simulated (its times are inf and 0) unless
        ``time_unfit``."""
        times = self.times(config, self.num_parts(config))
        schedule = self.pipeline.schedule(config, self.auto_options(config, times))
        if schedule is None:
            return None
        layout = self.layout(config)
        memory = self.memory(config, schedule, layout)
        fits = memory.total <= self.cluster.gpu.memory_bytes
        if not fits and not time_unfit:
            return Result(
                config=config,
                step_time=math.inf,
                tflops_per_gpu=0.0,
                mfu=0.0,
                bubble_ratio=math.nan,
                memory=memory,
                fits=False,
                compute=math.nan,
                tp_comm=math.nan,
                dp_exposed=math.nan,
            )
        summary = self.pipeline.summary(config, schedule, times)
        step = max(summary.makespan, self.dp_tail(config, layout, summary))
        gpus, peak = config.gpus, self.cluster.gpu.peak_flops
        tp = self.tp_comm(config)
        terms = self.terms(config, layout, summary, step)
        return Result(
            config=config,
            step_time=step,
            tflops_per_gpu=self.step_flops(config.recompute) / step / gpus / 1e12,
            mfu=self.step_flops("none") / step / gpus / peak,
            bubble_ratio=summary.bubble_ratio,
            memory=memory,
            fits=fits,
            compute=summary.busy - tp,
            tp_comm=tp,
            dp_exposed=step - summary.makespan,
            terms=terms,
        )

    def work_terms(self, config: Config) -> dict[str, float]:
        """``terms``' work of the rank holding the head: its blocks' GEMMs, element-wise kernels, TP collectives
        and replayed forwards, and the head and the loss (``planner.costs``)."""
        model = transformer(self.cluster)
        block = self.block(config)
        # the head's rank: the last part's, and every D-th part before it (an uneven split: its own counts)
        own = sum(config.blocks[config.pp - 1 :: config.pp]) if config.blocks else model.layers / config.pp
        blocks = config.microbatches * own
        attention = block.gemm_f - block.w
        gemm = block.gemm_f + 2 * block.w + (2.5 if model.flash else 2.0) * attention
        replay = block.replay - (block.tp_f if config.recompute == "full" else 0.0)
        head = head_times(self.cluster, tp=config.tp, microbatch_size=config.microbatch_size, cp=config.cp)
        deferred = 0.0
        if SCHEDULES[config.schedule].splits_backward:
            per_block, per_head = deferral_times(
                self.cluster, tp=config.tp, microbatch_size=config.microbatch_size, cp=config.cp
            )
            deferred = blocks * per_block + config.microbatches * per_head
        out = {
            "GEMMs": blocks * gemm,
            "element-wise kernels": blocks * 3 * block.elementwise_f,
            "TP collectives": blocks * (block.tp_f + block.tp_i),
            "recomputation": blocks * (replay - (block.a2a + block.ring_f if config.recompute == "full" else 0.0)),
            "head and loss": config.microbatches * sum(head),
            "W deferral's re-reads": deferred,
        }
        full, moe = config.recompute == "full", model.moe_experts > 0
        return out | moe_terms(
            blocks=blocks, a2a=block.a2a, ring_f=block.ring_f, ring_i=block.ring_i, full=full, moe=moe, cp=config.cp
        )

    def tp_comm(self, config: Config) -> float:
        """Seconds the busiest rank spends in TP all-reduces per step: T microbatches of its blocks (L / D where
        they split evenly)."""
        block = self.block(config)
        return config.microbatches * self.rank_blocks(config) * (block.tp_f + block.tp_i)

    def rank_blocks(self, config: Config) -> float:
        """Blocks of the pipeline rank holding the most: L / D, or the largest part of an uneven split."""
        if not config.blocks:
            return transformer(self.cluster).layers / config.pp
        return float(max(config.blocks)) * config.chunks

    def update(self, config: Config, param_bytes: float) -> float:
        """Seconds of the optimizer step of a part whose TP rank holds ``param_bytes`` of BF16 weights."""
        return update_time(self.cluster, param_bytes / PARAM_BYTES, zero=config.zero, dp=config.dp)

    def dp_tail(self, config: Config, layout: Layout, summary: Summary) -> float:
        """When the last ``U`` ends: its part's DP reduction, optimizer step and ZeRO all-gather done (module
        docstring)."""
        params = self.param_bytes(config, summary.num_parts)
        starts = summary.last_grad_start if self.overlap else summary.last_grad_end
        end = 0.0
        for rank_parts in summary.update_order:
            stream = free = 0.0
            for part in rank_parts:
                holders = summary.holders[part]
                reduce = reduction_time(layout, params[part], num_ranks=config.pp, holders=holders)
                if config.zero == 2:  # one reduce-scatter after each of its T backwards (runtime.replicas)
                    stream = max(stream, summary.first_grad_end[part]) + (config.microbatches - 1) * reduce
                    stream = max(stream, summary.last_grad_end[part]) + reduce
                else:
                    stream = max(stream, starts[part]) + reduce
                done = max(stream, summary.last_grad_end[part])
                gather = gather_time(layout, params[part], num_ranks=config.pp, holders=holders)
                free = max(free, done) + self.update(config, params[part]) + gather
            end = max(end, free)
        return end

    def terms(self, config: Config, layout: Layout, summary: Summary, step: float) -> dict[str, float]:
        """The step term by term, in seconds, on the pipeline rank that holds the head (its T microbatches of L /
        D blocks and the head): GEMMs, element-wise kernels, TP collectives, recomputation's replay, the head
        and the loss, then the rest of the pipeline's span (bubble, waits, messages), and the per-step work of
        the busiest rank: its DP reductions (overlapped with the backward where the schedule and DDP allow),
        optimizer steps and ZeRO all-gathers, and what of them the step waits for past the pipeline's end."""
        out = self.work_terms(config)
        out["pipeline bubble, waits and messages"] = max(0.0, summary.makespan - sum(out.values()))
        params = self.param_bytes(config, summary.num_parts)
        busiest = {"DP reduction": 0.0, "optimizer step": 0.0, "ZeRO all-gather": 0.0}
        for rank_parts in summary.update_order:
            per = {
                "DP reduction": sum(
                    reduction_time(layout, params[k], num_ranks=config.pp, holders=summary.holders[k])
                    for k in rank_parts
                )
                * (config.microbatches if config.zero == 2 else 1),
                "optimizer step": sum(self.update(config, params[k]) for k in rank_parts),
                "ZeRO all-gather": sum(
                    gather_time(layout, params[k], num_ranks=config.pp, holders=summary.holders[k]) for k in rank_parts
                ),
            }
            if sum(per.values()) > sum(busiest.values()):
                busiest = per
        out.update(busiest)
        out["of which past the pipeline's end"] = step - summary.makespan
        return out
