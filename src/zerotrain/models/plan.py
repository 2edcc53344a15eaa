"""Where a model meets the parallelism: its ZeRO-3 units and its optimizer groups.

A `Plan` is written next to the model it belongs to (torchtitan keeps `parallelize.py`
beside each model for the same reason): the model author knows which modules are the
repeated blocks and which parameters are embeddings. Everything that needs that
knowledge — ZeRO-3's gather units, the optimizer's decay/no-decay split, Muon's
matrix/fallback split, the memory estimator's largest unit, FP8's convertible linears —
reads it from here, so there is one rule, not three.

`default_plan(model)` works for any `nn.Module`: the children of its largest
`nn.ModuleList` are the blocks; `nn.Embedding`s and the output head (found through
`get_output_embeddings()` or by tying/shape, never through the config's vocabulary)
are the edge.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

from torch import Tensor, nn


class Group(IntEnum):
    """Optimizer group of a parameter. The value is the group's index in the optimizer."""

    MATRIX = 0     # weight matrices inside the model: decayed; Muon orthogonalises them
    VECTOR = 1     # biases and norm gains: decayed only with optimizer.decay_1d
    EMBEDDING = 2  # embeddings and the output head: decayed; AdamW even under Muon


@dataclass(frozen=True)
class Plan:
    """What the engine needs to know about a model's structure.

    `blocks`: the ZeRO-3 units in execution order; parameters outside every block form
    one root unit. `groups`: canonical parameter name (as `named_parameters()` yields
    it, tied weights once) → `Group`. `fp8_linears`: names of the `nn.Linear` modules
    that may compute in FP8 (the blocks' linears; never embeddings or the head).
    `init`: see the field.
    """

    blocks: tuple[nn.Module, ...]
    groups: dict[str, Group]
    fp8_linears: tuple[str, ...] = field(default=())
    #: init(name, tensor) writes a parameter's initial value, independent of order (so a
    #: model built on the meta device is initialised unit by unit); None: the model has
    #: no such rule, and meta parameters fall back to their modules' reset_parameters()
    init: Callable[[str, Tensor], None] | None = None
    #: init_buffers(module) fills a module's buffers made afresh on the device (a model
    #: built on the meta device; e.g. rotary frequencies); None: none needed
    init_buffers: Callable[[nn.Module], None] | None = None

    def group_of(self, name: str) -> Group:
        return self.groups[name]


def largest_module_list(model: nn.Module) -> nn.ModuleList | None:
    """The `nn.ModuleList` holding the most parameters: a decoder's stack of blocks."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return None
    return max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))


def output_head(model: nn.Module) -> nn.Module | None:
    """The module that maps hidden states to vocabulary logits, if one can be told apart.

    Hugging Face models name it (`get_output_embeddings`). Otherwise: a `nn.Linear`
    child of the root that is tied to an embedding or emits as many features as an
    embedding has rows.
    """
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        head = getter()
        if isinstance(head, nn.Module):
            return head
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    rows = {e.num_embeddings for e in embeddings}
    tied = {id(e.weight) for e in embeddings}
    for child in model.children():
        if isinstance(child, nn.Linear) and (
                id(child.weight) in tied or child.out_features in rows):
            return child
    return None


def plan_from(model: nn.Module, blocks: list[nn.Module], edge: list[nn.Module],
              fp8: Callable[[str, nn.Module], bool] | None = None,
              init: Callable[[str, Tensor], None] | None = None) -> Plan:
    """Build a Plan from the blocks and the edge modules (embeddings, head).

    1-D parameters are VECTOR, parameters of an edge module EMBEDDING, the rest MATRIX.
    `fp8(name, module)` picks convertible linears; default: every nn.Linear in a block.
    """
    edge_ids = {id(p) for m in edge for p in m.parameters()}
    groups: dict[str, Group] = {}
    for name, p in model.named_parameters():
        if p.ndim < 2:
            groups[name] = Group.VECTOR
        elif id(p) in edge_ids:
            groups[name] = Group.EMBEDDING
        else:
            groups[name] = Group.MATRIX
    in_block = {id(m) for b in blocks for m in b.modules()}
    pick = fp8 or (lambda name, m: id(m) in in_block)
    linears = tuple(n for n, m in model.named_modules()
                    if isinstance(m, nn.Linear) and id(m) not in {id(e) for e in edge}
                    and pick(n, m))
    return Plan(tuple(blocks), groups, linears, init)


def default_plan(model: nn.Module) -> Plan:
    """A plan for any nn.Module (see the module docstring for the rules)."""
    blocks = largest_module_list(model)
    edge: list[nn.Module] = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    head = output_head(model)
    if head is not None:
        edge.append(head)
    return plan_from(model, list(blocks) if blocks is not None else [], edge)
