"""Capacity: the largest model each system trains under a per-rank memory cap.

Run (after `bash bench/setup_peers.sh`, for DeepSpeed):
    .venv-bench/bin/python bench/capacity.py                  # 8 GiB per rank, ~45-60 min
    .venv-bench/bin/python bench/capacity.py --cap 4 --systems zt-3,fsdp2-reshard,ddp
    .venv-bench/bin/python bench/capacity.py --plan           # print the runs, run nothing
    .venv-bench/bin/python bench/capacity.py --report bench/results/capacity.json

A family of reference GPTs from ~100M to ~1.2B parameters (`FAMILY`) and the systems of
bench/peers.py — zerotrain stages 0-3 and ZeRO-2/3 + Offload; PyTorch DDP; FSDP2 with
and without resharding, and with CPUOffloadPolicy; DeepSpeed ZeRO-2/3 — each train a few
steps at 2 gloo ranks (1 thread each, fp32 AdamW, seq 128, batch 1 per rank) under a
per-rank memory cap (bench/capacity_run.py: a watchdog on each rank's resident set, and
a cgroup per rank with --cgroup). Per system the sizes are searched, not swept: the first
probe is the size its bytes per parameter predict (measured at --compare-at, or a prior),
then up or down to the boundary: the largest size that trained next to the smallest that
did not. The systems the targets compare also run at --compare-at (340M), where step
time and init peak are compared like for like.

ZeRO-Infinity rows (issue 25): `zt-3-nvme` (parameter shards, gradients, masters and
moments in files under --nvme-path; about 16 bytes per parameter of disk for both ranks
in fp32) and `zt-3-pcpu` (offload_param cpu: on a CPU-only machine host and device are
one memory, so it matches zt-3), each with its NVMe bytes per step, e.g.
    python bench/capacity.py --cap 4 --systems zt-3,zt-3-nvme,zt-3-pcpu \
        --sizes 340M,400M,1.4B,2B,2.4B --compare-at '' --steps 2 --nvme-path /tmp/zt-nvme

Writes bench/results/<name>.md and .json and docs/capacity.png (max trainable parameters
per system); prints zerotrain's predicted vs measured peaks (`zerotrain estimate`) for
every zerotrain run. Only one capacity run at a time (a lock in /tmp): the machine is
shared, and two would double the memory.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from capacity_report import describe_run, write_outputs  # noqa: E402
from capacity_run import GiB, cgroup_report, mem_available, own_memory_cgroup, run_once  # noqa: E402

#: name -> (n_layer, n_embd, n_head); block 128, vocab 256, tied head, biases (the GPT
#: defaults). Widths 1024/1536/2048 with 128-wide heads, depth sets the size.
FAMILY: dict[str, tuple[int, int, int]] = {
    "100M": (8, 1024, 8), "200M": (16, 1024, 8), "340M": (12, 1536, 12),
    "400M": (8, 2048, 16), "500M": (10, 2048, 16), "650M": (13, 2048, 16),
    "806M": (16, 2048, 16), "900M": (18, 2048, 16), "1B": (20, 2048, 16),
    "1.2B": (24, 2048, 16), "1.4B": (28, 2048, 16), "1.6B": (32, 2048, 16),
    "2B": (40, 2048, 16), "2.4B": (48, 2048, 16),
}
#: --smoke: a small family and cap that exercise the whole machinery in ~5 minutes
SMOKE_FAMILY: dict[str, tuple[int, int, int]] = {
    "6M": (2, 512, 4), "13M": (4, 512, 4), "19M": (6, 512, 4), "25M": (8, 512, 4),
    "38M": (12, 512, 4), "50M": (16, 512, 4),
}
SMOKE = {"cap": 0.75, "compare_at": "13M", "systems": "zt-3,zt-2,ddp,fsdp2,fsdp2-reshard"}
#: short name -> bench/peers_workers.py system (zerotrain with its default `auto` collectives)
SYSTEMS: dict[str, str] = {
    "zt-0": "zt-0-auto", "zt-1": "zt-1-auto", "zt-2": "zt-2-auto", "zt-3": "zt-3-auto",
    "zt-2-off": "zt-2-off-auto", "zt-3-off": "zt-3-off-auto", "ddp": "ddp",
    "fsdp2": "fsdp2", "fsdp2-reshard": "fsdp2-reshard", "fsdp2-offload": "fsdp2-offload",
    "ds-2": "ds-2", "ds-3": "ds-3", "fsdp2-reshard-meta": "fsdp2-reshard-meta",
    "zt-3-nvme": "zt-3-nvme", "zt-3-pcpu": "zt-3-pcpu",
}
#: ZeRO-Infinity rows (zerotrain's ZeRO-3 engine with tiers, zero/states/disk.py): their
#: config over zt-3's; `NVME` is replaced by --nvme-path
ZT_TIERS: dict[str, dict[str, Any]] = {
    "zt-3-nvme": {"zero": {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
                           "nvme_path": "NVME"}},
    "zt-3-pcpu": {"zero": {"stage": 3, "offload_param": "cpu"}},
}
EXTRA = ["fsdp2-reshard-meta"]  # run at --compare-at only, for the init comparison
SEARCHED = [s for s in SYSTEMS if s not in EXTRA]
#: what the targets compare at --compare-at (step time, peak, init peak)
COMPARED = ["zt-3", "fsdp2-reshard", "fsdp2-reshard-meta", "zt-2", "fsdp2", "zt-3-off",
            "fsdp2-offload"]
#: prior resident bytes per parameter (fp32 AdamW, 2 ranks), for the first probe of a
#: system not run at --compare-at: measured at 340M on this machine (zerotrain; the
#: peers from issue 13's table), rounded up.
PRIOR_BYTES = {"zt-0": 18, "zt-1": 14, "zt-2": 13, "zt-3": 11, "zt-2-off": 15,
               "zt-3-off": 14, "ddp": 21, "fsdp2": 13, "fsdp2-reshard": 12,
               "fsdp2-offload": 12, "ds-2": 22, "ds-3": 28, "zt-3-nvme": 3, "zt-3-pcpu": 13}
LOCK = Path("/tmp/zerotrain-capacity.lock")


def model_of(size: str) -> dict[str, int]:
    n_layer, n_embd, n_head = FAMILY[size]
    return {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "block_size": 128}


def params_of(size: str) -> int:
    from zerotrain.config import ModelConfig
    from zerotrain.models import count_params

    return count_params(ModelConfig(**model_of(size)))


# ---------------------------------------------------------------------------- search
class Runner:
    """Runs (system, size) once, remembers every result, saves progress after each."""

    def __init__(self, a: argparse.Namespace, logs: Path, progress: Path):
        self.a, self.logs, self.progress = a, logs, progress
        self.runs: list[dict[str, Any]] = []
        if a.resume and progress.exists():  # an interrupted search goes on where it stopped
            self.runs = json.loads(progress.read_text())["runs"]
            print(f"resuming: {len(self.runs)} runs from {progress}", flush=True)
        self.t0 = time.perf_counter()

    def result(self, system: str, size: str) -> dict[str, Any] | None:
        return next((r for r in self.runs if r["name"] == system and r["size"] == size), None)

    def __call__(self, system: str, size: str) -> dict[str, Any]:
        done = self.result(system, size)
        if done is not None:
            return done
        a = self.a
        extra = zt_config(a, system)
        for _attempt in range(3):  # a machine short of memory says nothing about the system
            r = run_once(SYSTEMS[system], model_of(size), cap=a.cap_bytes,
                         out=self.logs / f"{system}.{size}.json", steps=a.steps,
                         python=a.python, timeout=a.timeout, floor=a.floor_bytes,
                         cgroup=a.cgroup_dir, extra=extra)
            if r.get("verdict") != "aborted":
                break
            print(f"{system} @ {size}: machine memory low, retrying in 60 s", flush=True)
            time.sleep(60)
        r.update(name=system, size=size, params=a.params[size])
        self.runs.append(r)
        spent = (time.perf_counter() - self.t0) / 60
        print(f"[{len(self.runs):2d}, {spent:5.1f} min] {describe_run(r)}", flush=True)
        self.progress.write_text(json.dumps({"runs": self.runs}, indent=1))
        return r


def zt_config(a: argparse.Namespace, system: str) -> list[str]:
    """The worker's --zt-config: --zt-config, and a tier row's own config over it."""
    from zerotrain.config import deep_merge

    cfg = json.loads(a.zt_config) if a.zt_config else {}
    if system in ZT_TIERS:
        tiers = json.loads(json.dumps(ZT_TIERS[system]).replace('"NVME"',
                                                                json.dumps(a.nvme_path)))
        cfg = deep_merge(cfg, tiers)
    return ["--zt-config", json.dumps(cfg)] if cfg else []


def first_probe(system: str, runner: Runner, sizes: list[str]) -> int:
    """The largest size whose predicted peak fits the cap: from the bytes per parameter
    this system showed at --compare-at, else from PRIOR_BYTES."""
    a = runner.a
    seen = runner.result(system, a.compare_at)
    base = 0.36 * GiB
    if seen is not None and seen.get("ok"):
        base = max(rk["base_rss"] for rk in seen["ranks"])
        slope = (max(seen["peak_rss"]) - base) / a.params[a.compare_at]
    else:
        slope = PRIOR_BYTES[system]
    fits = [i for i, s in enumerate(sizes) if base + slope * a.params[s] <= 0.98 * a.cap_bytes]
    return fits[-1] if fits else 0


def search(system: str, runner: Runner, sizes: list[str]) -> None:
    """Walk from the first probe to the boundary, doubling the stride while the verdict
    stays the same and bisecting once both sides are known. A run that fails for a reason
    other than memory ends the search (reported as such)."""
    ok_max, fail_min = -1, len(sizes)
    for i, s in enumerate(sizes):  # what earlier runs already showed
        r = runner.result(system, s)
        if r is not None and r.get("ok"):
            ok_max = max(ok_max, i)
        elif r is not None and r.get("verdict") == "oom":
            fail_min = min(fail_min, i)
    i, stride, up = first_probe(system, runner, sizes), 1, None
    while fail_min - ok_max > 1:
        if ok_max >= 0 and fail_min < len(sizes):
            i = (ok_max + fail_min) // 2
        i = min(max(i, ok_max + 1), fail_min - 1)
        r = runner(system, sizes[i])
        if r.get("ok"):
            ok_max, go_up = i, True
        elif r.get("verdict") == "oom":
            fail_min, go_up = i, False
        else:
            return
        stride = stride * 2 if up is go_up else 1
        up = go_up
        i = i + stride if go_up else i - stride


# ---------------------------------------------------------------------------- main
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cap", type=float, default=8.0, help="memory cap per rank, GiB (8)")
    p.add_argument("--systems", default=",".join(SEARCHED),
                   help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--sizes", default=",".join(FAMILY),
                   help=f"the family to search, comma list of {', '.join(FAMILY)}")
    p.add_argument("--compare-at", default="340M",
                   help="size where the targets' pairs run side by side ('' to skip)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run (3)")
    p.add_argument("--zt-config", default="", help="JSON merged into zerotrain's config")
    p.add_argument("--nvme-path", default="/tmp/zerotrain-capacity-nvme",
                   help="zero.nvme_path of the zt-3-nvme row (a local disk with room: about "
                   "16 bytes per parameter for both ranks)")
    p.add_argument("--cgroup", default="off",
                   help="off | auto (children of this process's own memory cgroup) | PATH "
                   "(a memory cgroup directory to create per-rank children in)")
    p.add_argument("--floor", type=float, default=1.5,
                   help="stop a run when the machine's MemAvailable falls below this, GiB")
    p.add_argument("--timeout", type=float, default=1500, help="seconds per run")
    p.add_argument("--python", default=sys.executable, help="interpreter for the ranks")
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--name", default="capacity", help="result file stem")
    p.add_argument("--plot", default=str(HERE.parent / "docs" / "capacity.png"))
    p.add_argument("--resume", action="store_true",
                   help="keep the runs <name>.progress.json already holds (same cap and family)")
    p.add_argument("--plan", action="store_true", help="print the first probes and exit")
    p.add_argument("--smoke", action="store_true",
                   help=f"a check of the machinery: sizes {', '.join(SMOKE_FAMILY)}, "
                   f"cap {SMOKE['cap']} GiB, systems {SMOKE['systems']} (~5 min)")
    p.add_argument("--report", metavar="JSON", help="rebuild the outputs from a results JSON")
    a = p.parse_args(argv)
    if a.smoke:
        FAMILY.clear()
        FAMILY.update(SMOKE_FAMILY)
        a.cap, a.compare_at, a.systems = SMOKE["cap"], SMOKE["compare_at"], SMOKE["systems"]
        a.sizes, a.name = ",".join(FAMILY), a.name if a.name != "capacity" else "capacity-smoke"
        a.plot = str(Path(a.out_dir) / f"{a.name}.png")
    a.system_list = [s.strip() for s in a.systems.split(",") if s.strip()]
    a.size_list = [s.strip() for s in a.sizes.split(",") if s.strip()]
    bad = [s for s in a.system_list if s not in SYSTEMS]
    bad += [s for s in a.size_list + ([a.compare_at] if a.compare_at else []) if s not in FAMILY]
    if bad:
        p.error(f"unknown system or size: {', '.join(bad)}")
    a.cap_bytes, a.floor_bytes = int(a.cap * GiB), int(a.floor * GiB)
    a.cgroup_dir = None if a.cgroup == "off" else (
        own_memory_cgroup() if a.cgroup == "auto" else Path(a.cgroup))
    if a.cgroup != "off" and (a.cgroup_dir is None or not os.access(a.cgroup_dir, os.W_OK)):
        p.error(f"--cgroup {a.cgroup}: no writable memory cgroup there; use --cgroup off "
                "(the watchdog alone) or give a directory you may create cgroups in")
    return a


def take_lock() -> Any:
    f = open(LOCK, "w")  # noqa: SIM115 - held for the life of the process
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(f"another bench/capacity.py is running (lock {LOCK}); wait for it to end")
    return f


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    out_dir = Path(a.out_dir)
    if a.report:
        old = json.loads(Path(a.report).read_text())
        write_outputs(old["meta"], old["runs"], out_dir, a.name, Path(a.plot))
        return
    a.params = {s: params_of(s) for s in FAMILY}
    sizes = sorted(a.size_list, key=a.params.__getitem__)
    if a.plan:
        a.resume = False
        runner = Runner(a, out_dir, out_dir / "unused")
        for s in a.system_list:
            if s in SEARCHED:
                print(f"{s:>15}: first probe {sizes[first_probe(s, runner, sizes)]}")
        return
    lock = take_lock()
    need = 2 * a.cap_bytes + a.floor_bytes
    if mem_available() < need:
        sys.exit(f"MemAvailable {mem_available() / GiB:.1f} GiB < 2 × cap + floor = "
                 f"{need / GiB:.1f} GiB: give a smaller --cap, or wait for a quieter moment")
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "cap_bytes": a.cap_bytes, "steps": a.steps, "world_size": 2,
            "family": {s: {**model_of(s), "params": a.params[s]} for s in sizes},
            "compare_at": a.compare_at, "cgroup": cgroup_report(),
            "cgroup_used": str(a.cgroup_dir) if a.cgroup_dir else None,
            "load_avg_start": os.getloadavg(), "zt_config": a.zt_config,
            "commit": subprocess.run(["git", "describe", "--always", "--dirty"], cwd=HERE,
                                     capture_output=True, text=True).stdout.strip()}
    runner = Runner(a, logs, out_dir / f"{a.name}.progress.json")
    if a.compare_at:
        meta_too = "fsdp2-reshard" in a.system_list  # FSDP2's own meta-init recipe, beside
        for s in [s for s in COMPARED if s in a.system_list or (meta_too and s in EXTRA)]:
            runner(s, a.compare_at)
    for s in a.system_list:
        if s in SEARCHED:
            search(s, runner, sizes)
    meta.update(wall_s=time.perf_counter() - runner.t0, load_avg_end=os.getloadavg())
    write_outputs(meta, runner.runs, out_dir, a.name, Path(a.plot))
    lock.close()


if __name__ == "__main__":
    main()
