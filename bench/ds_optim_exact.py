"""The update of a client torch.optim.AdamW under zerotrain.deepspeed against DeepSpeed
0.19.8, element for element: one script (an MLP, the HF Trainer's two groups — decay /
no decay —, 10 updates, no clipping), run with `torchrun` under DeepSpeed and under
zerotrain.deepspeed, 2 ranks on CPU, fp32, at ZeRO-2 and ZeRO-3, accumulation 1 and 2,
the client AdamW fused (the Trainer's default with torch >= 2.8) and single-tensor.
Prints, per case, how many elements of the final weights differ (0 = bit-exact).

    .venv-bench/bin/python bench/ds_optim_exact.py        # the DeepSpeed venv of setup_peers.sh

Worker mode (what torchrun runs): ds_optim_exact.py --worker ds|zt STAGE GAS fused|single OUT
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def worker(impl: str, stage: int, gas: int, kind: str, out: str) -> None:
    import torch
    from torch import nn

    if impl == "zt":
        import zerotrain.deepspeed as deepspeed
    else:
        import deepspeed
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 16))
    decay = [p for p in net.parameters() if p.ndim == 2]
    rest = [p for p in net.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
    kw = {"fused": True} if kind == "fused" else {"foreach": False}
    opt = torch.optim.AdamW(groups, lr=1e-3, **kw)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=cfg)
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(1)
    for _ in range(10 * gas):
        xs = [torch.randn(4, 64, generator=g) for _ in range(2)]
        engine.backward(engine(xs[rank]).square().mean())
        engine.step()
    if impl == "zt":
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            got = [p.detach().clone() for p in engine.module.parameters()]
    else:
        from deepspeed.utils import safe_get_full_fp32_param

        got = [safe_get_full_fp32_param(p).detach().clone() for p in engine.module.parameters()]
    if rank == 0:
        torch.save(got, out)


def run(impl: str, stage: int, gas: int, kind: str, out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    if impl == "zt":
        env["PYTHONPATH"] = f"{SRC}{os.pathsep}{env.get('PYTHONPATH', '')}"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        __file__,
        "--worker",
        impl,
        str(stage),
        str(gas),
        kind,
        str(out),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"{impl} stage {stage} gas {gas} {kind}:\n{p.stderr[-3000:]}")


def main() -> None:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        for stage, gas, kind in itertools.product((2, 3), (1, 2), ("fused", "single")):
            paths = {impl: Path(tmp) / f"{impl}-{stage}-{gas}-{kind}.pt" for impl in ("ds", "zt")}
            for impl, path in paths.items():
                run(impl, stage, gas, kind, path)
            a, b = (torch.load(paths[i]) for i in ("ds", "zt"))
            diff = sum(int((x != y).sum()) for x, y in zip(a, b, strict=True))
            print(
                f"ZeRO-{stage} gas {gas} AdamW {kind:6s}: {diff} of "
                f"{sum(x.numel() for x in a)} elements differ",
                flush=True,
            )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
    else:
        main()
