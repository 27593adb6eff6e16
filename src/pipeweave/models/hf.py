"""Hugging Face causal language models (``--model hf:gpt2 --hf-config '{...}'``), built offline from a config,
or from a folder of pretrained weights (``--model hf:PATH``: ``models.pretrained``).

``hf:NAME`` names a ``transformers`` model type (``gpt2``, ``llama``, any
causal LM ``AutoModelForCausalLM`` knows); ``--hf-config`` is a JSON object,
on the command line or in a file, of its config's fields. The model is built
by ``from_config`` (nothing downloaded), split by ``pipeweave.pipeline``
before each decoder block, and trained on the built-in byte corpus
(``--seq-len`` tokens a sample, bytes as token ids, so ``vocab_size`` must be
at least 256) with the model's own loss (``model.loss_function``: labels are
the inputs, shifted inside). ``save_pretrained`` turns a run's parameters back
into a folder ``from_pretrained`` loads.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeweave.errors import UserError
from pipeweave.models.custom import LayerModel
from pipeweave.models.hf_config import built, config_fields, make_config
from pipeweave.models.hf_tp import hf_tp_plan
from pipeweave.models.materialise import Initialiser, MetaLayer, Slice, materialise, meta_parameters
from pipeweave.models.pipeline import pipeline
from pipeweave.models.pretrained import Weights, folder_of

PREFIX = "hf:"
_CORPUS_BYTES = 1 << 20  # 1 MiB of the standard library's sources: enough windows for a demo run


def is_hf(entry: str | None) -> bool:
    """Whether ``entry`` names a Hugging Face model (``hf:NAME``)."""
    return entry is not None and entry.startswith(PREFIX)


def build_module(entry: str, config_text: str | None, seed: int, seq_len: int | None = None) -> nn.Module:
    """The whole ``transformers`` model on this process, initialised as the ranks initialise their parts: its own
    ``_init_weights`` under a seed per tensor name (``models.materialise``), the same for any split.

    Raises:
        UserError: transformers missing; a config field it does not know or refuses (``models.hf_config``);
            ``seq_len`` (tokens a sample) beyond the positions the model embeds.
    """
    module = meta_built(entry, config_text, seq_len)
    source = Initialiser(module, param_init=module._init_weights, seed=seed)
    return materialise(module, source.names, source)


def meta_built(entry: str, config_text: str | None, seq_len: int | None = None) -> nn.Module:
    """The ``transformers`` model with its parameters on the meta device (no memory) and its buffers computed
    (rotary tables: ``models.materialise.meta_parameters``).

    Raises:
        UserError: as ``build_module``.
    """
    transformers = import_transformers(entry)
    fields = config_fields(config_text)
    config = trained_config(transformers, entry, config_text)
    if seq_len is not None:
        _check_positions(entry, config, seq_len)
    with meta_parameters():
        module = built(entry, fields, lambda: transformers.AutoModelForCausalLM.from_config(config))
    if getattr(module, "loss_type", None) is None:  # the loss transformers falls back to, chosen without its warning
        module.loss_type = "ForCausalLM"
    return module  # type: ignore[no-any-return]


def meta_module(entry: str, config_text: str | None) -> nn.Module:
    """The ``transformers`` model of ``hf:NAME`` on the meta device: its names, shapes and tied groups, no memory.

    Raises:
        UserError: as ``build_module``.
    """
    transformers = import_transformers(entry)
    config = trained_config(transformers, entry, config_text)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-any-return]


def import_transformers(entry: str) -> Any:
    """The ``transformers`` package (one line where it is missing)."""
    try:
        import transformers
    except ImportError:
        raise UserError(f"--model {entry} needs transformers; pip install -c constraints.txt -e '.[hf]'") from None
    return transformers


def trained_config(transformers: Any, entry: str, config_text: str | None) -> Any:
    """``model_config``, its token ids outside the vocabulary cleared where ``--hf-config`` does not set them."""
    fields = config_fields(config_text)
    config = model_config(transformers, entry, config_text)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # defaults of the full vocabulary: none here
        value = getattr(config, key, None)
        if key not in fields and isinstance(value, int) and value >= config.vocab_size:
            setattr(config, key, None)
    return config


def model_config(transformers: Any, entry: str, config_text: str | None) -> Any:
    """The config of ``hf:TYPE`` with ``--hf-config``, or the config.json of the folder ``hf:PATH``.

    Raises:
        UserError: as ``models.hf_config.make_config``; ``--hf-config`` given with a folder (its config.json
            sets the model); a config.json transformers cannot read.
    """
    folder = folder_of(entry)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # token ids of the full vocabulary are cleared below, not warned of
    try:
        if folder is None:
            return make_config(transformers, entry, config_fields(config_text))
        if config_text is not None:
            raise UserError(
                f"--model {entry} is a pretrained folder whose config.json sets the model; drop --hf-config"
            )
        try:
            config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(
                f"{folder / 'config.json'} is no config transformers can read ({first}); give the folder "
                "save_pretrained wrote"
            ) from None
        config.use_cache = False  # training: no key/value cache (one in the output cannot be traced)
        return config
    finally:
        transformers.logging.set_verbosity(verbosity)


def _check_positions(entry: str, config: Any, seq_len: int) -> None:
    """``--seq-len`` within the config's positions (``max_position_embeddings``; gpt2's ``n_positions``)."""
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and seq_len > positions:
        name = getattr(type(config), "attribute_map", {}).get("max_position_embeddings", "max_position_embeddings")
        shorter = f"--seq-len {positions} or less, or " if positions >= 1 else ""
        raise UserError(
            f"--seq-len {seq_len} is longer than {entry}'s {name}={positions} (--hf-config); give {shorter}"
            f"{name} >= {seq_len} in --hf-config"
        )


def _check_router_loss(entry: str, config: Any) -> None:
    """No router auxiliary loss (``output_router_logits``): transformers' MoE models (Mixtral, Qwen2-MoE) sum
    every layer's routing counts and probabilities before multiplying them, so the term couples blocks a
    pipeline holds on different stages; pipeweave trains them on the cross-entropy alone, as transformers
    does by default."""
    if getattr(config, "output_router_logits", False):
        fix = "set it false in config.json" if folder_of(entry) is not None else "drop it from --hf-config"
        raise UserError(
            f"--model {entry} with output_router_logits=true: its router auxiliary loss spans the routers of every "
            f"layer, which a pipeline splits over stages; {fix} (the model trains on its cross-entropy), or use "
            "--model llama --moe-experts E, whose auxiliary loss pipeweave adds per block"
        )


@functools.cache
def hf_model(entry: str, config_text: str | None, seq_len: int, seed: int) -> LayerModel:
    """The ``LayerModel`` of ``hf:NAME`` with ``--hf-config``, on the byte corpus (described once per process).

    The model is built and traced on the meta device; each layer, when a rank builds it, materialises its own
    tensors alone: read from the pretrained folder's files (``hf:PATH``), or initialised by the model's own
    ``_init_weights`` under a seed per tensor name (``models.materialise``).
    """
    module = meta_built(entry, config_text, seq_len)
    _check_router_loss(entry, module.config)
    vocab = module.config.vocab_size
    if vocab < 256:
        raise UserError(f"--hf-config vocab_size={vocab} cannot hold bytes; give a vocab_size >= 256")
    data = ByteWindows(seq_len)
    loss = functools.partial(_causal_lm_loss, module.loss_function, vocab)
    folder = folder_of(entry)
    weights = None if folder is None else Weights(folder)
    if weights is not None:
        weights.check(module)  # before the module is traced: a folder that cannot serve it is one line
    model = pipeline(
        module,
        (data.tokens[:2],),
        split_points=None,
        loss=loss,
        dataset=data,
        param_init=module._init_weights,
        seed=seed,
        tp_plan=hf_tp_plan(module),
    )
    if weights is None:
        return model
    layers = []
    for build in model.layers:  # materialise(part, names, the initialiser): the files read instead
        part, names, initialiser = build.args
        read = functools.partial(_read_pretrained, weights.reader(module), initialiser)
        layers.append(MetaLayer(materialise, part, names, read))
    return dataclasses.replace(model, layers=layers)


def _read_pretrained(
    files: Any, computed: Any, names: list[str], slices: Mapping[str, Slice] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors ``names`` from the pretrained files (those in ``slices``: that slice alone); those no file
    holds (buffers of the config: rotary tables) computed as the model computes them."""
    slices = slices or {}
    values = files(names, slices)
    missing = [n for n in names if n not in values]
    return values | (computed(missing, {n: slices[n] for n in missing if n in slices}) if missing else {})


