"""Bytes on the wire, per (operation, purpose): what `Comm` records and the engine logs.

`observed`: the bytes zerotrain's own algorithms handed to isend/irecv. `computed`: the
payload times the algorithm's standard factor, for torch's native collectives, whose
internals are invisible. One counter may be shared by several `Comm`s (a Comm's gradient
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


@dataclass
class TrafficCounter:
    """Bytes per (operation, purpose) since the last reset."""

    ops: dict[tuple[str, str], OpTraffic] = field(default_factory=dict)

    def add(self, op: str, purpose: str, sent: int, recv: int, observed: bool) -> None:
        t = self.ops.setdefault((op, purpose), OpTraffic(observed=observed))
        t.calls += 1
        t.sent += int(sent)
        t.recv += int(recv)
        t.observed = t.observed and observed

    def reset(self) -> None:
        self.ops.clear()

    def total(self, exclude: tuple[str, ...] = ("control",)) -> tuple[int, int]:
        sent = sum(t.sent for (_, p), t in self.ops.items() if p not in exclude)
        recv = sum(t.recv for (_, p), t in self.ops.items() if p not in exclude)
        return sent, recv

    def snapshot(self) -> dict[str, dict]:
        out: dict[str, dict] = defaultdict(dict)
        for (op, purpose), t in sorted(self.ops.items()):
            out[purpose][op] = {
                "calls": t.calls, "sent_bytes": t.sent, "recv_bytes": t.recv,
                "how": "observed" if t.observed else "computed",
            }
        return dict(out)
