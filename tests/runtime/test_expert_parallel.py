"""Expert parallelism's all-to-all dispatch and combine: on 2 ranks (gloo), outputs and gradients equal one
process computing every expert on every token; uneven splits, an expert without tokens, no hang."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipeweave.runtime.context import RankContext
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.stage.expert_parallel import ExpertDispatch, ExpertParallel, ExpertTraffic, _by_expert
from pipeweave.runtime.transport.all_to_all import all_to_all

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

EXPERTS, HIDDEN = 4, 3
DELAY_S = 0.25


def _tokens(rank: int, routes: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s token rows and the expert each goes to."""
    experts = torch.tensor(routes[rank], dtype=torch.int64)
    x = torch.randn(len(experts), HIDDEN, generator=torch.Generator().manual_seed(10 + rank))
    return x, experts


def _weights() -> torch.Tensor:
    return torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(5))


def _apply(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Every row through its own expert (plain: every expert here)."""
    return torch.einsum("nh,nho->no", x, weights[experts])


class _Slower:
    """A posted exchange's work, completing ``DELAY_S`` after it has (``RankContext.delayed``'s part)."""

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self) -> bool:
        self.work.wait()
        time.sleep(DELAY_S)
        return True


def _through_experts(context: RankContext, payload: tuple[list[list[int]], bool]) -> list[Any] | None:
    rank = context.process
    routes, slower = payload
    ep = ExpertParallel(dist.group.WORLD, rank, 2, delayed=_Slower if slower else None)
    dispatch = ExpertDispatch(ep, EXPERTS, ExpertTraffic())
    x, experts = _tokens(rank, routes)
    x.requires_grad_(True)
    mine = _weights()[dispatch.first : dispatch.first + dispatch.local].clone().requires_grad_(True)
    order = experts.argsort(stable=True)
    counts = torch.bincount(experts, minlength=EXPERTS)
    rows, per_expert, handle = dispatch.dispatch(x[order], counts)
    local = torch.repeat_interleave(torch.arange(dispatch.local), per_expert)
    y = dispatch.combine(_apply(rows, local, mine), handle)
    out = torch.empty_like(y).index_copy(0, order, y)
    out.pow(2).sum().backward()
    traffic = dispatch.traffic
    result = (rank, out.detach(), x.grad, mine.grad, traffic.rows, traffic.calls, traffic.seconds)
    gathered: list[Any] | None = [None] * 2 if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    return gathered


def _plain(routes: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    weights = _weights().requires_grad_(True)
    outs = []
    for rank in range(2):
        x, experts = _tokens(rank, routes)
        x.requires_grad_(True)
        out = _apply(x, experts, weights)
        out.pow(2).sum().backward()
        outs.append((out.detach(), x.grad))
    return [(out, gx, weights.grad) for out, gx in outs]


@pytest.mark.parametrize(
    "routes",
    [
        [[0, 3, 1, 2, 2, 0], [1, 1, 3]],  # uneven: rank 0 sends 3 rows to each rank, rank 1 2 and 1
        [[0, 1, 0, 2], [1, 0, 2]],  # expert 3 gets no token on any rank: its gradient zero
        [[], [2, 3]],  # rank 0 routes nothing: it still takes part in every exchange
    ],
)
def test_dispatch_and_combine_equal_every_expert_in_one_process(routes: list[list[int]]) -> None:
    _check(routes, launch(_through_experts, (routes, False), 2, LaunchOptions(timeout_s=60)))


def test_an_injected_delay_slows_each_exchange_and_changes_nothing_else() -> None:
    """``ExpertParallel.delayed`` (the run's ``RankContext.delayed``) is waited on for all four exchanges."""
    routes = [[0, 3, 1, 2, 2, 0], [1, 1, 3]]
    results = launch(_through_experts, (routes, True), 2, LaunchOptions(timeout_s=60))
    _check(routes, results)
    assert all(seconds >= 4 * DELAY_S for *_, seconds in results)


def _check(routes: list[list[int]], results: list[Any]) -> None:
    plain = _plain(routes)
    whole = torch.zeros(EXPERTS, HIDDEN, HIDDEN)
    for rank, out, gx, gw, rows, calls, _ in results:
        torch.testing.assert_close(out, plain[rank][0])
        torch.testing.assert_close(gx, plain[rank][1])
        whole[2 * rank : 2 * rank + 2] = gw
        expected_rows = torch.bincount(torch.tensor(sum(routes, []), dtype=torch.int64), minlength=EXPERTS)
        assert rows.tolist() == expected_rows[2 * rank : 2 * rank + 2].tolist()
        assert calls == 4  # dispatch and combine, forward and backward
    torch.testing.assert_close(whole, plain[0][2])
    unused = [e for e in range(EXPERTS) if e not in sum(routes, [])]
    for e in unused:
        assert not whole[e].any()


def test_regrouping_puts_each_experts_rows_together_in_source_order() -> None:
    received = torch.tensor([[2, 0, 1], [1, 1, 0]])  # from rank 0: 2 rows for expert 0, 1 for expert 2; ...
    # arrival: r0e0 r0e0 r0e2 r1e0 r1e1 -> expert-major: r0e0 r0e0 r1e0 | r1e1 | r0e2
    assert _by_expert(received).tolist() == [0, 1, 3, 4, 2]


def test_splits_that_do_not_add_up_are_refused() -> None:
    with pytest.raises(ValueError, match="add up to 3 rows, not x's 2"):
        all_to_all(torch.zeros(2, 1), [2], [1, 2], None)
