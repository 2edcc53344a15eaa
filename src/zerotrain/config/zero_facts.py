"""The facts of ZeRO, stated once: which model states each stage keeps 1/N, what Offload
moves, and which option needs which shard.

Config validation (`ZeroConfig`), the DeepSpeed config reader, the memory model, the
estimate's rows and the stage classes (`shards = STAGE_SHARDS[n]`) all read these; a
new option that needs, say, the parameters sharded adds one row to `REQUIRES` and is
refused everywhere with the same sentence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: the model states (SPEC §6), the names strategies declare in `shards` / `offloads`
FIELDS = ("params", "grads", "master", "optimizer")
#: SPEC §6's table: which states each ZeRO stage keeps 1/N per rank
STAGE_SHARDS: dict[int, frozenset[str]] = {
    0: frozenset(), 1: frozenset({"master", "optimizer"}),
    2: frozenset({"grads", "master", "optimizer"}), 3: frozenset(FIELDS),
}
#: what Offload moves to the host: the sharded states the optimizer reads and writes
OFFLOADED = frozenset({"grads", "master", "optimizer"})
#: the stages Offload works at: it moves the *sharded* gradients, masters and states,
#: so it needs the gradient shard
OFFLOAD_STAGES = tuple(s for s, sh in STAGE_SHARDS.items() if "grads" in sh)
OFFLOAD_RULE = ("offload needs stage 2 or 3 (it offloads the sharded gradients, master "
                "weights and optimizer states)")


def offload_allowed(stage: int) -> bool:
    return stage in OFFLOAD_STAGES


def lowest_stage(shard: str) -> int:
    """The first stage that keeps `shard` 1/N."""
    return min(s for s, sh in STAGE_SHARDS.items() if shard in sh)


@dataclass(frozen=True)
class Requires:
    """Option `field` (on when `on(zero_config)`) needs the stage to shard `shard`."""

    field: str
    shard: str
    why: str
    on: Callable[[Any], bool]

    def problem(self, stage: int) -> str | None:
        if self.shard in STAGE_SHARDS[stage]:
            return None
        ok = [str(s) for s, sh in STAGE_SHARDS.items() if self.shard in sh]
        return (f"zero.{self.field} needs zero.stage {' or '.join(ok)} ({self.why}; got "
                f"stage {stage}): set zero.stage: {lowest_stage(self.shard)} or remove it")


#: every ZeRO option that only works where a model state is sharded
REQUIRES: tuple[Requires, ...] = (
    Requires("offload_optimizer", "grads", "it offloads the sharded gradients, master weights "
             "and optimizer states", lambda z: z.offload_optimizer != "none"),
    Requires("offload_optimizer nvme", "params", "the disk tier streams the states unit by "
             "unit, as ZeRO-3 fetches its units; or use offload_optimizer: cpu",
             lambda z: z.offload_optimizer == "nvme"),
    Requires("offload_param", "params", "only ZeRO-3 shards the parameters",
             lambda z: z.offload_param != "none"),
    Requires("secondary_partition", "params", "ZeRO++ hpZ keeps a second partition of the "
             "sharded parameters", lambda z: z.secondary_partition is not None),
    Requires("param_wire", "params", "ZeRO++ qwZ quantises the parameter all-gather",
             lambda z: z.param_wire != "plain"),
    Requires("grad_wire", "params", "ZeRO++ qgZ quantises ZeRO-3's gradient reduce-scatter",
             lambda z: z.grad_wire != "plain"),
)


def zero_option_problems(z: Any) -> list[str]:
    """One sentence per option of the `zero:` section `z` that its stage cannot honour."""
    return [p for r in REQUIRES if r.on(z) and (p := r.problem(z.stage)) is not None]
