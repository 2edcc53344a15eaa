"""Bytes on the wire, per (operation, purpose): what `Comm` records and the engine logs.

`observed`: the bytes zerotrain's own algorithms handed to isend/irecv. `computed`: the
payload times the algorithm's standard factor, for torch's native collectives, whose
internals are invisible. Each count is split into bytes that stayed inside a node and
bytes that crossed nodes (`inter_*`; nodes per `comm.node_size`): what hpZ, qwZ and qgZ
save is cross-node traffic. One counter may be shared by several `Comm`s (a Comm's gradient
group and its subgroups share their parent's), so a step's traffic is read in one place.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class OpTraffic:
    calls: int = 0
    sent: int = 0
    recv: int = 0
    observed: bool = True  # False: computed from the algorithm's standard factor
    inter_sent: int = 0  # of `sent`, the bytes to ranks on another node (comm.node_size)
    inter_recv: int = 0


@dataclass
class TrafficCounter:
    """Bytes per (operation, purpose) since the last reset."""

    ops: dict[tuple[str, str], OpTraffic] = field(default_factory=dict)

    def add(self, op: str, purpose: str, sent: int, recv: int, observed: bool,
            inter: tuple[float, float] = (0, 0)) -> None:
        """`inter`: the part of (sent, recv) that crossed to or from another node."""
        t = self.ops.setdefault((op, purpose), OpTraffic(observed=observed))
        t.calls += 1
        t.sent += int(sent)
        t.recv += int(recv)
        t.inter_sent += int(inter[0])
        t.inter_recv += int(inter[1])
        t.observed = t.observed and observed

    def reset(self) -> None:
        self.ops.clear()

    def total(self, exclude: tuple[str, ...] = ("control",)) -> tuple[int, int]:
        sent = sum(t.sent for (_, p), t in self.ops.items() if p not in exclude)
        recv = sum(t.recv for (_, p), t in self.ops.items() if p not in exclude)
        return sent, recv

    def inter(self, exclude: tuple[str, ...] = ("control",)) -> tuple[int, int]:
        """(sent, received) bytes that crossed between nodes; the rest stayed inside one."""
        return (sum(t.inter_sent for (_, p), t in self.ops.items() if p not in exclude),
                sum(t.inter_recv for (_, p), t in self.ops.items() if p not in exclude))

    def snapshot(self) -> dict[str, dict]:
        out: dict[str, dict] = defaultdict(dict)
        for (op, purpose), t in sorted(self.ops.items()):
            out[purpose][op] = {
                "calls": t.calls, "sent_bytes": t.sent, "recv_bytes": t.recv,
                "inter_sent_bytes": t.inter_sent, "inter_recv_bytes": t.inter_recv,
                "how": "observed" if t.observed else "computed",
            }
        return dict(out)
