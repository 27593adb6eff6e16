"""``--data`` of documents (JSON Lines, Parquet, a ``datasets`` folder) encoded by a local tokenizer (issue 32).

Every tokenizer here is trained in-process with the ``tokenizers`` library on a few kilobytes of text and saved
with ``save_pretrained``: nothing is downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest
import torch

from pipeweave.data import data_source, documents_source, step_microbatches
from pipeweave.data.documents import read_documents
from pipeweave.data.tokenized import load_tokenizer, tokenize
from pipeweave.errors import UserError
from pipeweave.models.spec import ModelSpec

DOCUMENTS = [
    f"Document {i}: the pipeline sends activations forward and gradients back, microbatch {i * 7 % 13}. " * (1 + i % 4)
    for i in range(60)
]
NOTHING_SPAWNED = ("pipeweave.runtime.run.launch._spawn",)


def _tokenizer(folder: Path, vocab: int = 300) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<unk>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text encodes
        show_progress=False,
    )
    bpe.train_from_iterator(DOCUMENTS, trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", unk_token="<unk>").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _jsonl(path: Path, documents: list[str] = DOCUMENTS) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(documents)))
    return path


def _own_encoding(tokenizer: Path, documents: list[str]) -> list[int]:
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    return [t for d in documents for t in [*own(d, add_special_tokens=False)["input_ids"], own.eos_token_id]]


def test_the_stream_is_the_tokenizers_own_encoding_of_the_documents(tmp_path: Path, tokenizer: Path) -> None:
    data = _jsonl(tmp_path / "docs.jsonl")
    stream = tokenize(data, "text", load_tokenizer(tokenizer))
    assert stream.tokens.tolist() == _own_encoding(tokenizer, DOCUMENTS)
    lengths = (stream.starts[1:] - stream.starts[:-1]).tolist()
    assert len(lengths) == len(DOCUMENTS) and stream.starts[-1] == len(stream.tokens)
    assert stream.tokens[stream.starts[1:] - 1].tolist() == [stream.eos] * len(DOCUMENTS)  # every document ends


def test_parquet_and_a_datasets_folder_give_the_jsonl_stream(tmp_path: Path, tokenizer: Path) -> None:
    import datasets
    import pyarrow
    import pyarrow.parquet

    table = pyarrow.table({"body": DOCUMENTS, "n": list(range(len(DOCUMENTS)))})
    pyarrow.parquet.write_table(table, tmp_path / "docs.parquet", row_group_size=7)  # several row groups
    datasets.Dataset.from_dict({"body": DOCUMENTS}).save_to_disk(str(tmp_path / "saved"))
    want = _own_encoding(tokenizer, DOCUMENTS)
    coder = load_tokenizer(tokenizer)
    for path in (tmp_path / "docs.parquet", tmp_path / "saved"):
        assert list(read_documents(path, "body")) == DOCUMENTS
        assert tokenize(path, "body", coder).tokens.tolist() == want, path


def test_the_cache_is_found_by_digest_and_changes_with_the_data(tmp_path: Path, tokenizer: Path) -> None:
    data = _jsonl(tmp_path / "docs.jsonl")
    coder = load_tokenizer(tokenizer)
    first = tokenize(data, "text", coder)
    cached = sorted((tmp_path / "docs.jsonl.tokens").glob("*.npy"))
    assert len(cached) == 2  # the stream and the documents' starts
    with patch("pipeweave.data.tokenized._encode", side_effect=AssertionError("encoded again")):
        again = tokenize(data, "text", coder)
    assert torch.equal(first.tokens, again.tokens)
    _jsonl(data, DOCUMENTS[:10])  # other bytes, another digest: encoded afresh
    assert tokenize(data, "text", coder).tokens.tolist() == _own_encoding(tokenizer, DOCUMENTS[:10])
    assert tokenize(data, "text", None).tokens.tolist() == [
        b for d in DOCUMENTS[:10] for b in [*d.encode(), 0]
    ]  # bytes, each document ended by NUL


def test_windows_pack_across_documents_or_keep_inside_one(tmp_path: Path, tokenizer: Path) -> None:
    data = _jsonl(tmp_path / "docs.jsonl")
    spec = ModelSpec(kind="gpt", layers=1, hidden=16, heads=2, vocab=300, seq_len=16)
    packed = documents_source(spec, data, batch_size=8, seed=3, tokenizer=tokenizer)
    x, y = packed.batch(0)
    assert x.dtype == torch.int64 and tuple(x.shape) == (8, 16) and torch.equal(x[:, 1:], y[:, :-1])
    stream = packed.tokens.tolist()
    for row in torch.cat([x, y[:, -1:]], 1).tolist():  # each window is a run of the stream
        assert any(stream[o : o + 17] == row for o in range(len(stream) - 16))
    inside = documents_source(spec, data, batch_size=8, seed=3, tokenizer=tokenizer, min_seq_len=4)
    starts = tokenize(data, "text", load_tokenizer(tokenizer)).starts
    for step in range(3):
        xs, ys = step_microbatches(inside, step, 2)
        for mx in xs:
            assert 4 <= mx.shape[1] <= 16
        offsets = _offsets(inside, step)
        document = torch.searchsorted(starts, offsets, right=True)
        assert torch.equal(document, torch.searchsorted(starts, offsets + 16, right=True))  # ends in it too


def _offsets(corpus: object, step: int) -> torch.Tensor:
    from pipeweave.data.corpus import _draw

    generator = torch.Generator().manual_seed(corpus.seed * 1_000_003 + step)  # type: ignore[attr-defined]
    return _draw(corpus.train_segments, corpus.seq_len, corpus.batch_size, generator)  # type: ignore[attr-defined]


def test_eval_data_is_drawn_from_its_own_stream(tmp_path: Path, tokenizer: Path) -> None:
    train, held = _jsonl(tmp_path / "train.jsonl", DOCUMENTS[:40]), _jsonl(tmp_path / "held.jsonl", DOCUMENTS[40:])
    spec = ModelSpec(kind="gpt", layers=1, hidden=16, heads=2, vocab=300, seq_len=8)
    source = documents_source(spec, train, batch_size=4, tokenizer=tokenizer, eval_path=held)
    x, _ = source.eval_batch(0)
    want = tokenize(held, "text", load_tokenizer(tokenizer)).tokens.tolist()
    for row in x.tolist():
        assert any(want[o : o + 8] == row for o in range(len(want) - 7))
    assert source.train_segments == [(0, len(source.tokens))]  # nothing of the training data held out


def test_an_hf_model_gets_its_inputs_as_labels(tmp_path: Path, tokenizer: Path) -> None:
    pytest.importorskip("transformers")
    spec = ModelSpec(
        kind="custom",
        entry="hf:gpt2",
        hf_config='{"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 300}',
        seq_len=8,
    )
    source = data_source(spec, batch_size=2, path=_jsonl(tmp_path / "d.jsonl"), tokenizer=tokenizer)
    x, y = source.batch(0)
    assert torch.equal(x, y) and tuple(x.shape) == (2, 8)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"text": "fine"}\n{"text": \n', "line 2 is not JSON"),
        ('{"body": "no text field"}\n', "line 1 has no field 'text' (it has: body); give --text-field FIELD"),
        ('{"text": 7}\n', "line 1: field 'text' holds int, not text; give --text-field naming a text field"),
        ("[1, 2]\n", "line 1 is a JSON list, not an object"),
    ],
)
def test_a_bad_record_is_one_line_naming_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line)
    with pytest.raises(UserError, match="--data") as err:
        list(read_documents(path))
    assert message in str(err.value) and len(str(err.value).splitlines()) == 1


GPT = ["train", "--model", "gpt", "--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--quiet"]


def test_bad_input_is_one_line_before_anything_spawns(
    cli_error: Callable[..., str], tmp_path: Path, tokenizer: Path
) -> None:
    data = _jsonl(tmp_path / "docs.jsonl")
    err = cli_error([*GPT, "--data", str(data), "--tokenizer", str(tokenizer), "--vocab", "256"], *NOTHING_SPAWNED)
    assert "has 300 tokens, more than the model's vocabulary of 256; give --vocab >= 300" in err, err
    err = cli_error([*GPT, "--data", str(data), "--tokenizer", str(tmp_path / "none")], *NOTHING_SPAWNED)
    assert "does not exist; give a tokenizer folder or tokenizer.json" in err, err
    (tmp_path / "empty").mkdir()
    err = cli_error([*GPT, "--data", str(data), "--tokenizer", str(tmp_path / "empty")], *NOTHING_SPAWNED)
    assert "is not a tokenizer transformers can load" in err, err
    err = cli_error([*GPT, "--data", str(data), "--text-field", "body"], *NOTHING_SPAWNED)
    assert "line 1 has no field 'body'" in err, err
    err = cli_error([*GPT, "--tokenizer", str(tokenizer)], *NOTHING_SPAWNED)
    assert "--tokenizer encodes the documents of --data and none is given" in err, err
    err = cli_error([*GPT, "--data", str(data), "--eval-data", str(data)], *NOTHING_SPAWNED)
    assert "is evaluated by --eval-every; give --eval-every N" in err, err
    err = cli_error([*GPT, "--data", str(tmp_path)], *NOTHING_SPAWNED)
    assert "is a folder without state.json and dataset_info.json" in err, err


@pytest.mark.distributed
def test_a_jsonl_file_trains_as_plain_training_on_its_tokens(tmp_path: Path, tokenizer: Path) -> None:
    from pipeweave.config import TrainConfig
    from pipeweave.runtime.plain import run_plain
    from pipeweave.runtime.run.job import run_rank
    from pipeweave.runtime.run.launch import LaunchOptions, launch
    from pipeweave.runtime.run.prepare import optimizer_factory, prepare, run_data

    data = _jsonl(tmp_path / "docs.jsonl")
    config = TrainConfig(
        schedule="1f1b",
        num_stages=2,
        num_microbatches=2,
        batch_size=4,
        steps=3,
        quiet=True,
        out=str(tmp_path),
        model=ModelSpec(kind="gpt", layers=2, hidden=16, heads=2, vocab=300, seq_len=8),
        path=str(data),
        tokenizer=str(tokenizer),
        transport="gloo",
    )
    plan = prepare(config)
    record = launch(run_rank, plan, plan.num_processes, LaunchOptions(timeout_s=90))
    source = run_data(config)
    assert np.isin(source.batch(0)[0].numpy(), np.asarray(_own_encoding(tokenizer, DOCUMENTS))).all()
    plain = run_plain(
        config.model,
        steps=3,
        batch_size=4,
        num_microbatches=2,
        optimizer_factory=optimizer_factory(config),
        data=source,
    )
    torch.testing.assert_close(record.losses, plain.losses, rtol=1e-5, atol=1e-6)
