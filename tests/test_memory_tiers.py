"""The offload tiers (issue 25, ZeRO-Infinity) in the estimator: what lives where per
rank (device / host / disk), the tiers' buffers, the bytes moved per step per tier
(`memory.tier_traffic`, what the engine's byte counters are held against) and
`zerotrain estimate` with --offload-param / --offload-optimizer / --disk.

The expected numbers are worked out by hand below, one combination at a time, from the
ZeRO-Infinity reasoning: a state lives in its tier between uses; parameters off the
device come up for every forward and every backward and go back once after the step;
an optimizer on disk reads and writes its master and moments once per step; its
gradient shard lands in host memory every micro-step."""

from __future__ import annotations

import json

import pytest

from zerotrain.cli.estimate import main_estimate, predict_peaks
from zerotrain.config import build_config
from zerotrain.memory import (
    BytesPerParam,
    RunShape,
    phase_estimates,
    shape_state_bytes,
    tier_traffic,
    traffic_per_step,
)

MIXED = BytesPerParam(params=2, grads=2, master=4, optimizer=8)
FP32 = BytesPerParam(params=4, grads=4, master=0, optimizer=8)
# buffers of 10 and 6 elements over N = 2: S = 5 + 3 = 8 elements of shard per rank;
# the largest unit (10) has a shard of U = 5, the two units together 8; prefetch p = 1,
# one write behind (w = 1)


def shape(opt: str, par: str, bpp: BytesPerParam, micro_steps: int = 1, **kw) -> RunShape:
    return RunShape.for_stage([10, 6], 2, 3, bpp, offload=opt, offload_param=par,
                              largest_unit=10, micro_steps=micro_steps, **kw)


def placed(est) -> dict:
    """{tier: {state: bytes}} without the zeros, and the tiers' buffers at their largest
    (device: parameter shards; host: the optimizer's streamed units and masters)."""
    out = {t: {k: v for k, v in getattr(est, t).items() if v} for t in ("device", "host",
                                                                          "disk")}
    return out | {"buffers": (est.staging["device"], est.staging["host"])}


# (optimizer tier, parameter tier) -> where each state lives, mixed precision (bytes):
# params 2·8 = 16, grads 2·8 = 16, master 4·8 = 32, moments 8·8 = 64. Buffers (device,
# host): parameters off the device hold at most 1 + w published shards, 2·(5 + 3) = 16
# (more than the p = 1 read ahead, 2·5, or the unit built at init); an optimizer on disk
# streams p + 2 units, here both: (4 + 8)·8 = 96 (more than init's master, 4·5).
ALL = {"params": 16, "grads": 16, "master": 32, "optimizer": 64}
OPT = {"master": 32, "optimizer": 64}
MIXED_PLACES = {
    ("none", "none"): {"device": ALL, "host": {}, "disk": {}, "buffers": (0, 0)},
    ("cpu", "none"): {"device": {"params": 16}, "host": {"grads": 16, **OPT}, "disk": {},
                      "buffers": (0, 0)},
    ("nvme", "none"): {"device": {"params": 16}, "host": {"grads": 16}, "disk": OPT,
                       "buffers": (0, 96)},
    ("none", "cpu"): {"device": {"grads": 16, **OPT}, "host": {"params": 16}, "disk": {},
                      "buffers": (16, 0)},
    ("none", "nvme"): {"device": {"grads": 16, **OPT}, "host": {}, "disk": {"params": 16},
                       "buffers": (16, 0)},
    ("cpu", "cpu"): {"device": {}, "host": ALL, "disk": {}, "buffers": (16, 0)},
    ("nvme", "cpu"): {"device": {}, "host": {"params": 16, "grads": 16}, "disk": OPT,
                      "buffers": (16, 96)},
    ("cpu", "nvme"): {"device": {}, "host": {"grads": 16, **OPT}, "disk": {"params": 16},
                      "buffers": (16, 0)},
    ("nvme", "nvme"): {"device": {}, "host": {"grads": 16}, "disk": {"params": 16, **OPT},
                       "buffers": (16, 96)},
}
# fp32 has no master: where the optimizer lives apart from the parameters it keeps its
# own 4-byte copy (counted as master, 32); in the same tier the parameter shard is it.
# params 32, grads 32, moments 64. Buffers: the parameter shard is the master in one
# tier, so it is published only when the optimizer is elsewhere, 2·4·8 = 32 (else the p
# read ahead, 4·5 = 20); the optimizer on disk streams both units with the parameters as
# their master, (4 + 8)·8 = 96
FP32_PLACES = {
    ("none", "none"): {"device": {"params": 32, "grads": 32, "optimizer": 64}, "host": {},
                       "disk": {}, "buffers": (0, 0)},
    ("cpu", "none"): {"device": {"params": 32}, "host": {"grads": 32, "master": 32,
                                                         "optimizer": 64},
                      "disk": {}, "buffers": (0, 0)},
    ("none", "cpu"): {"device": {"grads": 32, "master": 32, "optimizer": 64},
                      "host": {"params": 32}, "disk": {}, "buffers": (32, 0)},
    ("cpu", "cpu"): {"device": {}, "host": {"params": 32, "grads": 32, "optimizer": 64},
                     "disk": {}, "buffers": (20, 0)},
    ("nvme", "nvme"): {"device": {}, "host": {"grads": 32},
                       "disk": {"params": 32, "optimizer": 64}, "buffers": (20, 96)},
    ("cpu", "nvme"): {"device": {}, "host": {"grads": 32, "master": 32, "optimizer": 64},
                      "disk": {"params": 32}, "buffers": (32, 0)},
}


