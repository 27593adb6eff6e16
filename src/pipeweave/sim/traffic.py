"""What a model moves and stores per part under tensor and data parallelism: messages, TP collectives, parameters.

Sizes only; ``sim.parallel`` turns them into times on a layout's links. The
TP traffic follows Megatron-LM's split without sequence parallelism, as
pipeweave's tensor-parallel layers run it: a transformer block all-reduces its
activation twice in F (behind attention's and the MLP's row-parallel
projections) and twice in I (in front of their column-parallel inputs); a
vocabulary head split by columns all-gathers its logits in F and all-reduces
its input gradient in I; an embedding is replicated, whole on every TP rank.
Activations held for the backward split the same way: the TP layers' own
ones 1/N, the rest (layer norms, dropout masks, the GEMMs' inputs) whole on
every rank, unless sequence parallelism splits those too (``tp_rank_share``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeweave.errors import UserError
from pipeweave.sim.cost import Value, cost_problem


def tp_rank_share(total: float, replicated: float, tp: int, *, split_replicated: bool = False) -> float:
    """Bytes one of ``tp`` ranks holds of ``total``, of which ``replicated`` the TP layers leave whole on every rank
    (``split_replicated``: sequence parallelism splits those too, Korthikanti et al. 2022, section 4.2.2).

    Example:
        >>> tp_rank_share(10.0, 4.0, 2), tp_rank_share(10.0, 4.0, 2, split_replicated=True)
        (7.0, 5.0)
    """
    whole = replicated / tp if split_replicated else replicated
    return (total - replicated) / tp + whole


@dataclass(frozen=True)
class PartBytes:
    """``ModelBytes`` resolved to one value per part."""

    message: tuple[float, ...]
    tp_message: tuple[float, ...]
    tp_forward: tuple[float, ...]
    tp_backward: tuple[float, ...]
    tp_gather: tuple[float, ...]
    params: tuple[float, ...]
    replicated: tuple[float, ...]
    grads: float
    optimizer: float
    activation: tuple[float, ...] = ()
    replicated_activation: tuple[float, ...] = ()

    def tp_rank_params(self, part: int, tp: int) -> float:
        """Parameter bytes of ``part`` one of its ``tp`` ranks holds: the split ones / N, the replicated whole.

        Example:
            >>> ModelBytes(params=(10.0,), replicated=(4.0,)).for_parts(num_parts=1, num_ranks=1).tp_rank_params(0, 2)
            7.0
        """
        return tp_rank_share(self.params[part], self.replicated[part], tp)

    def tp_rank_activation(self, part: int, tp: int, *, sequence_parallel: bool = False) -> float:
        """Activation bytes of one microbatch in ``part`` that one of its ``tp`` ranks holds for the backward.

        Example:
            >>> p = ModelBytes(activation=10.0, replicated_activation=4.0).for_parts(num_parts=1, num_ranks=1)
            >>> p.tp_rank_activation(0, 2), p.tp_rank_activation(0, 2, sequence_parallel=True)
            (7.0, 5.0)
        """
        if not self.activation:
            return 0.0
        return tp_rank_share(
            self.activation[part], self.replicated_activation[part], tp, split_replicated=sequence_parallel
        )


_FIELDS = (
    "message",
    "tp_collectives",
    "tp_backward",
    "tp_message",
    "tp_gather",
    "params",
    "replicated",
    "grads",
    "optimizer",
    "activation",
    "replicated_activation",
)


@dataclass(frozen=True, kw_only=True)
class ModelBytes:
    """What the layout moves and stores. A scalar count or size of parameters is one D-th of the
    model's, shared among the parts like ``CostModel``'s times; a sequence is one value per part.

    Example:
        >>> ModelBytes(message=8.0, tp_collectives=2, params=100.0).for_parts(num_parts=4, num_ranks=2).params
        (50.0, 50.0, 50.0, 50.0)
    """

    message: Value = 0.0
    """Bytes of the activation one microbatch passes between layers (b x s x h x bytes per element): what
    a part sends to the next (and receives back as its gradient)."""
    tp_collectives: Value = 0.0
    """All-reduces in a part's forward (Megatron-LM: 2 per transformer block)."""
    tp_backward: Value | None = None
    """All-reduces in a part's input-gradient backward (default: as many as in its forward)."""
    tp_message: Value | None = None
    """Bytes each TP all-reduce sums, the block's activation b x s x h (default: ``message``)."""
    tp_gather: Value = 0.0
    """Bytes a part all-gathers in its forward, whole (a vocabulary head's logits: b x s x V)."""
    params: Value = 0.0
    """Parameter bytes, all N tensor-parallel shards together."""
    replicated: Value = 0.0
    """The part of ``params`` every TP rank holds whole (embeddings, norms): not divided by N."""
    grads: float = 1.0
    """Gradient bytes per parameter byte."""
    optimizer: float = 2.0
    """Optimizer-state bytes per parameter byte (Adam's two moments in the parameters' precision: 2; SGD: 0)."""
    activation: Value = 0.0
    """Bytes of activations one microbatch holds in a part from its F to its backward, all N tensor-parallel
    shards together (the cost model's M_a in bytes; a GPT block's: ``sim.activations``)."""
    replicated_activation: Value = 0.0
    """The part of ``activation`` every TP rank holds whole without sequence parallelism (a GPT block's layer
    norms, dropout masks and the GEMMs' inputs): not divided by N, unless the layout is sequence-parallel."""

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            for v in [] if value is None else [value] if isinstance(value, (int, float)) else list(value):
                problem = cost_problem(v, "number")
                if problem is not None:
                    raise UserError(f"{name}={value!r} {problem}")

    def for_parts(self, *, num_parts: int, num_ranks: int) -> PartBytes:
        """One value per part (see the class docstring).

        Raises:
            UserError: a sequence whose length is not ``num_parts``, or more replicated bytes than parameters.
        """
        scale = num_ranks / num_parts if num_parts else 1.0

        def resolve(name: str, share: float, default: str | None = None) -> tuple[float, ...]:
            value = getattr(self, name)
            if value is None and default is not None:
                return resolve(default, share)
            if isinstance(value, (int, float)):
                return (float(value) * share,) * num_parts
            if len(value) != num_parts:
                raise UserError(f"{name} has {len(value)} values for {num_parts} parts; give one per part or a scalar")
            return tuple(float(v) for v in value)

        parts = PartBytes(
            message=resolve("message", 1.0),
            tp_message=resolve("tp_message", 1.0, "message"),
            tp_forward=resolve("tp_collectives", scale),
            tp_backward=resolve("tp_backward", scale, "tp_collectives"),
            tp_gather=resolve("tp_gather", scale),
            params=resolve("params", scale),
            replicated=resolve("replicated", scale),
            grads=self.grads,
            optimizer=self.optimizer,
            activation=resolve("activation", scale),
            replicated_activation=resolve("replicated_activation", scale),
        )
        for what, whole, kept, fix in (
            ("parameter", parts.params, parts.replicated, "replicated <= params"),
            ("activation", parts.activation, parts.replicated_activation, "replicated_activation <= activation"),
        ):
            for k, (p, r) in enumerate(zip(whole, kept)):
                if r > p:
                    raise UserError(f"part {k} has {r:g} replicated {what} bytes of {p:g}; give {fix}")
        return parts
