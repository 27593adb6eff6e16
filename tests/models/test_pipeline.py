"""``pipeweave.pipeline`` in one process: the split, the shared and tied parameters, Hugging Face models, bad input.

The distributed runs are in ``tests/runtime/test_split_module.py``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from config_defaults import train_config
from torch import nn

import pipeweave
from pipeweave.errors import UserError
from pipeweave.models import LayerModel, ModelSpec, build_layers
from pipeweave.models.boundary import call
from pipeweave.models.hf import save_pretrained
from pipeweave.models.layers import Linear, TransposedLinear
from pipeweave.runtime.reference import run_reference
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.schedule import generate

MODELS = Path(__file__).resolve().parent
sys.path.insert(0, str(MODELS))
import tiny_modules  # noqa: E402

DATA = torch.utils.data.TensorDataset(torch.zeros(4, 4), torch.zeros(4, 4))
GPT2 = json.dumps(
    {
        "n_layer": 2,
        "n_embd": 32,
        "n_head": 2,
        "vocab_size": 256,
        "n_positions": 32,
        "resid_pdrop": 0,
        "embd_pdrop": 0,
        "attn_pdrop": 0,
    }
)


@pytest.mark.slow
def test_the_parts_compute_the_module_and_hold_its_parameters() -> None:
    torch.manual_seed(0)
    net = tiny_modules.Looped()
    tokens = torch.randint(0, tiny_modules.VOCAB, (3, tiny_modules.SEQ))
    model = pipeweave.pipeline(net, (tokens[:2],), ["blocks.1", "blocks.2"], loss=tiny_modules.token_loss, dataset=DATA)
    builders = list(model.layers)
    assert len(builders) == 3
    parts = [b.args[0] for b in builders]  # the parts themselves (each build copies one)
    x = tokens  # three samples: the batch dimension is traced as dynamic
    for part in parts:
        x = call(part, x)
    torch.testing.assert_close(x, net(tokens), rtol=0, atol=0)
    ids = {id(p) for p in net.parameters()}
    assert all(id(p) in ids for part in parts for p in part.parameters())  # shared, not copied
    assert model.tied == [["0.head.weight", "2.head.weight"]]  # the tied head, found
    linears = [m for part in parts for m in part.modules() if isinstance(m, Linear)]
    assert len(linears) >= 3 * 2 + 1  # the blocks' MLPs and the head: deferrable


@pytest.mark.slow
def test_only_the_hidden_states_cross_a_split_of_a_transformers_gpt2() -> None:
    spec = ModelSpec(kind="custom", entry="hf:gpt2", hf_config=GPT2, seq_len=16)
    layers = build_layers(spec, range(spec.num_layers))
    x = spec.custom.dataset[0][0].unsqueeze(0).repeat(3, 1)
    for layer in layers[:-1]:
        x = call(layer, x)
        assert isinstance(x, torch.Tensor) and x.shape == (3, 16, 32)  # masks and positions recomputed per part
    assert any(isinstance(m, TransposedLinear) for m in layers[1].modules())  # Conv1D, deferrable
    assert layers[0].get_parameter("lm_head.weight") is layers[-1].get_parameter("lm_head.weight")  # one build


def test_zb_h1_on_a_transformers_gpt2_equals_its_unsplit_training_and_saves_for_from_pretrained(tmp_path: Path) -> None:
    from unsplit import train_unsplit

    spec = ModelSpec(kind="custom", entry="hf:gpt2", hf_config=GPT2, seq_len=16)
    config = train_config(schedule="zb-h1", num_stages=2, num_microbatches=4, model=spec, batch_size=8, steps=2)
    run = run_reference(generate("zb-h1", num_stages=2, num_microbatches=4), spec, steps=2, batch_size=8)
    losses, params = train_unsplit(config)
    torch.testing.assert_close(run.losses, losses, rtol=1e-5, atol=1e-6)
    save_pretrained(spec.entry or "", spec.hf_config, run.parameters, str(tmp_path / "gpt2"))
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2")
    for name, value in loaded.named_parameters():
        torch.testing.assert_close(value, params[name].detach(), rtol=1e-5, atol=1e-6)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # still tied


def test_a_tied_group_spread_inside_a_pipeline_is_one_line() -> None:
    spec = ModelSpec(kind="custom", entry=f"{MODELS / 'tiny_modules.py'}:shared_in_the_middle")
    with pytest.raises(UserError, match="inside the pipeline"):
        run_reference(generate("1f1b", num_stages=3, num_microbatches=3), spec, steps=1, batch_size=6)


def test_tied_members_of_two_shapes_are_one_line() -> None:
    model = LayerModel(
        layers=[lambda: nn.Linear(4, 4), lambda: nn.Linear(4, 3)],
        loss=nn.functional.mse_loss,
        dataset=DATA,
        tied=[["0.weight", "1.weight"]],
    )
    with pytest.raises(UserError, match=r"tied parameters 0.weight \(4, 4\) and 1.weight \(3, 4\) differ in shape"):
        from pipeweave.models.tied import tie

        tie(model.tied, {0: model.layers[0](), 1: model.layers[1]()}, lambda k: model.layers[k]())


def test_a_declared_tie_starts_as_its_first_member_and_is_one_parameter_in_one_build() -> None:
    spec = ModelSpec(kind="custom", entry=f"{MODELS / 'tiny_modules.py'}:declared")
    first, second = build_layers(spec, [0, 1])
    assert first.weight is second.weight
    (alone,) = build_layers(spec, [1])
    assert torch.equal(alone.weight, first.weight) and alone.weight is not first.weight
    worker = StageWorker(spec, range(2), batch_size=4)
    assert len(list(worker.module.parameters())) == 3  # one weight, two biases


@pytest.mark.parametrize(
    "points, message",
    [
        (["blocks.7"], "split point 'blocks.7' names no submodule of Looped; name one of its modules, e.g. blocks.0"),
        (["blocks.1", "blocks.1"], "name a module twice"),
        (["blocks"], None),
        (2.5, "split_points=2.5 is a float, not a list of module names; give e.g. ['blocks.2'], an int D"),
        ([None], "split_points=[None] holds None, a NoneType; give module names (strings), e.g. ['blocks.2']"),
        (
            ["blocks.2", "blocks.1"],
            "out of the order the forward runs them; give them in order: ['blocks.1', 'blocks.2']",
        ),
        (["embed", "blocks.1"], "split point 'embed' is where Looped's forward starts: it would leave an empty first"),
    ],
)  # the last four were a TypeError, an AttributeError, a silent sort and a cut silently dropped
def test_bad_split_points_are_one_line(points: list[str], message: str | None) -> None:
    tokens = torch.zeros(2, tiny_modules.SEQ, dtype=torch.long)
    if message is None:  # a container is a module too: the cut falls before its first block
        assert (
            len(
                pipeweave.pipeline(
                    tiny_modules.Looped(), (tokens,), points, loss=tiny_modules.token_loss, dataset=DATA
                ).layers
            )
            == 2
        )
        return
    with pytest.raises(UserError, match=re.escape(message)):
        pipeweave.pipeline(tiny_modules.Looped(), (tokens,), points, loss=tiny_modules.token_loss, dataset=DATA)


def test_split_points_of_an_nn_sequential_out_of_order_are_one_line() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    with pytest.raises(UserError, match=re.escape("split points ['2', '1'] are out of the order the forward runs")):
        pipeweave.pipeline(net, None, ["2", "1"], loss=nn.functional.mse_loss, dataset=DATA)  # was sorted silently


class _Branchy(nn.Module):  # the branch is in the forward itself, outside the blocks: fx cannot keep it whole
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # a Python branch on a tensor's value: export cannot trace it
            return self.blocks[1](self.blocks[0](x))
        return x


def test_an_untraceable_module_is_one_line_with_the_reason_and_the_workaround() -> None:
    with pytest.raises(UserError) as caught:
        pipeweave.pipeline(_Branchy(), (torch.ones(2, 4),), ["blocks.1"], loss=nn.functional.mse_loss, dataset=DATA)
    text = str(caught.value)
    assert "\n" not in text and text.startswith("torch.export cannot trace _Branchy: GuardOnDataDependentSymNode: ")
    assert "(nor torch.fx: TraceError: symbolically traced variables cannot be used as inputs to control flow)" in text
    assert "torch.cond" in text and "nn.Sequential" in text


def test_an_asynchronous_schedule_refuses_tied_parameters_in_one_line() -> None:
    spec = ModelSpec(kind="custom", entry=f"{MODELS / 'tiny_modules.py'}:declared")
    with pytest.raises(UserError, match="tied parameters .* asynchronous pipedream-2bw, .* only, not pipemare; "):
        run_reference(generate("pipemare", num_stages=2, num_microbatches=2, num_steps=2), spec, steps=2, batch_size=4)


def test_hf_config_and_model_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeweave.cli import main

    assert main(["train", "--model", "hf:gpt2", "--hf-config", "{n_layer: 2}"]) == 2
    assert "is not a JSON object" in capsys.readouterr().err
    assert main(["train", "--model", "gpt", "--hf-config", "{}"]) == 2
    assert "--hf-config applies to --model hf:TYPE only" in capsys.readouterr().err
    assert main(["train", "--model", "hf:nonesuch"]) == 2
    err = capsys.readouterr().err
    assert "Unrecognized model identifier: nonesuch; name a transformers model type" in err and err.count("\n") == 1


def test_split_points_d_cuts_where_the_time_partitioner_splits_the_profiled_pieces_once_for_every_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pipeweave.pipelining as pipelining
    import pipeweave.runtime.profile as profile
    from pipeweave.partition import partition

    monkeypatch.setenv("PIPEWEAVE_CACHE", str(tmp_path))
    profiled, measured = [], []

    def spy(spec: ModelSpec, microbatch_size: int, **options: object) -> object:
        profiled.append((spec.custom, microbatch_size, real(spec, microbatch_size, **options)))
        return profiled[-1][2]

    real, layer = pipelining.profile_model, profile._profile_layer
    monkeypatch.setattr(pipelining, "profile_model", spy)
    monkeypatch.setattr(profile, "_profile_layer", lambda *a, **k: measured.append(1) or layer(*a, **k))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the launcher
        model = tiny_modules.uneven()
        torch.set_num_threads(1)  # a rank: reads the launcher's costs (measures nothing), so cuts where it cut
        assert tiny_modules.uneven().split_points == model.split_points and len(measured) == 4
    finally:
        torch.set_num_threads(threads)
    (pieces, samples, costs), _ = profiled
    assert samples == 8 and pieces.split_points == ("blocks.1", "blocks.2", "blocks.3")  # a piece per block
    counts = partition("time", costs, 2).counts
    assert model.split_points == (pieces.split_points[counts[0] - 1],) and len(model.layers) == 2
    # which cut that is depends on the measured times (on a quiet machine: blocks.1, the wide block alone); the
    # names for given costs are checked in the next test


def test_split_points_d_maps_the_partition_back_to_module_names(monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeweave.pipelining as pipelining
    from pipeweave.partition import LayerCosts

    def made_up(spec: ModelSpec, microbatch_size: int, **options: object) -> LayerCosts:
        return LayerCosts(**{**LayerCosts.uniform(4).to_json(), "forward": [4, 1, 1, 5]})  # F+I+W 6, 3, 3, 7

    monkeypatch.setattr(pipelining, "profile_model", made_up)
    data = tiny_modules.uneven_data()
    three = pipeweave.pipeline(
        tiny_modules.Uneven(), (data.tensors[0][:2],), 3, loss=nn.functional.mse_loss, dataset=data
    )
    assert three.split_points == ("blocks.1", "blocks.3")  # (1, 2, 1): 6, 6 and 7
    with pytest.raises(UserError, match=r"^split_points=5 parts, but the module has 4 pieces to group"):
        pipeweave.pipeline(tiny_modules.Uneven(), (data.tensors[0][:2],), 5, loss=nn.functional.mse_loss, dataset=data)


def test_a_module_export_refuses_is_traced_by_fx_with_its_blocks_kept_whole() -> None:
    from pipeweave.models.tracing import export

    torch.manual_seed(0)
    net = tiny_modules.Routed()
    tokens = torch.randint(0, tiny_modules.VOCAB, (3, tiny_modules.SEQ))
    with pytest.raises(Exception, match="data-dependent"):  # if routed.any(): a branch on tensor values
        export(net, (tokens[:2],))
    model = pipeweave.pipeline(net, (tokens[:2],), ["blocks.1"], loss=tiny_modules.token_loss, dataset=DATA)
    assert model.split_points == ("blocks.1",) and len(model.layers) == 2
    parts = [b.args[0] for b in model.layers]
    assert [type(m).__name__ for _, m in parts[1].named_children()] == ["Module", "Linear"]  # blocks.1-2, head
    x = tokens  # three samples: the batch is dynamic
    for part in parts:
        x = call(part, x)
    torch.testing.assert_close(x, net(tokens), rtol=0, atol=0)


def test_a_split_module_s_dataset_is_cut_to_lengths_of_its_own_and_bad_lengths_are_one_line() -> None:
    from pipeweave.data import data_source, step_microbatches

    looped = ModelSpec(kind="custom", entry=f"{MODELS / 'tiny_modules.py'}:looped")
    source = data_source(looped, batch_size=8, min_seq_len=3)
    lengths = [x.shape[1] for step in range(3) for x in step_microbatches(source, step, 4)[0]]
    assert len(set(lengths)) > 2 and all(3 <= n <= tiny_modules.SEQ for n in lengths)
    with pytest.raises(UserError, match=r"^--min-seq-len 9 is invalid; give a length in \[1, 8\] \(the dataset's"):
        train_config(model=looped, min_seq_len=9)
    sequential = ModelSpec(kind="custom", entry=f"{MODELS / 'tiny_modules.py'}:sequential")
    with pytest.raises(UserError, match=r"the model's samples are \[\(8,\), \(4,\)\]: give inputs and targets that"):
        train_config(model=sequential, min_seq_len=2)


def test_split_points_d_in_a_module_file_is_one_line_naming_partition_time(tmp_path: Path) -> None:
    path = tmp_path / "net.py"
    path.write_text(
        f"import sys\nsys.path.insert(0, {str(MODELS)!r})\n"
        "from tiny_modules import plain_factory, loss, dataset\nsplit_points = 2\n"
    )
    with pytest.raises(
        UserError,
        match=r"split_points = 2 asks for a split balanced by the profiler, which the "
        r"command line does by itself: drop split_points and give --partition time$",
    ):
        ModelSpec(kind="custom", entry=f"{path}:plain_factory").custom  # noqa: B018 - reading it raises


LLAMA = json.dumps(
    {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 256,
        "max_position_embeddings": 32,
        "tie_word_embeddings": True,
    }
)


@pytest.mark.slow
@pytest.mark.parametrize("entry, config", [("hf:gpt2", GPT2), ("hf:llama", LLAMA)])
def test_masks_positions_and_rotary_tables_recomputed_per_part_follow_the_sequence_length(
    entry: str, config: str
) -> None:
    from unsplit import unsplit_module

    spec = ModelSpec(kind="custom", entry=entry, hf_config=config, seq_len=16)
    layers, net = build_layers(spec, range(spec.num_layers)), unsplit_module(spec)
    tokens = spec.custom.dataset.tokens[:3]
    for length in (16, 9, 4):  # traced at 16: shorter sequences through the same parts
        x = tokens[:, :length]
        for layer in layers:
            x = call(layer, x)
        logits = x.logits if hasattr(x, "logits") else x
        torch.testing.assert_close(logits, net(tokens[:, :length]).logits, rtol=0, atol=0)


def test_an_example_sliced_out_of_longer_windows_traces_a_graph_that_takes_contiguous_batches() -> None:
    """``windows[:2, :-1]`` (inputs cut from (input, target) windows, as a dataset holds them) is strided; the
    batches the ranks feed are contiguous: the traced graph takes them and computes the module."""
    from pipeweave.models.tracing import export

    torch.manual_seed(0)
    net = tiny_modules.Looped()
    windows = torch.randint(0, tiny_modules.VOCAB, (3, tiny_modules.SEQ + 1))
    tokens = windows[:, :-1].contiguous()
    torch.testing.assert_close(export(net, (windows[:2, :-1],))(tokens), net(tokens), rtol=0, atol=0)
