"""The estimate's memory for ZeRO-Infinity runs against a real run's measured peaks
(issue 25): `memory.tier_buffers` — what the tiers bring into memory in each phase —
through `zerotrain estimate`'s own path (`predict_peaks`), held within 10 % of the peaks
the engine measures (`Engine.memory_phases`: its resident set above its start), at init
and in steady state, on two ranks for two model sizes and tier settings.

Each rank runs with glibc's mmap threshold fixed at 128 KiB, as in
test_memory_phases.py: every large block goes back to the OS when freed, so the
resident set is the live tensors (and the runtime), not allocator noise.

The read-ahead makes the prediction a bound: a read still in flight holds only the blocks
that have landed, so how much of it counts depends on the disk's speed against the
compute's. Each case fixes that: `offload_prefetch: 0` waits for every read (nothing
ahead), and the prefetching case reads synchronously (each read has landed when it is
issued: a disk faster than the compute), where the bound is what a run holds."""

from __future__ import annotations

import pytest
import torch

from multirank import run_ranks

#: (model, zero section over stage 3, reads land at once): a ZeRO-Infinity run with
#: everything on disk, each read waited for; and the optimizer alone on disk, one unit
#: read ahead
CASES = {
    "all-on-disk-p0": ({"n_layer": 3, "n_head": 6, "n_embd": 768, "block_size": 64},
                       {"offload_param": "nvme", "offload_optimizer": "nvme",
                        "offload_prefetch": 0}, False),
    "optimizer-on-disk-p1": ({"n_layer": 2, "n_head": 8, "n_embd": 1024, "block_size": 64},
                             {"offload_optimizer": "nvme", "offload_prefetch": 1}, True),
}


def _reads_land_at_once() -> None:
    """The disk tier's reads done in the caller's thread: landed when issued."""
    from concurrent.futures import Future

    from zerotrain.zero.tiers.io import BlockIO

    def read(self, fd, out, counter, offset):
        done = []
        for a, b in self.blocks(len(out)):
            self._read_block(fd, out, a, b, counter, offset)
            f: Future = Future()
            f.set_result(None)
            done.append(f)
        return done

    BlockIO.read = read


def _measure(model: dict, zero: dict, at_once: bool) -> dict:
    import torch.distributed as dist

    from zerotrain.cli.estimate import predict_peaks
    from zerotrain.config import build_config
    from zerotrain.engine import Engine
    from zerotrain.models import build_model

    if at_once:
        _reads_land_at_once()
    cfg = build_config({"model": model, "data": {"micro_batch_size": 2},
                        "zero": {"stage": 3, **zero}, "precision": {"dtype": "fp32"},
                        "train": {"device": "cpu"}})
    torch.manual_seed(0)
    eng = Engine(build_model(cfg.model, device="meta"), cfg, torch.device("cpu"))
    x = torch.randint(0, 256, (2, model["block_size"]))
    for _ in range(2):  # steady state from the second step on: the first makes the
        eng.backward(eng(x, x))  # moments, so there is nothing of them to read ahead
        eng.step()
    measured = eng.memory_phases()["measured"]
    eng.close()
    pred = predict_peaks(cfg, dist.get_world_size(), 3, cfg.zero.offload_optimizer,
                         device="cpu", micro_batch=2, offload_param=cfg.zero.offload_param)
    return {"measured": measured, "predicted": pred["phases"]}


@pytest.mark.parametrize("case", list(CASES))
def test_tier_rows_predict_the_measured_peaks(case, tmp_path, monkeypatch):
    """Init and steady peaks (the largest of forward, backward and step) within 10 %."""
    from zerotrain.memory import steady_peak

    model, zero, at_once = CASES[case]
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # the spawned ranks'
    zero = {**zero, "nvme_path": str(tmp_path / "swap")}
    for res in run_ranks(_measure, 2, model, zero, at_once, fresh=True):
        m, p = res["measured"], res["predicted"]
        got = {"init": (m["init"], p["init"]), "steady": (steady_peak(m), steady_peak(p))}
        for what, (meas, pred) in got.items():
            assert abs(pred / meas - 1) <= 0.10, (case, what, meas / 2**20, pred / 2**20)