@pytest.mark.parametrize("tiers", list(MIXED_PLACES), ids="-".join)
def test_where_each_state_lives_mixed(tiers):
    est = shape_state_bytes(shape(*tiers, MIXED))
    assert placed(est) == MIXED_PLACES[tiers]
    assert est.gathered == 2 * 10  # ZeRO-3 still gathers the unit on the device, any tier
    assert est.disk_total == sum(MIXED_PLACES[tiers]["disk"].values())


@pytest.mark.parametrize("tiers", list(FP32_PLACES), ids="-".join)
def test_where_each_state_lives_fp32(tiers):
    assert placed(shape_state_bytes(shape(*tiers, FP32))) == FP32_PLACES[tiers]


# bytes moved per optimizer step, mixed precision, 2 micro-steps, S = 8:
# fetch: 2 micro-steps × 8 × 2 B = 32 for forward and 32 for backward; grads down:
# 2 × 8 × 2 = 32; optimizer on disk: (4 + 8) × 8 = 96 in and 96 out; updated params
# back to their tier from where the update ran: 8 × 2 = 16.
# (read, written) per tier: device, host, disk
MIXED_MOVES = {
    ("none", "none"): ((0, 0), (0, 0), (0, 0)),
    ("cpu", "none"): ((32, 16), (16, 32), (0, 0)),
    ("nvme", "none"): ((32, 16), (96 + 16, 32 + 96), (96, 96)),
    ("none", "cpu"): ((16, 64), (64, 16), (0, 0)),
    ("none", "nvme"): ((16, 64), (0, 0), (64, 16)),
    ("cpu", "cpu"): ((32, 64), (64, 32), (0, 0)),  # update in host memory, in place
    ("nvme", "cpu"): ((32, 64), (64 + 96, 32 + 96), (96, 96)),
    ("cpu", "nvme"): ((32, 64), (16, 32), (64, 16)),
    ("nvme", "nvme"): ((32, 64), (96 + 16, 32 + 96), (64 + 96, 96 + 16)),
}


@pytest.mark.parametrize("tiers", list(MIXED_MOVES), ids="-".join)
def test_bytes_moved_per_step_per_tier(tiers):
    got = tier_traffic(shape(*tiers, MIXED, micro_steps=2)).per_tier()
    dev, host, disk = MIXED_MOVES[tiers]
    assert got == {"device": dict(zip(("read", "written"), dev)),
                   "host": dict(zip(("read", "written"), host)),
                   "disk": dict(zip(("read", "written"), disk))}


def test_fp32_all_on_disk_reads_the_params_as_master():
    # fetch 2 × 8 × 4 = 64; the update reads params (as master) + moments: 8 × 12 = 96,
    # writes the moments 8 × 8 = 64 and the parameters once 8 × 4 = 32
    t = tier_traffic(shape("nvme", "nvme", FP32))
    assert t.per_tier()["disk"] == {"read": 64 + 96, "written": 64 + 32}
    assert t.per_tier()["host"] == {"read": 64 + 32, "written": 32 + 96}


