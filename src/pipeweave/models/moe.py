"""A mixture-of-experts MLP (Shazeer et al. 2017; GShard, Lepikhin et al. 2021; Switch, Fedus et al. 2022).

A router scores each token against ``E`` experts, sends it to its top ``k``
and sums their outputs weighted by the gates; the experts are the model's
own MLP kind (the gpt's GeLU 4h MLP, the llama's SwiGLU). Three pieces with
seams between them, so that expert parallelism can replace the middle one
without touching the others::

    routing = router(x)                       Router: gates, experts, the auxiliary loss
    rows, counts, handle = dispatch(x, routing)   LocalDispatch: rows grouped by expert
    y = combine(experts(rows, counts), handle)    Experts: each on its own rows, in order

``LocalDispatch`` gathers and scatters within the process (every expert is
here). A dispatcher across ranks keeps the same two calls: ``dispatch``
returns the rows of *this process's* experts, grouped by expert, and
``counts`` per local expert (after an all-to-all with uneven splits), and
``combine`` returns every token's weighted sum (after the all-to-all back).

Routing. ``softmax``: probabilities ``softmax(x W_r)``; ``sigmoid``: scores
``sigmoid(x W_r)`` (DeepSeek-V3). Each token takes its ``k`` highest; with
``k > 1`` their gates are renormalised to sum to 1 (GShard, Mixtral), with
``k = 1`` the gate is the probability itself (Switch: else the router would
get no gradient from the loss). Dropless by default; with a capacity factor
``c`` each expert takes at most ``ceil(c N k / E)`` of the ``N`` tokens'
assignments, first choices before second ones, in token order (GShard), and
an assignment over it is dropped (the token keeps its residual only).

Load balancing. Switch's auxiliary loss ``coef * E * sum_i f_i P_i``: ``f_i``
the share of the ``N k`` assignments routed to expert ``i`` (before any drop),
``P_i`` the mean over tokens of its probability (sigmoid scores normalised per
token). It is 1 x coef when routing is uniform. It enters the objective where
it is computed: ``AuxLossInjection`` returns the layer output unchanged and, in
the backward, gives the loss its gradient (Megatron-LM's
``MoEAuxLossAutoScaler``), so a pipeline stage that is not the last still trains
it, within the same I (its router's weight gradient deferred to W like every
linear layer's, ``models.layers``). Each microbatch's auxiliary loss is scaled by
its share of the mini-batch, as its main loss is (``AuxLosses``); the stage (or
plain training) adds the values to the loss it reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeweave.config.model import ModelSpec
from pipeweave.models.layers import FusedLinear, Linear


class AuxLosses:
    """The auxiliary losses the MoE layers of a stage (or of plain training) computed since the last ``take``.

    ``batch_size`` (the mini-batch's samples) scales each microbatch's loss by its share, ``samples /
    batch_size``, as the main loss is scaled; None: unscaled (a layer used alone). ``grad_scale``: fp16's loss
    scale, set by whoever scales the main loss's backward (``runtime.loss_scale``, plain training).
    """

    def __init__(self, batch_size: int | None = None) -> None:
        self.batch_size = batch_size
        self.values: list[torch.Tensor] = []
        self.grad_scale: torch.Tensor | float = 1.0
        """The factor every gradient of the step carries: ``--precision fp16``'s loss scale (the backward of the
        main loss starts from it, so the auxiliary losses' gradients carry it too); read at each backward."""

    def share(self, samples: int) -> float:
        """The factor of a microbatch of ``samples`` samples."""
        return 1.0 if self.batch_size is None else samples / self.batch_size

    def take(self) -> torch.Tensor | None:
        """The sum of the values recorded since the last call (detached), or None if none was; then forgets them."""
        values, self.values = self.values, []
        return torch.stack(values).sum() if values else None


def attach_aux_losses(module: nn.Module, batch_size: int | None) -> AuxLosses:
    """Give every ``MoE`` layer under ``module`` one ``AuxLosses`` (returned) that records theirs."""
    losses = AuxLosses(batch_size)
    for m in module.modules():
        if isinstance(m, MoE):
            m.aux_losses = losses
    return losses


class AuxLossInjection(torch.autograd.Function):
    """``y`` unchanged; in the backward, the auxiliary loss ``aux`` (0-d) gets gradient ``share`` (its weight in
    the objective) times ``losses.grad_scale`` (fp16's loss scale; 1 without ``losses``), so its graph (the
    router) trains from whatever stage computed it."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, aux: torch.Tensor, share: float, losses: AuxLosses | None) -> torch.Tensor:
        ctx.share, ctx.losses, ctx.aux_dtype = share, losses, aux.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[Any, ...]:
        scale = 1.0 if ctx.losses is None else ctx.losses.grad_scale
        grad_aux = torch.as_tensor(scale, dtype=ctx.aux_dtype, device=gy.device) * ctx.share
        return gy, grad_aux, None, None


@dataclass(frozen=True)
class Routing:
    """Where a router sends ``N`` tokens: ``experts`` (N, k) their expert per choice, ``gates`` (N, k) the
    weights of those experts' outputs, ``kept`` (N, k) which assignments fit the capacity (None: dropless)."""

    experts: torch.Tensor
    gates: torch.Tensor
    kept: torch.Tensor | None = None


class Router(nn.Module):
    """Top-k gating of ``num_experts`` experts with the load-balancing auxiliary loss (module docstring)."""

    def __init__(self, spec: ModelSpec, *, generator: torch.Generator) -> None:
        super().__init__()
        self.num_experts, self.top_k = moe_experts(spec), spec.moe_top_k
        self.kind, self.capacity, self.coef = spec.moe_router, spec.moe_capacity, spec.moe_aux_loss
        self.gate = Linear(spec.hidden, self.num_experts, generator=generator, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[Routing, torch.Tensor]:
        """``x`` (N, h) -> its routing, and the auxiliary loss (unscaled by any share; 0 where coef is 0)."""
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.kind == "softmax" else logits.sigmoid()
        top, experts = scores.topk(self.top_k, dim=-1)
        gates = top / top.sum(-1, keepdim=True) if self.top_k > 1 else top
        kept = None if self.capacity is None else self._within_capacity(experts)
        return Routing(experts, gates, kept), self._aux_loss(scores, experts)

    def _within_capacity(self, experts: torch.Tensor) -> torch.Tensor:
        """(N, k) bool: the assignment fits its expert's capacity, first choices served before second ones."""
        n, k = experts.shape
        capacity = math.ceil(self.capacity * n * k / self.num_experts)  # type: ignore[operator]
        one_hot = F.one_hot(experts.t().reshape(-1), self.num_experts)  # (k N, E), choice-major
        position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # place in its expert's queue
        return (position < capacity).reshape(k, n).t()

    def _aux_loss(self, scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        if self.coef == 0:
            return scores.new_zeros(())
        n, k = experts.shape
        probs = scores if self.kind == "softmax" else scores / scores.sum(-1, keepdim=True)
        f = torch.bincount(experts.reshape(-1), minlength=self.num_experts).to(probs.dtype) / (n * k)
        return self.coef * self.num_experts * (f * probs.mean(0)).sum()


@dataclass(frozen=True)
class LocalHandle:
    """What ``LocalDispatch.combine`` needs of its ``dispatch``: each row's token and gate."""

    tokens: torch.Tensor
    gates: torch.Tensor
    num_tokens: int


class LocalDispatch:
    """Dispatch and combine within this process, every expert here: a gather of the tokens' rows grouped by
    expert, and a weighted scatter-add back (the seam an all-to-all dispatcher replaces; module docstring)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, list[int], LocalHandle]:
        """``x`` (N, h) -> its rows for the experts, grouped by expert in expert order; rows per expert; the
        handle ``combine`` takes."""
        k = routing.experts.shape[1]
        chosen = routing.experts.reshape(-1)  # (N k): token-major
        slots = torch.arange(chosen.numel(), device=x.device)
        if routing.kept is not None:
            slots = slots[routing.kept.reshape(-1)]
        order = slots[torch.argsort(chosen[slots], stable=True)]  # by expert, token order within each
        counts = torch.bincount(chosen[order], minlength=self.num_experts).tolist()
        tokens = order // k
        gates = routing.gates.reshape(-1)[order]
        return x.index_select(0, tokens), counts, LocalHandle(tokens, gates, x.shape[0])

    def combine(self, y: torch.Tensor, handle: LocalHandle) -> torch.Tensor:
        """The experts' rows ``y`` -> (N, h): each token's outputs weighted by their gates and summed."""
        weighted = y * handle.gates.to(y.dtype).unsqueeze(-1)
        return y.new_zeros(handle.num_tokens, y.shape[-1]).index_add(0, handle.tokens, weighted)


class GeluExpert(nn.Module):
    """The gpt's MLP: ``down(gelu(up(x)))``, 4h wide."""

    TP_PLAN = {"up": "colwise", "down": "rowwise"}
    """Its tensor-parallel split, the dense MLP's (``models.tensor_parallel``)."""

    def __init__(self, hidden: int, *, generator: torch.Generator) -> None:
        super().__init__()
        self.up = Linear(hidden, 4 * hidden, generator=generator)
        self.down = Linear(4 * hidden, hidden, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class SwiGLUExpert(nn.Module):
    """The llama's MLP: ``down(silu(gate) * up)``, ``ffn`` wide."""

    TP_PLAN = {"gate_up": "colwise_fused", "down": "rowwise"}
    """Its tensor-parallel split, the dense MLP's (``models.tensor_parallel``)."""

    def __init__(self, hidden: int, ffn: int, *, generator: torch.Generator) -> None:
        super().__init__()
        self.gate_up = FusedLinear(hidden, (ffn, ffn), generator=generator)
        self.down = Linear(ffn, hidden, generator=generator, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Experts(nn.Module):
    """The experts ``expert_ids`` of a layer (all by default), each initialised from its own seed drawn from the
    layer's generator, so that a process holding some of them holds them as one holding all does."""

    def __init__(self, spec: ModelSpec, *, generator: torch.Generator, expert_ids: range | None = None) -> None:
        super().__init__()
        num = moe_experts(spec)
        seeds = torch.randint(2**62, (num,), generator=generator, device="cpu").tolist()  # on the CPU under meta too
        self.expert_ids = expert_ids if expert_ids is not None else range(num)
        self.local = nn.ModuleList(_expert(spec, torch.Generator().manual_seed(seeds[e])) for e in self.expert_ids)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by local expert (``counts`` each) -> their outputs, in the same order. An expert with no
        row still runs (on none): its weight gradient is a zero one, as in every other process."""
        return torch.cat([expert(chunk) for expert, chunk in zip(self.local, rows.split(counts))])


def _expert(spec: ModelSpec, generator: torch.Generator) -> nn.Module:
    if spec.kind == "llama":
        return SwiGLUExpert(spec.hidden, spec.ffn_width, generator=generator)
    return GeluExpert(spec.hidden, generator=generator)


class MoE(nn.Module):
    """The mixture-of-experts MLP of a transformer block: (batch, seq, h) -> (batch, seq, h).

    ``aux_losses`` (set by the stage that owns the layer, ``attach_aux_losses``) scales the auxiliary loss by
    the microbatch's share and records it for the reported loss.

    Example:
        >>> spec = ModelSpec(kind="gpt", layers=1, hidden=8, heads=2, moe_experts=4, moe_top_k=2)
        >>> moe = MoE(spec, generator=torch.Generator().manual_seed(0))
        >>> moe(torch.randn(2, 3, 8)).shape
        torch.Size([2, 3, 8])
    """

    def __init__(self, spec: ModelSpec, *, generator: torch.Generator) -> None:
        super().__init__()
        self.router = Router(spec, generator=generator)
        self.experts = Experts(spec, generator=generator)
        self.dispatcher = LocalDispatch(moe_experts(spec))
        self.aux_losses: AuxLosses | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        routing, aux = self.router(flat)
        rows, counts, handle = self.dispatcher.dispatch(flat, routing)
        y = self.dispatcher.combine(self.experts(rows, counts), handle)
        if self.router.coef != 0:
            share = 1.0 if self.aux_losses is None else self.aux_losses.share(x.shape[0])
            if self.aux_losses is not None:
                self.aux_losses.values.append(aux.detach() * share)
            if torch.is_grad_enabled():
                y = AuxLossInjection.apply(y, aux, share, self.aux_losses)
        return y.reshape(x.shape)  # type: ignore[no-any-return]


def moe_experts(spec: ModelSpec) -> int:
    """The model's experts per MoE layer (0: dense)."""
    return spec.moe_experts or 0


def is_moe_block(spec: ModelSpec, index: int) -> bool:
    """Whether layer ``index`` (a transformer block, 1..L) has experts: every ``moe_every``-th block,
    the ``moe_every``-th first (block 1 when 1, as Switch alternates from its second when 2)."""
    return moe_experts(spec) > 0 and index % spec.moe_every == 0


def tensor_parallel_plan(moe: MoE, prefix: str = "moe.") -> dict[str, str]:
    """Megatron's split of each expert, as of the dense MLP (``models.tensor_parallel``); the router stays whole
    on every rank, so every rank routes alike and runs each expert's share on the same rows."""
    return {
        f"{prefix}experts.local.{i}.{name}": style
        for i, expert in enumerate(moe.experts.local)
        for name, style in expert.TP_PLAN.items()
    }
