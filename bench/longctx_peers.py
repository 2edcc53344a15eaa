"""One rank of a bench/longctx.py peer run: FSDP2 or DeepSpeed ZeRO-3, each with Hugging
Face activation checkpointing, training issue 24's HF Llama at one sequence length.

Started by bench/longctx.py (never by hand: the driver sets RANK, WORLD_SIZE and
MASTER_ADDR/PORT, caps and watches this process's memory from outside), with the
DeepSpeed venv of bench/setup_peers.sh (DeepSpeed 0.19.8 + transformers). The model is
the one zerotrain trains in the same bench: `transformers.LlamaForCausalLM` with random
weights under the same seed, 2 layers × 128, vocabulary 32,000, fp32, AdamW (torch's,
lr 1e-3), one sequence of --seq tokens per rank, labels = inputs (HF shifts them). The
peers use the standard HF path: `model(input_ids=x, labels=x).loss` (full logits, then
the loss), with `activation_checkpointing_enable()` (torch's non-reentrant checkpoint
around every decoder layer).

  fsdp2-ckpt  torch.distributed.fsdp.fully_shard on every decoder layer and the root,
              resharding after forward (ZeRO-3's memory class)
  ds3-ckpt    deepspeed.initialize with zero_optimization.stage 3 and a client
              torch.optim.AdamW (bench/peers_workers.py's ZeRO-3 settings)

Rank 0 writes one JSON object to --out (losses, per-step times = slowest rank, every
rank's peak resident set); every rank writes its phase to `<out>.rank<r>.phase`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PEERS = ("fsdp2-ckpt", "ds3-ckpt")


def build_model(seq: int, seed: int) -> Any:
    import torch
    import transformers

    from longctx import HF_LLAMA

    torch.manual_seed(seed)
    conf = {k: v for k, v in HF_LLAMA.items() if k != "model_type"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **conf, max_position_embeddings=seq, use_cache=False))
    model.activation_checkpointing_enable()  # non-reentrant torch checkpoint per layer
    model.train()
    return model


def fsdp2(model: Any) -> tuple[Any, Any]:
    """FSDP2: every decoder layer and the root sharded, resharded after forward."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x: Any) -> float:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return step, lambda: None


def deepspeed3(model: Any) -> tuple[Any, Any]:
    """DeepSpeed ZeRO-3 with a client AdamW; blocks gathered again in backward."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    mb = int(25 * 2**20 / 4)
    config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "train_batch_size": dist.get_world_size(), "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "reduce_bucket_size": mb,
                              "allgather_bucket_size": mb, "overlap_comm": False,
                              "stage3_prefetch_bucket_size": mb,
                              "stage3_param_persistence_threshold": 0,
                              "stage3_max_reuse_distance": 0},
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True}
    client = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config)

    def step(x: Any) -> float:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return float(loss)

    return step, engine.destroy if hasattr(engine, "destroy") else (lambda: None)


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from peers_workers import run_rank
    from zerotrain.memory import proc_status

    rank = int(os.environ.get("RANK", 0))
    phase = Path(f"{a.out}.rank{rank}.phase")

    def work() -> dict[str, Any]:
        from longctx import HF_LLAMA

        torch.set_num_threads(1)
        phase.write_text("build")
        model = build_model(a.seq, a.seed)
        step, close = (fsdp2 if a.system == "fsdp2-ckpt" else deepspeed3)(model)
        g = torch.Generator().manual_seed(a.seed + rank)
        times, losses = [], []
        for i in range(a.steps):
            phase.write_text(f"step {i}")
            x = torch.randint(0, HF_LLAMA["vocab_size"], (1, a.seq), generator=g)
            t0 = time.perf_counter()
            losses.append(step(x))
            times.append(time.perf_counter() - t0)
        phase.write_text("report")
        mine = {"peak": proc_status().get("VmHWM", 0), "times": times}
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        close()
        step_s = [max(r["times"][i] for r in every) for i in range(a.steps)]
        import transformers

        return {"ok": True, "system": a.system, "seq": a.seq, "losses": losses,
                "step_times_s": step_s, "ranks": every, "torch": torch.__version__,
                "transformers": transformers.__version__}

    run_rank(a, work, 1200)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", required=True, choices=PEERS)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


if __name__ == "__main__":
    worker(parse())