def test_offload_traffic_is_the_tiers_pcie_part():
    """ZeRO-Offload's copies (the Traffic of `traffic_per_step`) are tier_traffic's
    device part: a grad shard down, a param shard up (Ψ = 1000, N = 4: 250 each)."""
    o3 = traffic_per_step(1000, 4, 3, param_bytes=2, grad_bytes=2, offload=True)
    t = tier_traffic(RunShape.for_stage([1000], 4, 3, MIXED, offload=True))
    assert (o3.device_to_host_bytes, o3.host_to_device_bytes) == (500, 500)
    assert (t.device_to_host, t.host_to_device) == (500, 500)


def test_disk_states_leave_the_phases_and_buffers_join_them():
    none = phase_estimates(shape("none", "none", MIXED))
    nvme = phase_estimates(shape("nvme", "nvme", MIXED))
    # leaves memory: params 16, master 32, moments 64 (grads stay, on the host). Joins
    # the step: the optimizer's streamed units (4 + 8)·8 = 96 and the published shards
    # 2·8 = 16. The forward gathers one unit, not two (the tier's reads run ahead):
    # -2·10, and holds the shard read ahead, 2·5. Saving streams disk states file to
    # file: master + moments (96) are no longer serialised from memory.
    assert nvme["step"] - none["step"] == 96 + 16 - 112
    assert nvme["forward"] - none["forward"] == -112 - 20 + 10
    assert nvme["save"] - none["save"] == -112 - 96
    # init (no moments yet): params and master leave, 16 + 32; the unit being built
    # stays until sent, its shard 2·5 and its master 4·5
    assert nvme["init"] - none["init"] == 10 + 20 - 48


def test_tier_buffers_by_phase_and_prefetch():
    """Each phase's residency (what the engine holds, zero/states/disk.py), fp32 with the
    gradients on disk as on a CPU rank: units of 10, 6 and 4 elements over N = 2 (shards
    5, 3, 2), everything on disk, the parameter shard its own master."""
    from zerotrain.memory.tiers import tier_buffers

    def buffers(p: int) -> dict:
        sh = RunShape((10, 6, 4), 2, FP32, frozenset({"params", "grads", "master",
                                                       "optimizer"}),
                      frozenset({"params", "grads", "master", "optimizer"}),
                      frozenset({"params", "grads", "master", "optimizer"}),
                      largest_unit=10, offload_prefetch=p, tier_io=4096, update_temp=4)
        return {k: sum(v) for k, v in tier_buffers(sh).items()}

    # p = 0: forward holds the shard being gathered (4·5); backward a unit's gradient
    # landing and one written behind (4·(5 + 3)); the step the unit updating and the last
    # one until its write lands ((4 + 8)·(5 + 3)), the updating unit's gradient (4·5)
    # and Adam's denominator (4·5); init the unit built (4·5: the shard is the master)
    assert buffers(0) == {"init": 20, "forward": 20, "backward": 32,
                          "step": 96 + 20 + 20, "io": 4096}
    # p = 2: two shards read ahead (4·8) in forward and beside backward's reduction (two
    # written behind: 4·10); the step reads two units ahead (all three: 12·10) with
    # three gradient shards (4·10)
    assert buffers(2) == {"init": 20, "forward": 32, "backward": 32 + 40,
                          "step": 120 + 40 + 20, "io": 4096}


@pytest.mark.parametrize("bad", [
    dict(offload=True, offload_param="gpu"),
])
def test_bad_tiers_are_refused(bad):
    with pytest.raises(ValueError, match="offload_param must be none, cpu or nvme"):
        RunShape.for_stage([10], 2, 3, MIXED, **bad)
    with pytest.raises(ValueError, match="parameters are offloaded only where they are "
                                         "sharded"):
        RunShape.for_stage([10], 2, 2, MIXED, offload=True, offload_param="cpu")
    with pytest.raises(ValueError, match="a disk tier needs the parameters sharded"):
        RunShape.for_stage([10], 2, 2, MIXED, offload="nvme")


# ----------------------------------------------------------------------------- the CLI

