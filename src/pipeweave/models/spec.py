"""The model configuration, the lazy layer list it describes, and how layers are cut into parts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pipeweave.errors import UserError
from pipeweave.models.custom import LayerModel, entry_of, load_model

KINDS = ("mlp", "gpt", "custom")

LossFn = Callable[[Any, Any], torch.Tensor]  # (output, target): a tensor or a tuple of tensors each


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model, as the command line's ``--model ... --layers --hidden`` describe it.

    A built-in reference model (the mlp, the gpt), or your own (``kind="custom"``,
    ``entry``; see ``models.custom``), for which the size fields do not apply.

    Example:
        >>> ModelSpec(kind="mlp", layers=4, hidden=32).num_layers
        4
        >>> ModelSpec(kind="gpt", layers=2, hidden=32, heads=2).num_layers
        4
    """

    kind: str = "gpt"
    """``"mlp"`` (residual MLP blocks, MSE), ``"gpt"`` (byte-level transformer, cross-entropy) or
    ``"custom"`` (your own ``LayerModel``, named by ``entry``; ``models.custom``)."""
    layers: int = 4
    """Residual blocks: MLP blocks, or transformer blocks (the gpt adds an embedding and a head layer)."""
    hidden: int = 128
    """Width h of the residual stream."""
    vocab: int = 256
    """gpt only: vocabulary size; 256 means bytes."""
    heads: int = 4
    """gpt only: attention heads; must divide ``hidden``."""
    seq_len: int = 128
    """gpt only: tokens per sample (context length)."""
    seed: int = 0
    """Initialisation seed; layer k is seeded by (seed, k), so any rank builds it identically."""
    entry: str | None = None
    """custom only: ``FILE.py:NAME`` or ``module:NAME`` of a ``LayerModel`` or a function returning one."""
    tie_embeddings: bool = False
    """gpt only: the head's output weight starts equal to the token embedding and their gradients
    are summed before every update (``pipeweave.runtime.stage.tied``), so the two stay identical."""

    hf_config: str | None = None
    """``hf:NAME`` only: the model's config fields, a JSON object or a file holding one (``models.hf``)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UserError(f"model kind {self.kind!r} is unknown; choose one of: {', '.join(KINDS)}")
        for name in ("layers", "hidden", "vocab", "heads", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"{name}={value!r} is invalid; give an integer >= 1")
        if (self.kind == "custom") != (self.entry is not None):
            raise UserError("a custom model needs its entry, and only a custom model takes one; "
                            "give ModelSpec(kind='custom', entry='my_model.py:model')")
        if self.hf_config is not None and not (self.entry or "").startswith("hf:"):
            raise UserError("--hf-config applies to --model hf:NAME only; drop it or name a Hugging Face model")
        if self.tie_embeddings and self.kind != "gpt":
            raise UserError("tie_embeddings applies to the gpt only; drop it or use --model gpt")
        if self.kind == "gpt" and self.hidden % self.heads:
            raise UserError(f"hidden={self.hidden} is not divisible by heads={self.heads}; choose heads dividing hidden")

    @property
    def num_layers(self) -> int:
        """Layers of the lazy layer list: the unit that parts are cut from."""
        if self.kind == "custom":
            return len(self.custom.layers)
        return self.layers + 2 if self.kind == "gpt" else self.layers

    @property
    def layers_described(self) -> str:
        """``num_layers`` in words, for messages: the gpt's are its blocks, its embedding and its head.

        Example:
            >>> ModelSpec(kind="gpt", layers=4, hidden=32, heads=2).layers_described
            '6 (the embedding, 4 blocks, the head)'
        """
        if self.kind == "gpt":
            return f"{self.num_layers} (the embedding, {self.layers} block{'s' * (self.layers != 1)}, the head)"
        return str(self.num_layers)

    @property
    def custom(self) -> LayerModel:
        """The ``LayerModel`` of a custom model (loaded once per process).

        Raises:
            UserError: not a custom model, or its entry cannot be loaded.
        """
        if self.entry is None:
            raise UserError(f"the {self.kind} model is built in; only --model FILE.py:NAME has a LayerModel")
        if self.entry.startswith("hf:"):
            from pipeweave.models.hf import hf_model

            return hf_model(self.entry, self.hf_config, self.seq_len, self.seed)
        model = load_model(self.entry)
        if isinstance(model, LayerModel):
            return model
        from pipeweave.models.pipeline import from_module

        return from_module(self.entry)

    @classmethod
    def of(cls, factory: Callable[[], LayerModel], *, seed: int = 0) -> ModelSpec:
        """The spec of a custom model returned by ``factory``, a module-level function (``models.custom``).

        In a script, ``ModelSpec.of(model)`` names ``model`` by the script's
        path, so ranks spawned from it load the same function.
        """
        return cls(kind="custom", entry=entry_of(factory), seed=seed)


def layer_generator(spec: ModelSpec, index: int) -> torch.Generator:
    """The random generator that initialises layer ``index`` (independent of ranks and of other layers)."""
    return torch.Generator().manual_seed(layer_seed(spec, index))


def layer_seed(spec: ModelSpec, index: int) -> int:
    """The seed of layer ``index``: a function of ``(spec.seed, index)`` alone."""
    # A large odd multiplier keeps (seed, index) pairs from colliding for any realistic sizes.
    return spec.seed * 1_000_003 + index


def uniform_parts(num_layers: int, num_parts: int) -> list[range]:
    """Cut ``num_layers`` consecutive layers into ``num_parts`` parts, sizes differing by at most one.

    The first parts get the extra layers.

    Raises:
        UserError: fewer layers than parts, or a count below 1.

    Example:
        >>> uniform_parts(5, 2)
        [range(0, 3), range(3, 5)]
    """
    if num_parts < 1:
        raise UserError(f"num_parts={num_parts} is invalid; give at least 1 part")
    if num_layers < num_parts:
        raise UserError(
            f"{num_parts} parts need at least {num_parts} layers, the model has {num_layers}; "
            "Reduce num_stages or increase num_layers"
        )
    base, extra = divmod(num_layers, num_parts)
    bounds = [0]
    for k in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return [range(bounds[k], bounds[k + 1]) for k in range(num_parts)]


def loss_fn(spec: ModelSpec) -> LossFn:
    """The mean loss of a batch: MSE for the mlp, cross-entropy over all tokens for the gpt.

    Example:
        >>> float(loss_fn(ModelSpec(kind="mlp", hidden=2))(torch.ones(1, 2), torch.zeros(1, 2)))
        1.0
    """
    if spec.kind == "mlp":
        return F.mse_loss
    if spec.kind == "custom":
        return spec.custom.loss
    return _token_cross_entropy


def _token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
