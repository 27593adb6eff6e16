"""A whole module's tensor-parallel plan, module-name patterns to styles, resolved to each of its layers' plans.

``pipeweave.pipeline(module, ..., tp_plan={"blocks.*.attn.qkv": "colwise_qkv", "blocks.*.attn.out": "rowwise"})``
names the module's linear layers as torch's ``parallelize_module`` does: by
their names in the module, ``*`` matching one name between dots, and a style
(``models.tensor_parallel``; torch's ``ColwiseParallel()`` and
``RowwiseParallel()`` are taken for ``colwise`` and ``rowwise``). The cut
turns each into a plan per layer, under the names the layer holds them by:
a traced part computes a module's linear layer as one of its own deferrable
layers (``pipeweave_linear_<k>``: ``models.graph_split``), a child of an
``nn.Sequential`` keeps its name.

Example:
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    >>> layer_plans(net, [net], {"0": "colwise", "2": "rowwise"})
    [{'0': 'colwise', '2': 'rowwise'}]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any

from torch import fx, nn

from pipeweave.errors import UserError
from pipeweave.models.layers import Linear
from pipeweave.models.tensor_parallel import STYLES

_GRAPH_LINEAR = "pipeweave_linear_"


def matches(pattern: str, name: str) -> bool:
    """Whether the module name ``name`` is one ``pattern`` names (``*`` within one name between dots)."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatchcase(p, a) for a, p in zip(atoms, parts))


def style_of(value: Any, key: str) -> str:
    """A plan entry's style: one of ``models.tensor_parallel.STYLES``, or torch's ``ColwiseParallel()`` /
    ``RowwiseParallel()`` (their default layouts).

    Raises:
        UserError: anything else.
    """
    if isinstance(value, str) and value in STYLES:
        return value
    kind = type(value).__name__
    if kind in ("ColwiseParallel", "RowwiseParallel") and type(value).__module__.startswith("torch.distributed"):
        return "colwise" if kind == "ColwiseParallel" else "rowwise"
    raise UserError(
        f"tp_plan[{key!r}] = {value!r} is no style pipeweave applies; give one of {', '.join(STYLES)} "
        "(or torch's ColwiseParallel() / RowwiseParallel())"
    )


def layer_plans(module: nn.Module, parts: Sequence[nn.Module], tp_plan: Mapping[str, Any]) -> list[dict[str, str]]:
    """Per part (layer) of ``module``, ``tp_plan``'s entries under the names the part holds its linear layers by.

    Raises:
        UserError: a plan that is no mapping, an entry no linear layer of the module matches (naming what it
            matches instead), a linear layer whose weight is tied to another parameter (splitting would untie
            them), a style pipeweave does not apply.
    """
    if not isinstance(tp_plan, Mapping):
        raise UserError(
            f"tp_plan is a {type(tp_plan).__name__}; give a dict {{module name pattern: 'colwise' or 'rowwise'}}, "
            "e.g. {'layers.*.mlp.up': 'colwise', 'layers.*.mlp.down': 'rowwise'}"
        )
    styles = {str(key): style_of(value, str(key)) for key, value in tp_plan.items()}
    linears = [_linears(part) for part in parts]
    tied = _tied(parts)
    used: set[str] = set()
    plans: list[dict[str, str]] = []
    for held in linears:
        plan: dict[str, str] = {}
        for name, local in held.items():
            for pattern, style in styles.items():
                if matches(pattern, name):
                    if name in tied:
                        raise UserError(
                            f"tp_plan[{pattern!r}] names {name}, whose weight is tied (one Parameter: {tied[name]}): a "
                            "split would untie them; leave it out of the tp_plan"
                        )
                    plan[local] = style
                    used.add(pattern)
                    break
        plans.append(plan)
    _check_used(module, styles, used, [n for held in linears for n in held])
    return plans


def _linears(part: nn.Module) -> dict[str, str]:
    """The linear layers of a part: their names in the module -> the names the part holds them by."""
    if not isinstance(part, fx.GraphModule):
        return {n: n for n, m in part.named_modules() if type(m) is nn.Linear or isinstance(m, Linear)}
    named = part.named_parameters(remove_duplicate=False)
    owner = {id(p): n for n, p in named if not n.startswith(_GRAPH_LINEAR) and n.endswith(".weight")}
    held = {}
    for local, m in part.named_children():
        if local.startswith(_GRAPH_LINEAR) and id(m.weight) in owner:
            held[owner[id(m.weight)].removesuffix(".weight")] = local
    return held


def _tied(parts: Sequence[nn.Module]) -> dict[str, str]:
    """Module names of linear layers whose weight is held in several places (another name, another layer): one."""
    places: dict[int, list[str]] = {}
    for index, part in enumerate(parts):
        for name, p in part.named_parameters(remove_duplicate=False):
            if not name.startswith(_GRAPH_LINEAR) and f"layer {index}'s {name}" not in places.setdefault(id(p), []):
                places[id(p)].append(f"layer {index}'s {name}")
    return {
        place.partition("'s ")[2].removesuffix(".weight"): " and ".join(group)
        for group in places.values()
        if len(group) > 1
        for place in group
    }


def _check_used(module: nn.Module, styles: Mapping[str, str], used: set[str], linears: list[str]) -> None:
    for pattern in styles:
        if pattern in used:
            continue
        hit = [n for n, _ in module.named_modules() if n and matches(pattern, n)]
        some = ", ".join(sorted(set(linears))[:4]) or "none"
        what = f"matches {hit[0]}, which is no linear layer the cut computes" if hit else "matches no module"
        raise UserError(f"tp_plan[{pattern!r}] {what}; name linear layers of the module, e.g. {some}")
