"""StageWorker: split backward equals full backward without holding the graph twice; recomputation; U."""

from __future__ import annotations

import pytest
import torch

from pipeweave.models import ModelSpec, uniform_parts
from pipeweave.models.layers import Deferrable
from pipeweave.runtime.stage.worker import StageWorker

MLP = ModelSpec(kind="mlp", layers=4, hidden=16)
GPT = ModelSpec(kind="gpt", layers=2, hidden=16, heads=2, seq_len=8)
BATCH = 6


pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(spec: ModelSpec, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if spec.kind == "mlp":
        return torch.randn(BATCH, spec.hidden, generator=g), torch.randn(BATCH, spec.hidden, generator=g)
    shape = (BATCH, spec.seq_len)
    return torch.randint(0, 256, shape, generator=g), torch.randint(0, 256, shape, generator=g)


def _pipeline(spec: ModelSpec, num_stages: int = 2, **options: object) -> list[StageWorker]:
    return [StageWorker(spec, part, batch_size=BATCH, **options) for part in uniform_parts(spec.num_layers, num_stages)]  # type: ignore[arg-type]


def _forward(workers: list[StageWorker], mb: int, x: torch.Tensor, y: torch.Tensor) -> float:
    for w in workers[:-1]:
        x = w.forward(mb, x)
    return float(workers[-1].forward(mb, x, y))


def _backward(workers: list[StageWorker], mb: int, split: bool) -> torch.Tensor | None:
    grad = None
    for w in reversed(workers):
        grad = w.backward_input(mb, grad) if split else w.backward(mb, grad)
    return grad


def _grads(workers: list[StageWorker]) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for w in workers for k, p in w.module.named_parameters() if p.grad is not None}


def _whole_model_grads(spec: ModelSpec, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    (w,) = _pipeline(spec, 1)
    w.forward(0, x, y)
    w.backward(0)
    return _grads([w])


@pytest.mark.parametrize("spec", [MLP, GPT], ids=["mlp", "gpt"])
def test_split_backward_equals_full_backward(spec: ModelSpec) -> None:
    x, y = _batch(spec)
    full, split = _pipeline(spec, 3), _pipeline(spec, 3)
    _forward(full, 0, x, y)
    _backward(full, 0, split=False)
    _forward(split, 0, x, y)
    _backward(split, 0, split=True)
    deferred = [p for w in split for m in w.module.modules() if isinstance(m, Deferrable) for p in m.parameters()]
    assert deferred and all(p.grad is None for p in deferred)  # I computed no matmul weight gradient
    for w in split:
        w.backward_weight(0)
    want = _grads(full)
    assert len(want) == sum(1 for w in full for _ in w.module.parameters())
    got = _grads(split)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7, msg=key)
    # And the pipelined gradients are those of the model in one piece.
    whole = _whole_model_grads(spec, x, y)
    for key in want:
        torch.testing.assert_close(want[key], whole[key], rtol=1e-5, atol=1e-6, msg=key)


def test_input_gradient_sent_back_is_the_true_gradient() -> None:
    x, y = _batch(MLP)
    first, last = _pipeline(MLP, 2)
    h = first.forward(0, x)
    last.forward(0, h, y)
    grad_h = last.backward_input(0, None)
    # Independent: differentiate the last stage's loss in h directly with autograd.
    h2 = h.clone().requires_grad_()
    out = h2
    for layer in last.module.values():
        out = layer(out)
    (last.loss(out, y) * 1.0).backward()
    assert grad_h is not None
    torch.testing.assert_close(grad_h, h2.grad, rtol=1e-5, atol=1e-7)
    assert first.backward_input(0, grad_h) is None  # the first stage has no input gradient to send


@pytest.mark.parametrize("spec", [MLP, GPT], ids=["mlp", "gpt"])
def test_split_backward_frees_the_graph_and_keeps_only_what_w_needs(spec: ModelSpec) -> None:
    x, y = _batch(spec)
    workers = _pipeline(spec, 2)
    _forward(workers, 0, x, y)
    held_after_f = [w.activation_bytes() for w in workers]
    _backward(workers, 0, split=True)
    for w, before in zip(workers, held_after_f):
        stash = {t.untyped_storage().data_ptr() for _, held in w._weight_grads[0] for t in held}
        # Every storage still counted belongs to a deferred W: no autograd graph is alive.
        assert set(w.meter.live) == stash - w.meter.exclude
        # Not doubled: what W keeps (matmul inputs and output gradients) is less than the forward kept.
        assert 0 < w.activation_bytes() < before
    for w in workers:
        w.backward_weight(0)
        assert w.activation_bytes() == 0 and w.in_flight == []