def _causal_lm_loss(loss_function: Any, vocab: int, logits: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = logits.logits if hasattr(logits, "logits") else logits
    return loss_function(logits, labels, vocab)  # type: ignore[no-any-return]


class ByteWindows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Consecutive windows of ``seq_len`` bytes of the standard library's sources: (tokens, the same tokens)
    -- a causal LM's labels are its inputs, shifted by its own loss."""

    def __init__(self, seq_len: int) -> None:
        from pipeweave.data.corpus import stdlib_sources

        raw = torch.frombuffer(bytearray(stdlib_sources(_CORPUS_BYTES)), dtype=torch.uint8).long()
        self.tokens = raw[: len(raw) // seq_len * seq_len].view(-1, seq_len)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[i], self.tokens[i]


def save_pretrained(entry: str, config_text: str | None, parameters: dict[str, torch.Tensor], folder: str) -> None:
    """Write a run's parameters (global names ``"<layer>.<name in the module>"``) as a ``transformers`` folder.

    Raises:
        UserError: parameters that do not cover the model.
    """
    module = build_module(entry, config_text, 0)
    state = {name.partition(".")[2]: value for name, value in parameters.items() if ".pipeweave_linear_" not in name}
    every = dict(module.named_parameters(remove_duplicate=False))
    module.load_state_dict(state, strict=False)
    loaded = {id(every[n]) for n in state if n in every}  # a tied Parameter is loaded by any of its names
    lacking = [n for n, p in every.items() if id(p) not in loaded]
    if lacking:
        raise UserError(f"the run's parameters lack {lacking[0]} of {entry}; save from a run of the same model")
    module.save_pretrained(folder)


def hf_vocab(entry: str, config_text: str | None) -> int:
    """The vocabulary size of ``hf:NAME`` with ``--hf-config`` (its config alone: no model built).

    Raises:
        UserError: as ``build_module``.
    """
    return int(model_config(import_transformers(entry), entry, config_text).vocab_size)


def default_tokenizer(entry: str | None) -> str | None:
    """The tokenizer saved beside an ``hf:PATH`` model (a folder holding tokenizer.json or
    tokenizer_config.json), or None."""
    if entry is None or not is_hf(entry):
        return None
    folder = Path(entry[len(PREFIX) :])
    if folder.is_dir() and any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return str(folder)
    return None
