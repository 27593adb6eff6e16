"""One configuration of a profiled model predicted: ``planner.evaluate``'s prediction with the profile's costs.

The step is simulated as for a GPT (``planner.evaluate``); what changes is where
the costs come from (``planner.profiled``): per part, the profile's F, I and W
scaled to the target, with the pipeline's ``dispatch`` seconds between two
actions of a rank (``planner.pipeline``: the runtime's own overhead, which the
profile does not hold; ``pipeweave train`` reports it as "dispatch per
action"); one pipeline message carries the
largest output between parts; the activation peak per rank is walked over the
schedule's order with the parts' own sizes (``sim.metrics.held_peaks``). No
tensor parallelism (TP 1), so no TP communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeweave.planner.candidate import Config
from pipeweave.planner.evaluate import Evaluator
from pipeweave.planner.memory import PARAM_BYTES, GPUMemory, fullest_gpu
from pipeweave.planner.pipeline import Times
from pipeweave.planner.profiled import ProfiledModel
from pipeweave.schedule.ir import Schedule
from pipeweave.sim.metrics import held_peaks
from pipeweave.sim.parallel import Layout


@dataclass(frozen=True, kw_only=True)
class ProfiledEvaluator(Evaluator):
    """``Evaluator`` for a ``ProfiledModel`` (module docstring)."""

    @property
    def model(self) -> ProfiledModel:
        model = self.cluster.model
        assert isinstance(model, ProfiledModel)
        return model

    def part_times(self, config: Config, num_parts: int) -> tuple[tuple[float, ...], ...]:
        return self.model.part_times(num_parts, microbatch_size=config.microbatch_size, recompute=config.recompute)

    def hop(self, config: Config, num_parts: int) -> float:
        nbytes = self.model.boundary_bytes(num_parts, config.microbatch_size)
        inter = config.pp > self.cluster.gpu.gpus_per_node
        net = self.cluster.gpu.network()
        return (net.inter_node if inter else net.intra_node).time(nbytes)

    def param_bytes(self, config: Config, num_parts: int) -> Sequence[float]:
        return [p * PARAM_BYTES for p in self.model.part_parameters(num_parts)]

    def auto_options(self, config: Config, times: Times) -> dict[str, object]:
        """zb-auto's options: the parts' mean times in units of F, and the memory limit 2 (ZB-2p's)."""
        if not config.searched:
            return {}
        parts = self.num_parts(config)
        f, i, w, hop = times
        unit = sum(f) / parts
        return {
            "time_f": 1.0,
            "time_b": round(sum(i) / parts / unit, 1),
            "time_w": round(sum(w) / parts / unit, 1),
            "time_comm": round(hop / unit, 1),
            "activation_limit": 2.0,
        }

    def memory(self, config: Config, schedule: Schedule, layout: Layout) -> GPUMemory:
        parts = schedule.num_parts
        held, stash, during = self.model.part_activations(
            parts, microbatch_size=config.microbatch_size, recompute=config.recompute
        )
        acts = held_peaks(schedule.actions, schedule.placement.stage_part, held, stash, during, during)
        message = self.model.boundary_bytes(parts, config.microbatch_size) if parts > 1 else 0.0
        params = self.model.part_parameters(parts)
        return fullest_gpu(
            schedule, params, layout, acts, state=self.cluster.state, message=message, zero2=config.zero == 2
        )

    def work_terms(self, config: Config) -> dict[str, float]:
        """One term: the profiled F, I and W of the rank holding the last part (``part_times``)."""
        f, i, w = self.part_times(config, self.num_parts(config))
        last = [k for k in range(len(f)) if k % config.pp == (len(f) - 1) % config.pp]
        return {"profiled F, I and W": config.microbatches * sum(f[k] + i[k] + w[k] for k in last)}

    def tp_comm(self, config: Config) -> float:
        return 0.0

    def least_activation(self, config: Config) -> float:
        held = self.model.part_activations(
            self.num_parts(config), microbatch_size=config.microbatch_size, recompute=config.recompute
        )[0]
        return min(held)

    def step_flops(self, recompute: str) -> float:
        return self.model.step_flops(self.batch)