def test_activation_bytes_hand_counted_for_recompute() -> None:
    x, y = _batch(MLP)
    first, last = _pipeline(MLP, 2, recompute=True)
    h = first.forward(0, x)
    # Only the stage input is kept: BATCH x hidden float32 each.
    assert first.activation_bytes() == BATCH * MLP.hidden * 4
    last.forward(0, h, y)
    assert last.activation_bytes() == BATCH * MLP.hidden * 4


def test_recompute_gives_the_same_gradients_and_holds_less() -> None:
    stored, replayed = _pipeline(GPT, 2), _pipeline(GPT, 2, recompute=True)
    batches = [_batch(GPT, seed) for seed in range(3)]
    for workers in (stored, replayed):
        for mb, (x, y) in enumerate(batches):  # three microbatches in flight, as in GPipe
            _forward(workers, mb, x, y)
    peak_stored = [w.peak_activation_bytes() for w in stored]
    peak_replayed = [w.activation_bytes() for w in replayed]
    for workers in (stored, replayed):
        for mb in range(3):
            _backward(workers, mb, split=False)
    want, got = _grads(stored), _grads(replayed)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    for s, r in zip(peak_stored, peak_replayed):
        assert r * 10 < s  # inputs only: a small fraction of a transformer stage's activations


def test_update_is_an_sgd_step_after_combining() -> None:
    (w,) = _pipeline(MLP, 1, optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.5))
    x, y = _batch(MLP)
    before = {k: p.detach().clone() for k, p in w.named_parameters().items()}
    w.forward(0, x, y)
    w.backward(0)
    grads = {k: p.grad.clone() for k, p in w.named_parameters().items()}
    calls = []

    def double(worker: StageWorker) -> None:  # stands in for an all-reduce over two equal replicas
        calls.append(worker)
        for g in worker.gradients():
            g.mul_(2)

    w.update(combine=double)
    assert calls == [w]
    for k, p in w.named_parameters().items():
        torch.testing.assert_close(p.detach(), before[k] - 0.5 * 2 * grads[k], rtol=1e-6, atol=1e-7)
        assert p.grad is None


def test_loss_is_scaled_by_the_microbatch_share() -> None:
    (w,) = _pipeline(MLP, 1)
    x, y = _batch(MLP)
    parts = [float(w.forward(j, xs, ys)) for j, (xs, ys) in enumerate(zip(x.tensor_split(4), y.tensor_split(4)))]
    (whole,) = _pipeline(MLP, 1)
    assert sum(parts) == pytest.approx(float(whole.forward(0, x, y)), rel=1e-6)


def test_order_errors_are_reported() -> None:
    first, last = _pipeline(MLP, 2)
    x, _ = _batch(MLP)
    with pytest.raises(RuntimeError, match="before its F"):
        first.backward(0, torch.zeros(BATCH, MLP.hidden))
    with pytest.raises(RuntimeError, match="before its I"):
        first.backward_weight(0)
    first.forward(0, x)
    with pytest.raises(RuntimeError, match="twice"):
        first.forward(0, x)
    with pytest.raises(RuntimeError, match="target"):
        last.forward(0, x)


def test_weight_bytes_counts_parameters() -> None:
    (w,) = _pipeline(MLP, 1)
    h = MLP.hidden
    per_block = 2 * h + (h * 4 * h + 4 * h) + (4 * h * h + h)  # LayerNorm, up, down
    assert w.weight_bytes() == 4 * MLP.layers * per_block


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_gradients_prepared_in_a_wait_change_no_number(kind: str) -> None:
    """``prepare_gradients`` (zeros before the step's first backward) gives the same updates, step after step."""
    spec = (
        ModelSpec(kind="mlp", layers=2, hidden=8)
        if kind == "mlp"
        else ModelSpec(kind="gpt", layers=2, hidden=16, heads=2, seq_len=6, vocab=32)
    )
    workers = [StageWorker(spec, range(spec.num_layers), batch_size=4, track_memory=False) for _ in range(2)]
    generator = torch.Generator().manual_seed(0)
    for _step in range(3):
        if kind == "mlp":
            x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)
        else:
            x, y = torch.randint(0, 32, (4, 6), generator=generator), torch.randint(0, 32, (4, 6), generator=generator)
        workers[1].prepare_gradients()
        assert all(p.grad is not None and not p.grad.any() for p in workers[1].module.parameters())
        for w in workers:
            for j in range(2):
                w.forward(j, x[2 * j : 2 * j + 2], target=y[2 * j : 2 * j + 2])
            w.backward(0)
        before = [p.grad.clone() for p in workers[1].module.parameters()]
        workers[1].prepare_gradients()  # after a backward of the step: leaves the gradients alone
        assert all(torch.equal(a, p.grad) for a, p in zip(before, workers[1].module.parameters()))
        for w in workers:
            w.backward(1)
        for a, b in zip(workers[0].module.parameters(), workers[1].module.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-7)
        for w in workers:
            w.update()
    for (name, a), b in zip(workers[0].named_parameters().items(), workers[1].named_parameters().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7, msg=name)
