"""Offline data: the standard-library corpus, byte windows, the mlp's fixed batch, microbatch splits."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from pipeweave.data import ByteCorpus, RandomRegression, data_source, split_microbatches, stdlib_sources
from pipeweave.errors import UserError
from pipeweave.models import ModelSpec, loss_fn


def test_stdlib_corpus_is_real_source_in_sorted_order() -> None:
    text = stdlib_sources(max_bytes=200_000)
    assert len(text) == 200_000
    assert stdlib_sources(max_bytes=200_000) == text  # deterministic
    # os.walk yields the root's own files before any subdirectory's: the corpus opens with
    # the first .py file of the stdlib root in sorted order.
    root = Path(sysconfig.get_paths()["stdlib"])
    first = sorted(p.name for p in root.glob("*.py"))[0]
    head = (root / first).read_bytes()[:1000]
    assert text.startswith(head)
    assert b"def " in text and b"import " in text


def test_windows_are_shifted_by_one_byte_and_come_from_the_text() -> None:
    text = bytes(range(200))  # each byte's value is its offset, so windows can be checked exactly
    corpus = ByteCorpus(text, seq_len=10, batch_size=4, seed=1)
    x, y = corpus.batch(5)
    assert x.shape == y.shape == (4, 10) and x.dtype == torch.int64
    for row_x, row_y in zip(x, y):
        start = int(row_x[0])
        assert row_x.tolist() == list(range(start, start + 10))
        assert row_y.tolist() == list(range(start + 1, start + 11))
    again, _ = ByteCorpus(text, seq_len=10, batch_size=4, seed=1).batch(5)
    assert torch.equal(again, x)
    assert not torch.equal(corpus.batch(6)[0], x)


def test_short_corpus_and_missing_file_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="seq_len"):
        ByteCorpus(b"abc", seq_len=8, batch_size=1)
    spec = ModelSpec(kind="gpt", hidden=8, heads=2, seq_len=4)
    with pytest.raises(UserError, match="cannot read"):
        data_source(spec, batch_size=2, path=tmp_path / "missing.txt")
    with pytest.raises(UserError, match="--model gpt"):
        data_source(ModelSpec(kind="mlp"), batch_size=2, path=tmp_path / "x.txt")


def test_text_file_given_by_path(tmp_path: Path) -> None:
    path = tmp_path / "tiny.txt"
    path.write_bytes(b"hello world " * 10)
    x, y = data_source(ModelSpec(kind="gpt", hidden=8, heads=2, seq_len=5), batch_size=3, path=path).batch(0)
    assert set(x.flatten().tolist()) <= set(b"hello world ")


def test_regression_batch_is_fixed_and_seeded() -> None:
    a = RandomRegression(hidden=3, batch_size=5, seed=2)
    assert torch.equal(a.batch(0)[0], a.batch(9)[0])
    assert torch.equal(a.batch(0)[1], RandomRegression(hidden=3, batch_size=5, seed=2).batch(0)[1])
    assert not torch.equal(a.batch(0)[0], RandomRegression(hidden=3, batch_size=5, seed=3).batch(0)[0])


def test_split_follows_tensor_split_and_rejects_too_few_samples() -> None:
    assert [len(m) for m in split_microbatches(torch.arange(10), 4)] == [3, 3, 2, 2]
    assert torch.equal(torch.cat(split_microbatches(torch.arange(10), 4)), torch.arange(10))
    with pytest.raises(UserError, match="cannot make 5 microbatches"):
        split_microbatches(torch.arange(4), 5)
    with pytest.raises(UserError, match="num_microbatches=0"):
        split_microbatches(torch.arange(4), 0)


@pytest.mark.parametrize("spec", [ModelSpec(kind="mlp", hidden=4), ModelSpec(kind="gpt", hidden=4, heads=2, seq_len=3)])
def test_scaled_microbatch_losses_sum_to_the_batch_mean(spec: ModelSpec) -> None:
    g = torch.Generator().manual_seed(0)
    if spec.kind == "mlp":
        out, target = torch.randn(7, 4, generator=g), torch.randn(7, 4, generator=g)
    else:
        out, target = torch.randn(7, 3, 256, generator=g), torch.randint(0, 256, (7, 3), generator=g)
    loss = loss_fn(spec)
    parts = zip(split_microbatches(out, 3), split_microbatches(target, 3))
    total = sum(float(loss(o, t)) * len(t) / 7 for o, t in parts)
    assert total == pytest.approx(float(loss(out, target)), rel=1e-6)


@pytest.mark.parametrize(("length", "seq_len"), [(8 << 20, 128), (1 << 20, 64), (5000, 16), (1000, 9)])
def test_held_out_blocks_are_spread_disjoint_and_never_in_a_training_window(length: int, seq_len: int) -> None:
    from pipeweave.data.corpus import HELD_OUT, split_blocks

    train, held = split_blocks(length, seq_len)
    assert held and train
    covered = sorted(train + held)
    assert all(b <= c for (_, b), (c, _) in zip(covered, covered[1:]))  # disjoint
    share = sum(b - a for a, b in held) / length
    assert 0.5 / HELD_OUT <= share <= 1.5 / HELD_OUT
    if length >= HELD_OUT * (64 << 10):  # the standard library's size: held-out blocks all over the text
        assert held[0][1] < length / 2 and len(held) >= 5
    # The held-out bytes are "b", every other byte "a": a window that strays over the border shows it.
    text = bytearray(b"a" * length)
    for a, b in held:
        text[a:b] = b"b" * (b - a)
    corpus = ByteCorpus(bytes(text), seq_len=seq_len, batch_size=256, seed=0)
    for k in range(8):
        x, y = corpus.batch(k)
        assert set(x.unique().tolist()) | set(y.unique().tolist()) == {ord("a")}
        x, y = corpus.eval_batch(k)
        assert set(x.unique().tolist()) | set(y.unique().tolist()) == {ord("b")}
    assert torch.equal(corpus.eval_batch(3)[0], corpus.eval_batch(3)[0])  # the same held-out batches every time


def test_a_text_too_short_to_hold_out_a_window_trains_on_all_of_it() -> None:
    corpus = ByteCorpus(b"x" * 30, seq_len=9, batch_size=2)
    assert corpus.held_out == [] and corpus.train_segments == [(0, 30)]
    with pytest.raises(UserError, match="too few to hold out a window"):
        corpus.eval_batch(0)
