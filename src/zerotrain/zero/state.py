"""What a strategy holds as state, read from the live units (the audit of the same
units, as bytes, is zero/audit.py): the state dict is what checkpoints save.
`state_dict()` / `load_state_dict()` speak this rank's own layout (one master tensor per
unit); `load_weights(read)` takes full per-parameter weights from
any source and keeps this rank's part, which is how a checkpoint saved at another world
size or stage — or a pretrained file — comes in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from zerotrain.zero import experts
from zerotrain.zero.audit import memory_breakdown
from zerotrain.zero.flat import gather_range

if TYPE_CHECKING:
    from zerotrain.zero.unit import Unit

def _value(v: Any) -> Tensor:
    """A checkpoint's tensor, read now if it is a `tiers.lazy.Lazy`."""
    return v.load() if hasattr(v, "load") else v


#: read(name, start, stop) -> elements [start, stop) of parameter `name`, flattened
WeightReader = Callable[[str, int, int], Tensor]


class StrategyState:
    """Mixed into `Strategy` (zero/base.py), whose units and hooks it reads."""

    # ================================================================ checkpoint state
    def layout(self) -> dict[str, Any]:
        """Plain JSON, the same on every rank: the units and what they hold."""
        return {"strategy": self.name, "stage": self.stage, "world_size": self.world,
                "units": [experts.unit_layout(u) for u in self.units]}

    def rank_layout(self) -> dict[str, Any]:
        """Plain JSON, this rank's cut: the master range of each unit, and per optimizer
        tensor (in optimizer order) [unit, start, end, shape]; and the range of each unit
        this rank writes into a checkpoint (`write_range`)."""
        units = self.units
        return {"opt_ranges": [list(experts.ranges(u, *self.opt_range(u))) for u in units],
                "segments": [[s.unit, *experts.ranges(units[s.unit], s.start, s.end),
                              list(v.shape)] for s, v in self.opt_segments],
                "write_ranges": [list(experts.ranges(u, *self.write_range(u), clip=True))
                                 for u in units]}

    def write_range(self, u: Unit) -> tuple[int, int]:
        """The part of `opt_range(u)` this rank writes into a checkpoint: its shard.

        Sharded stages write all they own. Stage 0 holds the whole unit on every rank;
        writing all of it N times would put N copies on disk (and make every reader
        choose among them), so the ranks split the writing along the shard boundaries:
        the replicated state is on disk once, written by all ranks in parallel."""
        return u.shard_range

    def state_dict(self, lazy: bool = False) -> dict[str, Tensor]:
        """`lazy`: masters away in a tier stay there (the caller wraps them:
        `lazy_states`); else they are brought back first."""
        if not lazy:
            self.placement.resident()
        return {f"master.{u.index}": u.master for u in self.units}

    def lazy_states(self) -> dict[int, Any]:
        """By id of its tensor: every master and moment away in a tier (its home's)."""
        return self.placement.lazy_states()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._fill_masters(lambda u: _value(sd[f"master.{u.index}"]))

    def load_weights(self, read: WeightReader, only: set[int] | None = None) -> None:
        """Fill this rank's master range of every unit (or of the units indexed in `only`)
        from full parameters, then publish.

        `read` is asked only for the elements this rank keeps, so a sharded source
        (resharded checkpoint, safetensors slices) is never materialised in full.
        """
        self._fill_masters(lambda u: gather_range(  # expert units: their whole parameter
            experts.unit_layout(u), *experts.ranges(u, *self.opt_range(u)), read,
            u.master.dtype), only)

    def _fill_masters(self, value: Callable[[Unit], Tensor], only: set[int] | None = None
                      ) -> None:
        """Each unit's master from `value(u)`, published; a home that keeps masters in a
        tier gets each one back before the next unit's is read (no-ops elsewhere)."""
        home = self.placement
        for u in self.units:  # the optimizer's current moments bound to their homes
            home.bind(u)
        with torch.no_grad():
            for u in self.units_of_index(only):
                home.claim(u)
                u.master.copy_(value(u))
                self.publish(u)
                home.evict(u)
                home.settle(u)
            self.wait_pending()
        self.after_publish()

    def units_of_index(self, only: set[int] | None) -> list:
        return list(self.units) if only is None else [u for u in self.units
                                                      if u.index in only]

    def weights_finite(self) -> bool:
        """Whether every rank's master weights are finite (collective; before a save);
        masters away in a tier are read one at a time."""
        away = self.lazy_states()

        def master(u: Unit) -> Tensor:
            v = away.get(id(u.master))
            return u.master if v is None else v.load()
        bad = any(not bool(torch.isfinite(master(u)).all()) for u in self.units)
        return float(self.comm.all_reduce_scalars([float(bad)], op="max")[0]) == 0.0

    def publish_all(self) -> None:
        with torch.no_grad():
            for u in self.units:
                self.publish(u)
            self.wait_pending()
        self.after_publish()

    # ================================================================ audit (zero/audit.py)
    def memory_breakdown(self, optimizer_state: Iterable[dict] = ()
                         ) -> dict[str, dict[str, int]]:
        """Bytes held per category on device and host (`zero.audit.memory_breakdown`)."""
        return memory_breakdown(self.units, self.grads.sharded, self.offload, optimizer_state)

    def buffer_numels(self) -> list[int]:
        return [u.numel for u in self.units]
