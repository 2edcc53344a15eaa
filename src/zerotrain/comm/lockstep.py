"""Ranks in lockstep: find where they part instead of hanging until the timeout.

Every rank must issue the same collectives in the same order. When one does not — under
ZeRO-3 every forward pass is an all-gather, so one extra evaluation batch on one rank
is enough — the others wait inside a collective that never completes, silently, until
`comm.timeout_s`. Two aids:

- `Lockstep` (`comm.check_lockstep: true`, a debug mode, on in the tests): before each
  collective, every rank all-gathers a fingerprint of it (sequence number, operation,
  purpose, element count, dtype) and compares. A mismatch raises `LockstepError` on
  every rank at once, naming the ranks and what each was about to run. It costs one
  small blocking all-gather per collective. (torch's own `TORCH_DISTRIBUTED_DEBUG=DETAIL`
  does a similar check inside the process group, without zerotrain's names.)
- `explain_timeout`: a collective that times out anyway is re-raised as one message
  naming `comm.timeout_s` and the debug mode, instead of the backend's socket error.
"""

from __future__ import annotations

import copy
import zlib

import torch
import torch.distributed as dist

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_reduce_scalars", "all_to_all",
       "scatter", "broadcast")
PURPOSES = ("grads", "params", "control", "other", "muon", "sequence", "experts")
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
          torch.int32, torch.uint8, torch.int8, torch.bool)
FIELDS = 5  # sequence number, operation, purpose, elements, dtype


class LockstepError(RuntimeError):
    """The ranks reached different collectives (found by comm.check_lockstep)."""


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than comm.timeout_s."""


def _code(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def fingerprint(seq: int, op: str, purpose: str, numel: int, dtype: torch.dtype) -> list[int]:
    d = DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES)
    return [seq, OPS.index(op) if op in OPS else len(OPS), _code(purpose), int(numel), d]


def describe(row: list[int], purposes: dict[int, str]) -> str:
    """'all_gather(params) of 4,096 float32 elements [collective #12]'."""
    seq, op, purpose, numel, d = row
    dtype = str(DTYPES[d]).removeprefix("torch.") if d < len(DTYPES) else "other-dtype"
    name = purposes.get(purpose, f"purpose #{purpose}")
    what = OPS[op] if op < len(OPS) else "another collective"
    return f"{what}({name}) of {numel:,} {dtype} elements [collective #{seq}]"


class Lockstep:
    """Compares every collective's fingerprint across the ranks of `group` first.

    `channel(name)` is the same check for another communicator whose collectives every
    rank issues at the same points (sequence parallelism's groups: each rank has one):
    its collectives join this one's sequence, compared over this group, labelled
    `name`. Communicators run concurrently from one thread (ZeRO-3's all-gathers, the
    gradient group's reduce-scatters, the sequence group's all-to-alls); per-communicator
    sequences cannot see two ranks issuing them in different orders — with blocking
    checks that hangs — while one sequence names the first difference (H-2)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, rank: int,
                 world: int):
        self.group, self.device, self.rank, self.world = group, device, rank, world
        self.order = [0]  # the sequence number, shared with the channels
        self.label = ""
        self.purposes = {_code(p): p for p in PURPOSES}

    @property
    def seq(self) -> int:
        return self.order[0]

    def channel(self, name: str) -> Lockstep:
        view = copy.copy(self)  # the same group, sequence and names
        view.label = name
        for p in PURPOSES:  # every rank makes the same channels: the names are known
            self.purposes.setdefault(_code(f"{p} on the {name}"), f"{p} on the {name}")
        return view

    def check(self, op: str, purpose: str, numel: int, dtype: torch.dtype) -> None:
        self.order[0] += 1
        if self.label:
            purpose = f"{purpose} on the {self.label}"
        self.purposes.setdefault(_code(purpose), purpose)
        mine = torch.tensor(fingerprint(self.seq, op, purpose, numel, dtype),
                            dtype=torch.int64, device=self.device)
        everyone = torch.empty(self.world * FIELDS, dtype=torch.int64, device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(everyone, mine, group=self.group)
        rows = everyone.view(self.world, FIELDS).tolist()
        if any(row != rows[0] for row in rows):
            raise LockstepError(self.message(rows))

    def message(self, rows: list[list[int]]) -> str:
        odd = [r for r in range(self.world) if rows[r] != rows[0]]
        lines = [f"rank {r}: {describe(rows[r], self.purposes)}" for r in range(self.world)]
        return ("comm.check_lockstep: the ranks reached different collectives — rank(s) "
                f"{', '.join(map(str, odd))} differ from rank 0 ("
                + "; ".join(lines) + "). Every rank must issue the same collectives in "
                "the same order; under ZeRO-3 every forward pass is one, so every rank "
                "must run the same number of forward passes (evaluation, sampling, "
                "helpers)")


def explain_timeout(error: BaseException, what: str, rank: int,
                    timeout_s: float | None) -> BaseException:
    """The error to raise for `error`: a CollectiveTimeout naming the settings when the
    backend timed out, otherwise `error` itself.

    gloo only: on NCCL a timed-out collective never raises here — `Work.wait()` returns
    and the watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING, default: tear down) aborts the
    process with its own dump. That is why every known long solo wait (data preparation,
    checkpoint finishing, the compile vote) waits on the store (`patient_barrier`)."""
    text = str(error)
    low = text.lower()
    if not isinstance(error, RuntimeError) or ("timed out" not in low and "timeout" not in low):
        return error
    limit = f"comm.timeout_s = {timeout_s:g} s" if timeout_s else "the process group's timeout"
    return CollectiveTimeout(
        f"rank {rank}: {what} timed out after {limit}: another rank never joined it. Most "
        "often the ranks ran different collectives (one rank did an extra forward pass under "
        "ZeRO-3, or stopped early); rerun with --comm.check_lockstep true to name where they "
        "part. If a rank was only slow, raise comm.timeout_s. (backend: "
        f"{text.strip().splitlines()[-1][:200]})")
