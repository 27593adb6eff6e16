"""GPT-style transformer shapes (layers l, hidden h, heads a, sequence s, vocabulary V) and named presets.

The presets are Megatron-LM's Table 1 models (Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC21):
sequence 2048, vocabulary 51,200; and GPT-3 175B (Brown et al. 2020, Table 2.1).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeweave.errors import UserError


@dataclass(frozen=True, kw_only=True)
class Transformer:
    """A GPT: embedding, l blocks (attention and a 4h MLP), a vocabulary head (tied to the embedding).

    Example:
        >>> round(MODELS["gpt-1t"].parameters / 1e9, 1)
        1008.0
    """

    layers: int
    """l, transformer blocks."""
    hidden: int
    """h, hidden size."""
    heads: int
    """a, attention heads."""
    seq_len: int = 2048
    """s, tokens per sample."""
    vocab: int = 51200
    """V, vocabulary size."""
    name: str = "gpt"

    def __post_init__(self) -> None:
        for flag, value in (
            ("--layers", self.layers),
            ("--hidden", self.hidden),
            ("--heads", self.heads),
            ("--seq-len", self.seq_len),
            ("--vocab", self.vocab),
        ):
            if value < 1:
                raise UserError(f"{flag} {value} is invalid; give an integer >= 1")
        if self.hidden % self.heads:
            raise UserError(
                f"--hidden {self.hidden} is not a multiple of --heads {self.heads}; give heads that "
                f"divide the hidden size, e.g. {self.hidden // 128 or 1} (head size 128)"
            )

    @property
    def head_dim(self) -> int:
        """d = h / a."""
        return self.hidden // self.heads

    recomputations = ("none", "selective", "full")
    """What a GPT can recompute (``planner.costs``)."""

    def splits_into(self, parts: int) -> bool:
        """Whether the blocks split into ``parts`` equal parts (Megatron-LM's rule)."""
        return parts >= 1 and self.layers % parts == 0

    def splits_tensors(self, tp: int) -> bool:
        """Whether ``tp`` ranks split the heads (and the hidden size) evenly."""
        return self.heads % tp == 0 and self.hidden % tp == 0

    @property
    def layer_parameters(self) -> int:
        """Parameters of one block: 12 h^2 + 13 h (QKV, projection, MLP, their biases, two layer norms)."""
        return 12 * self.hidden**2 + 13 * self.hidden

    @property
    def embedding_parameters(self) -> int:
        """Token and position embeddings: (V + s) h (the head is tied to the token embedding)."""
        return (self.vocab + self.seq_len) * self.hidden

    @property
    def parameters(self) -> int:
        """Megatron-LM's count: 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)), the final layer norm aside."""
        return self.layers * self.layer_parameters + self.embedding_parameters


def _gpt(name: str, layers: int, hidden: int, heads: int) -> Transformer:
    return Transformer(name=name, layers=layers, hidden=hidden, heads=heads, seq_len=2048, vocab=51200)


MODELS: dict[str, Transformer] = {
    m.name: m
    for m in (
        _gpt("gpt-1.7b", 24, 2304, 24),
        _gpt("gpt-3.6b", 30, 3072, 32),
        _gpt("gpt-7.5b", 36, 4096, 32),
        _gpt("gpt-18b", 40, 6144, 48),
        _gpt("gpt-39b", 48, 8192, 64),
        _gpt("gpt-76b", 60, 10240, 80),
        _gpt("gpt-145b", 80, 12288, 96),
        _gpt("gpt-310b", 96, 16384, 128),
        _gpt("gpt-530b", 105, 20480, 128),
        _gpt("gpt-1t", 128, 25600, 160),
        _gpt("gpt3-175b", 96, 12288, 96),
    )
}
"""Named shapes, by ``--model`` (Megatron-LM's Table 1 and GPT-3 175B)."""


def model_named(name: str) -> Transformer:
    """A preset by name.

    Raises:
        UserError: an unknown name.
    """
    model = MODELS.get(name)
    if model is None:
        raise UserError(
            f"unknown --model {name!r}; choose one of: {', '.join(MODELS)}, or gpt with --layers --hidden --heads"
        )
    return model
