"""Memory of a checkpoint save and load of a ZeRO-Infinity run (ZeRO-3, parameters and
optimizer states on NVMe, 1 rank, CPU fp32): streamed (each state read from its tier just
before its bytes are written, and a load filling the tier unit by unit) against the
states brought resident first (what a save and a load did before; still what
`engine.state_dict()` without `lazy` does).

    PYTHONPATH=src .venv/bin/python bench/ckpt_stream.py --layers 8 --embd 384 \\
        --nvme-path /tmp/zt-nvme --out bench/out/ckpt_stream.json

Per mode a fresh process: one training step, then the save (with the finite-weights
check a run makes first), then a fresh engine loads it. The anonymous resident set
(RssAnon: not the checkpoint file's pages a load maps) is sampled every 2 ms, with
glibc's mmap threshold at 64 KiB so freed memory leaves it (short-lived peaks can be
missed: the live-bytes column counts exactly the states read from the tier and alive
at once during the save). Prints a table, writes
JSON; both modes' files are compared byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon"):
                return int(line.split()[1]) * 1024
    return 0


class Peak:
    """The resident set's rise above its level at entry, sampled in a thread."""

    def __enter__(self):
        self.base = self.peak = rss()
        self.stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        return self

    def _run(self):
        while not self.stop:
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.stop = True
        self.t.join()
        self.rise = max(self.peak, rss()) - self.base


def engine(args, swap: Path):
    import torch

    from zerotrain.config import build_config
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT

    cfg = build_config({
        "model": {"n_layer": args.layers, "n_head": max(1, args.embd // 64),
                  "n_embd": args.embd, "block_size": 16, "bias": False},
        "data": {"micro_batch_size": 2}, "train": {"steps": 10, "device": "cpu"},
        "zero": {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
                 "nvme_path": str(swap)}})
    torch.manual_seed(0)
    return Engine(GPT(cfg.model), cfg, torch.device("cpu"))


def worker(args) -> dict:
    import torch

    from zerotrain.checkpoint import load, save
    from zerotrain.zero.tiers.lazy import LoadMeter

    root = Path(args.dir) / args.mode
    shutil.rmtree(root, ignore_errors=True)
    (root / "swap").mkdir(parents=True)

    eng = engine(args, root / "swap")
    x = torch.randint(0, 256, (2, 16))
    eng.backward(eng(x, x))
    eng.step()
    units = eng.strategy.units
    out = {"mode": args.mode, "params": sum(u.numel for u in units),
           "states_MiB": sum(u.shard_numel for u in units) * 12 / 2**20,
           "unit_states_MiB": max(u.shard_numel for u in units) * 12 / 2**20}
    t0 = time.perf_counter()
    with Peak() as p, LoadMeter() as live:
        assert eng.strategy.weights_finite()
        if args.mode == "streamed":
            ckpt = eng.save_checkpoint(root / "ckpt")
        else:
            ckpt = save(eng.state_dict(), root / "ckpt", step=eng.global_step, rank=0,
                        world=1, keep=1)
    out.update(save_s=time.perf_counter() - t0, save_rise_MiB=p.rise / 2**20,
               save_live_MiB=live.peak / 2**20 if args.mode == "streamed" else None)
    eng.close()
    fresh = engine(args, root / "swap")
    t0 = time.perf_counter()
    with Peak() as p:
        if args.mode == "streamed":
            fresh.load_checkpoint(ckpt)
        else:
            sd, _ = load(ckpt, fresh.state_dict(), 0)
            fresh.load_state_dict(sd)
            del sd
    out.update(load_s=time.perf_counter() - t0, load_rise_MiB=p.rise / 2**20,
               file=str(ckpt / "rank00000.safetensors"))
    fresh.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=384)
    ap.add_argument("--nvme-path", dest="dir", default="/tmp/zt-ckpt-stream")
    ap.add_argument("--out", default="bench/out/ckpt_stream.json")
    ap.add_argument("--mode", choices=["streamed", "resident"])
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(worker(args)))
        return
    rows = []
    for mode in ("resident", "streamed"):
        cmd = [sys.executable, __file__, "--mode", mode, "--layers", str(args.layers),
               "--embd", str(args.embd), "--nvme-path", args.dir]
        # big blocks from mmap, so memory freed is memory given back (glibc would keep
        # freed heap pages: a rise would then not show)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    same = Path(rows[0]["file"]).read_bytes() == Path(rows[1]["file"]).read_bytes()
    print(f"{rows[0]['params']:,} params, states {rows[0]['states_MiB']:.1f} MiB, largest "
          f"unit's states {rows[0]['unit_states_MiB']:.1f} MiB; files identical: {same}")
    print("| mode | save: anon RSS rise MiB | save: states alive at once MiB | save s "
          "| load: anon RSS rise MiB | load s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        live = "—" if r["save_live_MiB"] is None else f"{r['save_live_MiB']:.1f}"
        print(f"| {r['mode']} | {r['save_rise_MiB']:.1f} | {live} | {r['save_s']:.2f} "
              f"| {r['load_rise_MiB']:.1f} | {r['load_s']:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "identical": same}, indent=1))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
