"""The model section of the configuration: ``ModelSpec``, as ``--model ... --layers --hidden`` describe it.

Torch-free, so that the command line is built without importing torch; the
layers it describes are built by ``pipeweave.models``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pipeweave.config.schema import check_section, option
from pipeweave.errors import UserError

KINDS = ("mlp", "gpt", "llama", "custom")
BUILT_IN = ("mlp", "gpt", "llama")
"""The reference models ``--model`` names; any other word is an entry (``FILE.py:NAME``, ``hf:TYPE``)."""
TRANSFORMERS = ("gpt", "llama")
"""The built-in decoder-only transformers: an embedding, ``layers`` blocks, a head; tokens in, logits out."""
SIZES = ("layers", "hidden", "vocab", "heads", "seq_len", "kv_heads", "ffn_hidden")
"""The built-in models' size fields (an entry's layers are its own)."""
MOE = ("moe_experts", "moe_top_k", "moe_every", "moe_router", "moe_capacity", "moe_aux_loss")
"""The mixture-of-experts fields (``models.moe``): the gpt's and the llama's."""
LLAMA_ONLY = ("kv_heads", "ffn_hidden")
"""Fields of the llama alone (the gpt's attention is multi-head, its MLP 4h)."""
FFN_MULTIPLE = 256
"""The llama's default MLP width is rounded up to a multiple of this (Llama 2's ``multiple_of``)."""


def model_word(word: str) -> dict[str, Any]:
    """``--model WORD`` -> the section's ``kind`` and ``entry``.

    Raises:
        UserError: a word that is neither a built-in model nor an entry.

    Example:
        >>> model_word("hf:gpt2")
        {'kind': 'custom', 'entry': 'hf:gpt2'}
    """
    if word in BUILT_IN:
        return {"kind": word, "entry": None}
    if word == "custom":  # a file's own spelling: kind and entry given apart
        return {}
    if ":" not in word:
        raise UserError(
            f"--model {word!r} is unknown; choose gpt, llama, mlp, FILE.py:NAME (your own model) or "
            "hf:TYPE (a Hugging Face model)"
        )
    return {"kind": "custom", "entry": word}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model, as the command line's ``--model ... --layers --hidden`` describe it.

    A built-in reference model (the mlp, the gpt, the llama), or your own (``kind="custom"``,
    ``entry``; see ``models.custom``), for which the size fields do not apply.

    Example:
        >>> ModelSpec(kind="mlp", layers=4, hidden=32).num_layers
        4
        >>> ModelSpec(kind="gpt", layers=2, hidden=32, heads=2).num_layers
        4
    """

    kind: str = option("gpt", flags=("--model",), metavar="gpt|llama|mlp|FILE.py:NAME|hf:TYPE", spread=model_word)
    """``"mlp"`` (residual MLP blocks, MSE), ``"gpt"`` (byte-level GPT-2 transformer, cross-entropy),
    ``"llama"`` (byte-level Llama transformer: RMSNorm, rotary positions, grouped-query attention, SwiGLU;
    cross-entropy) or ``"custom"`` (your own ``LayerModel``, named by ``entry``; ``models.custom``)."""
    layers: int = option(4)
    """Residual blocks: MLP blocks, or transformer blocks (the gpt and the llama add an embedding and a head
    layer)."""
    hidden: int = option(128)
    """Width h of the residual stream."""
    vocab: int = option(256)
    """gpt and llama: vocabulary size; 256 means bytes."""
    heads: int = option(4)
    """gpt and llama: attention (query) heads; must divide ``hidden``."""
    seq_len: int = option(128)
    """gpt and llama: tokens per sample (context length)."""
    seed: int = option(0)
    """Initialisation seed; layer k is seeded by (seed, k), so any rank builds it identically."""
    entry: str | None = option(None, via="--model")
    """custom only: ``FILE.py:NAME`` or ``module:NAME`` of a ``LayerModel`` or a function returning one."""
    tie_embeddings: bool = option(False)
    """gpt and llama: the head's output weight starts equal to the token embedding and their gradients
    are summed before every update (``pipeweave.runtime.stage.tied``), so the two stay identical."""
    kv_heads: int | None = option(None)
    """llama only: key/value heads of grouped-query attention (Ainslie et al. 2023), each shared by
    heads / kv_heads query heads; must divide ``heads``. Default: ``heads`` (multi-head attention)."""
    ffn_hidden: int | None = option(None, metavar="WIDTH")
    """llama only: the SwiGLU MLP's intermediate size. Default: Llama's 2/3 x 4h rounded up to a multiple
    of 256 (11008 at h = 4096, as Llama 2 7B)."""

    moe_experts: int | None = option(None, metavar="E")
    """gpt and llama: experts per mixture-of-experts layer (``models.moe``: a router sends each token to
    --moe-top-k of them, each the model's own MLP). Default (or 0): a dense MLP in every block."""
    moe_top_k: int = option(2, metavar="K")
    """--moe-experts: experts each token is routed to; their gates renormalised to sum to 1 where K > 1."""
    moe_every: int = option(1, metavar="N")
    """--moe-experts: every N-th block has experts (blocks N, 2N, ...), the others a dense MLP."""
    moe_router: Literal["softmax", "sigmoid"] = option("softmax")
    """--moe-experts: the router's scores, softmax probabilities (Switch, GShard, Mixtral) or sigmoid scores
    (DeepSeek-V3)."""
    moe_capacity: float | None = option(None, metavar="FACTOR")
    """--moe-experts: each expert takes at most FACTOR x tokens x K / E assignments of a microbatch, the rest
    dropped (Switch, GShard: first choices served first, in token order). Default: dropless."""
    moe_aux_loss: float = option(0.01, metavar="COEF")
    """--moe-experts: weight of the load-balancing auxiliary loss, E x sum over experts of (share of the
    assignments) x (mean probability) (Switch), added to the objective of every MoE layer; 0: none."""

    hf_config: str | None = option(None, metavar="JSON|FILE")
    """``hf:NAME`` only: the model's config fields, a JSON object or a file holding one (``models.hf``)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UserError(f"model kind {self.kind!r} is unknown; choose one of: {', '.join(KINDS)}")
        for name in ("layers", "hidden", "vocab", "heads", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"{name}={value!r} is invalid; give an integer >= 1")
        if (self.kind == "custom") != (self.entry is not None):
            raise UserError(
                "a custom model needs its entry, and only a custom model takes one; "
                "give ModelSpec(kind='custom', entry='my_model.py:model')"
            )
        if self.hf_config is not None and not (self.entry or "").startswith("hf:"):
            raise UserError("--hf-config applies to --model hf:NAME only; drop it or name a Hugging Face model")
        if self.tie_embeddings and not self.is_transformer:
            raise UserError("tie_embeddings applies to the gpt and the llama; drop it or use --model gpt or llama")
        if self.is_transformer and self.hidden % self.heads:
            raise UserError(
                f"hidden={self.hidden} is not divisible by heads={self.heads}; choose heads dividing hidden"
            )
        check_section(self)
        self._check_llama()
        self._check_moe()

    def _check_llama(self) -> None:
        """The llama's own fields: given only to it, the kv heads dividing the heads, an even head width."""
        for name in LLAMA_ONLY:
            value = getattr(self, name)
            if value is None:
                continue
            flag = "--" + name.replace("_", "-")
            if self.kind != "llama":
                raise UserError(f"{flag} applies to the llama only; drop it or use --model llama")
            if value < 1:
                raise UserError(f"{flag} {value} is invalid; give an integer >= 1")
        if self.kind != "llama":
            return
        if self.heads % self.kv_head_count:
            raise UserError(
                f"--kv-heads {self.kv_head_count} does not divide --heads {self.heads}; give a divisor of "
                f"{self.heads} (1 for multi-query, {self.heads} for multi-head attention)"
            )
        if (self.hidden // self.heads) % 2:
            raise UserError(
                f"the head width hidden/heads = {self.hidden // self.heads} is odd; rotary positions turn pairs "
                "of features: give --hidden and --heads whose quotient is even"
            )

    def _check_moe(self) -> None:
        """The mixture-of-experts fields: experts on the gpt or the llama only, top-k among them, sizes >= 1."""
        if not self.moe_experts:
            return
        if self.moe_experts < 0:
            raise UserError(f"--moe-experts {self.moe_experts} is invalid; give a number of experts >= 1 (0: dense)")
        if not self.is_transformer:
            raise UserError(
                f"--moe-experts {self.moe_experts} applies to --model gpt or llama (their blocks' MLP becomes the "
                f"experts), not to --model {self.entry or self.kind}; drop --moe-experts or use --model gpt or llama"
            )
        if not 1 <= self.moe_top_k <= self.moe_experts:
            raise UserError(
                f"--moe-top-k {self.moe_top_k} is invalid for --moe-experts {self.moe_experts}; give a top-k "
                f"from 1 to {self.moe_experts}"
            )
        if self.moe_every < 1:
            raise UserError(f"--moe-every {self.moe_every} is invalid; give an integer >= 1 (1: every block)")
        if self.moe_capacity is not None and not self.moe_capacity > 0:
            raise UserError(
                f"--moe-capacity {self.moe_capacity} is invalid; give a capacity factor > 0 (e.g. 1.25), or "
                "leave it out for dropless routing"
            )
        if not self.moe_aux_loss >= 0:
            raise UserError(f"--moe-aux-loss {self.moe_aux_loss} is invalid; give a coefficient >= 0 (0: none)")

    @staticmethod
    def check_given(given: dict[str, Any]) -> None:
        """Refuse fields a command line or file gives together that do not go together (``check_given``)."""
        check_given(given)

    def unused_fields(self) -> set[str]:
        """Fields that do not apply to this model (an entry's sizes are its own): left out of its TOML."""
        if self.kind == "mlp":
            return {"vocab", "heads", "seq_len", "tie_embeddings", "hf_config", *LLAMA_ONLY, *MOE}
        if self.kind == "gpt":
            return set(LLAMA_ONLY)
        if self.entry is None:
            return set()
        hf = self.entry.startswith("hf:")
        return {name for name in SIZES + ("tie_embeddings",) + MOE if not (hf and name == "seq_len")}

    @property
    def is_transformer(self) -> bool:
        """A built-in transformer (``TRANSFORMERS``): token sequences in, an embedding layer, blocks, a head.

        Example:
            >>> ModelSpec(kind="llama").is_transformer, ModelSpec(kind="mlp").is_transformer
            (True, False)
        """
        return self.kind in TRANSFORMERS

    @property
    def kv_head_count(self) -> int:
        """The llama's key/value heads: ``kv_heads``, or ``heads`` where not given."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def ffn_width(self) -> int:
        """The llama's MLP width: ``ffn_hidden``, or 2/3 x 4h rounded up to a multiple of ``FFN_MULTIPLE``.

        Example:
            >>> ModelSpec(kind="llama", hidden=4096, heads=32).ffn_width
            11008
        """
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return -(-(8 * self.hidden // 3) // FFN_MULTIPLE) * FFN_MULTIPLE

    @property
    def num_layers(self) -> int:
        """Layers of the lazy layer list: the unit that parts are cut from."""
        if self.kind == "custom":
            return len(self.custom.layers)
        return self.layers + 2 if self.is_transformer else self.layers

    @property
    def layers_described(self) -> str:
        """``num_layers`` in words, for messages: a transformer's are its blocks, its embedding and its head.

        Example:
            >>> ModelSpec(kind="gpt", layers=4, hidden=32, heads=2).layers_described
            '6 (the embedding, 4 blocks, the head)'
        """
        if self.is_transformer:
            return f"{self.num_layers} (the embedding, {self.layers} block{'s' * (self.layers != 1)}, the head)"
        return str(self.num_layers)

    @property
    def custom(self) -> Any:
        """The ``LayerModel`` of a custom model (loaded once per process).

        Raises:
            UserError: not a custom model, or its entry cannot be loaded.
        """
        if self.entry is None:
            raise UserError(f"the {self.kind} model is built in; only --model FILE.py:NAME has a LayerModel")
        from pipeweave.models.custom import LayerModel, load_model

        if self.entry.startswith("hf:"):
            from pipeweave.models.hf import hf_model

            return hf_model(self.entry, self.hf_config, self.seq_len, self.seed)
        model = load_model(self.entry)
        if isinstance(model, LayerModel):
            return model
        from pipeweave.models.pipeline import from_module

        return from_module(self.entry)

    @classmethod
    def of(cls, factory: Callable[[], Any], *, seed: int = 0) -> ModelSpec:
        """The spec of a custom model returned by ``factory``, a module-level function (``models.custom``).

        In a script, ``ModelSpec.of(model)`` names ``model`` by the script's
        path, so ranks spawned from it load the same function.
        """
        from pipeweave.models.custom import entry_of

        return cls(kind="custom", entry=entry_of(factory), seed=seed)


def check_given(given: dict[str, Any]) -> None:
    """The fields a command line or file gives together: sizes belong to the built-in models only.

    Raises:
        UserError: e.g. ``--layers`` beside ``--model hf:gpt2``.
    """
    entry = given.get("entry")
    if entry is None:
        if given.get("hf_config") is not None:
            raise UserError("--hf-config applies to --model hf:TYPE only; drop it or name a Hugging Face model")
        return
    hf = entry.startswith("hf:")
    if given.get("hf_config") is not None and not hf:
        raise UserError("--hf-config applies to --model hf:TYPE only; drop it or name a Hugging Face model")
    sizes = [name for name in SIZES + ("tie_embeddings",) + MOE if name in given and not (hf and name == "seq_len")]
    if sizes:
        flag = "--" + sizes[0].replace("_", "-")
        raise UserError(f"{flag} applies to the built-in models; {entry}'s layers are its LayerModel's: drop {flag}")
