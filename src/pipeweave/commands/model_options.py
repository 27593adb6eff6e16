"""The model's options of the commands that build one (``partition``, ``compare``): ``--model`` and the built-in
models' sizes, and the ``ModelSpec`` they describe. ``pipeweave train`` takes the same options from its
configuration's model section (``config.model``)."""

from __future__ import annotations

import argparse
from typing import Any

from pipeweave.config.model import BUILT_IN, TRANSFORMERS
from pipeweave.errors import UserError

MODEL_OPTIONS = ("layers", "hidden", "vocab", "heads", "seq_len", "kv_heads", "ffn_hidden", "seed")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model mlp|gpt|llama|FILE.py:NAME`` and the built-in models' sizes (defaults: ``ModelSpec``'s)."""
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model",
        default="gpt",
        metavar="gpt|llama|mlp|FILE.py:NAME|hf:TYPE",
        help="a reference model (default gpt), or your own: the LayerModel, nn.Module or a function "
        "returning one, NAME in FILE.py or in an importable module (pipeweave.models.custom, "
        "pipeweave.models.pipeline), or a Hugging Face causal LM type (hf:gpt2, hf:llama)",
    )
    group.add_argument(
        "--hf-config",
        metavar="JSON|FILE",
        help="hf:TYPE: its config's fields, a JSON object or a file holding one (built offline)",
    )
    group.add_argument("--layers", type=int, help="residual blocks")
    group.add_argument("--hidden", type=int, help="width h")
    group.add_argument("--vocab", type=int, help="gpt/llama vocabulary size")
    group.add_argument("--heads", type=int, help="gpt/llama attention heads")
    group.add_argument("--seq-len", type=int, help="gpt/llama tokens per sample")
    group.add_argument("--kv-heads", type=int, help="llama key/value heads (grouped-query attention)")
    group.add_argument("--ffn-hidden", type=int, help="llama SwiGLU MLP width")
    group.add_argument("--seed", type=int, help="initialisation seed")
    group.add_argument(
        "--tie-embeddings",
        action="store_true",
        help="gpt/llama: one matrix for the token embedding and the output head (gradients summed)",
    )


def model_spec(args: argparse.Namespace, gpt_defaults: dict[str, int] | None = None) -> Any:
    """The ``ModelSpec`` the model options describe (torch is imported only here); for ``--model gpt`` (or
    llama), ``gpt_defaults`` fill the sizes left unset (and are set on ``args``, so that the record shows them)."""
    if args.model in TRANSFORMERS:
        for name, value in (gpt_defaults or {}).items():
            if getattr(args, name, None) is None:
                setattr(args, name, value)
    from pipeweave.models import ModelSpec
    from pipeweave.models.custom import is_entry

    given = {name: getattr(args, name) for name in MODEL_OPTIONS if getattr(args, name, None) is not None}
    if getattr(args, "tie_embeddings", False):
        given["tie_embeddings"] = True
    if getattr(args, "hf_config", None) is not None and not args.model.startswith("hf:"):
        raise UserError("--hf-config applies to --model hf:TYPE only; drop it or name a Hugging Face model")
    if args.model in BUILT_IN:
        return ModelSpec(kind=args.model, **given)
    if not is_entry(args.model):
        raise UserError(
            f"--model {args.model!r} is unknown; choose gpt, llama, mlp, FILE.py:NAME (your own model) or "
            "hf:TYPE (a Hugging Face model)"
        )
    hf = args.model.startswith("hf:")
    sizes = [name for name in given if name not in (("seed", "seq_len") if hf else ("seed",))]
    if sizes:
        flag = "--" + sizes[0].replace("_", "-")
        raise UserError(
            f"{flag} applies to the built-in models; {args.model}'s layers are its LayerModel's: drop {flag}"
        )
    if hf:
        return ModelSpec(
            kind="custom",
            entry=args.model,
            seed=given.get("seed", 0),
            seq_len=given.get("seq_len", 128),
            hf_config=getattr(args, "hf_config", None),
        )
    return ModelSpec(kind="custom", entry=args.model, seed=given.get("seed", 0))


MOE_OPTIONS = ("moe_experts", "moe_top_k", "moe_every")
"""The mixture-of-experts options ``plan`` shares with ``train`` (``ModelSpec``'s fields, their help and flags)."""


def add_moe_arguments(parser: argparse.ArgumentParser) -> None:
    """``--moe-experts E --moe-top-k K --moe-every N`` as ``train`` declares them (``config.model.ModelSpec``),
    left None when not given."""
    import dataclasses

    from pipeweave.config.cli import argument
    from pipeweave.config.model import ModelSpec

    group = parser.add_argument_group("mixture of experts", "gpt or llama (a preset's own experts otherwise)")
    for f in dataclasses.fields(ModelSpec):
        if f.name in MOE_OPTIONS:
            flags, kwargs = argument(ModelSpec, f)
            group.add_argument(*flags, dest=f.name, default=None, **kwargs)


def moe_fields(args: argparse.Namespace) -> dict[str, int]:
    """The ``planner.transformer.Transformer`` fields of the MoE options given (``add_moe_arguments``).

    Raises:
        UserError: --moe-top-k or --moe-every without --moe-experts.
    """
    given = {name: getattr(args, name) for name in MOE_OPTIONS if getattr(args, name, None) is not None}
    if given and not given.get("moe_experts"):
        flag = "--" + next(iter(given)).replace("_", "-")
        raise UserError(f"{flag} describes the experts; give --moe-experts E with it, or drop it")
    return given