PAPER = ["--params", "7.5e9", "--gpus", "64", "--gpu-mem", "80GB", "--largest-unit", "6.4e8"]
S = -(-7_500_000_000 // 64)  # shard elements per rank
U = 10_000_000  # the largest unit's shard: 6.4e8 / 64


def test_cli_zero_infinity_row(capsys):
    assert main_estimate([*PAPER, "--offload-param", "nvme", "--offload-optimizer", "nvme",
                          "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["rows"]
    assert (r["label"], r["stage"]) == ("ZeRO-3 param:nvme opt:nvme", 3)
    assert r["tiers"] == {"params": "disk", "grads": "host", "master": "disk",
                          "optimizer": "disk"}
    assert r["disk_total"] == (2 + 4 + 8) * S
    # grads, and the optimizer's p + 2 = 3 units streamed: masters and moments (4 + 8)
    assert r["host_total"] == 2 * S + 3 * U * (4 + 8)
    # the gathered unit, and 1 + w = 2 published shards written behind (2 bytes)
    assert r["device_total"] == 2 * 640_000_000 + 2 * U * 2
    assert r["tier_traffic"]["disk"] == {"read": 2 * 2 * S + 12 * S, "written": 12 * S + 2 * S}


def test_cli_max_params_grows_with_the_disk(capsys):
    def largest(disk: str) -> int:
        assert main_estimate([*PAPER, "--offload-param", "nvme", "--offload-optimizer",
                              "nvme", "--host-mem", "1TB", "--disk", disk, "--max-params",
                              "--json"]) == 0
        (r,) = json.loads(capsys.readouterr().out)["rows"]
        return r["max_params"]

    # the disk holds 14 B per element of shard: ceil(Ψ/64)·14 ≤ D → Ψ ≤ 64·floor(D/14)
    one, two = largest("1TB"), largest("2TB")
    assert one == 64 * (10**12 // 14) and two == 64 * (2 * 10**12 // 14)
    assert two > one > 10 * 320 * 10**9  # ZeRO-3 without offload: 320e9 in 80 GB


def test_cli_tier_table_and_unbounded_rows(capsys):
    assert main_estimate([*PAPER, "--offload-optimizer", "nvme", "--max-params"]) == 0
    out = capsys.readouterr().out
    assert "disk per rank" in out and "bytes moved per step and rank" in out
    rows = [ln for ln in out.splitlines() if ln.startswith("ZeRO-3")]
    assert [ln.split("|")[0].strip() for ln in rows[:3]] == [
        "ZeRO-3 opt:nvme", "ZeRO-3 param:cpu opt:nvme", "ZeRO-3 param:nvme opt:nvme"]
    # parameters on the device bound the first row; the others grow only off the device
    assert "ZeRO-3 opt:nvme             640,000,000,000" not in out
    assert out.count("no limit given bounds it") == 2 and "give --host-mem or --disk" in out
    assert main_estimate([*PAPER, "--tiers"]) == 0
    assert sum(ln.startswith("ZeRO") for ln in capsys.readouterr().out.splitlines()) >= 13


@pytest.mark.parametrize("argv,why", [
    (["--disk", "1TB"], "--disk bounds the nvme rows"),
    (["--stage", "2", "--offload-param", "cpu"], "zero.offload_param needs zero.stage 3"),
    (["--stage", "2", "--offload-optimizer", "nvme"], "offload_optimizer nvme needs zero.stage 3"),
    (["--offload-param", "gpu"], "invalid choice"),
    (["--offload", "--offload-optimizer", "none"], "no row for these flags"),
    (["--tiers", "--offload-prefetch", "9"], "--offload-prefetch must be 0-8"),
    (["--tiers", "--grad-accum", "0"], "--grad-accum >= 1"),
    (["--tiers", "--disk", "lots"], "--disk"),
])
def test_cli_bad_tier_flags(argv, why, capsys):
    assert main_estimate(["--params", "1e9", "--gpus", "8", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("zerotrain estimate: error:") and "\n" not in err
    assert why in err


def test_run_shape_carries_the_configs_tiers():
    """--model: the engine's cut with the config's tiers; on disk means out of memory."""
    cfg = build_config({"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16,
                                  "vocab_size": 64}, "data": {"grad_accum_steps": 3},
                        "precision": {"dtype": "bf16"}})
    none = predict_peaks(cfg, 2, 3, False, device="cuda")
    disk = predict_peaks(cfg, 2, 3, "nvme", device="cuda", offload_param="nvme")
    assert disk["buffer_numels"] == none["buffer_numels"]
    numels = none["buffer_numels"]
    s = sum(-(-n // 2) for n in numels)
    u = sorted((-(-n // 2) for n in numels), reverse=True)  # the units' shards
    # step: minus params, master, moments (2 + 4 + 8 per shard element); plus the 2
    # largest published shards (2), the 3 largest units streamed (4 + 8), Adam's fp32
    # denominator of the largest (4) and the disk tier's 4 I/O buffers of 1 MiB
    assert disk["phases"]["step"] - none["phases"]["step"] == (
        2 * sum(u[:2]) + 12 * sum(u[:3]) + 4 * u[0] + 4 * 2**20 - 14 * s)
