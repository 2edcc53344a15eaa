"""The training loop: config -> data -> engine -> steps, with logs, evals, checkpoints.

Readable in one sitting on purpose; everything clever lives in the engine. Every rank
runs this same function; only rank 0 writes logs, plots and samples.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from zerotrain.checkpoint.io import CheckpointError, resolve
from zerotrain.checkpoint.state import load_engine, save_engine
from zerotrain.comm.dist import barrier, init_distributed
from zerotrain.config import Config
from zerotrain.data.corpus import DataError, decode, encode, load_tokens, train_val_split
from zerotrain.data.sampler import WindowSampler, eval_batches
from zerotrain.engine import Engine, StepInfo
from zerotrain.models.gpt import GPT


def _threads(cfg: Config) -> int:
    if cfg.train.threads:
        return cfg.train.threads
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, (os.cpu_count() or 1) // local)


@torch.no_grad()
def evaluate(engine: Engine, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean validation loss over every rank's share of the fixed validation windows."""
    engine.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for x, y in batches:
        loss = engine(x.to(engine.device), y.to(engine.device))
        total += torch.tensor([loss.item() * len(x), len(x)], dtype=torch.float64)
    total = engine.comm.all_reduce_scalars(total)
    engine.train()
    return float(total[0] / total[1])


@torch.no_grad()
def generate_text(engine: Engine, prompt: str, n_tokens: int, seed: int) -> str:
    """Every rank generates with the same seed (ZeRO-3 needs all ranks in each forward)."""
    engine.eval()
    g = torch.Generator().manual_seed(seed)
    idx = torch.from_numpy(encode(prompt).astype("int64"))[None].to(engine.device)
    out = engine.module.generate(idx, n_tokens, generator=g)
    engine.train()
    return decode(out[0].tolist())


def _plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [r for r in records if r["type"] == "train"]
    va = [r for r in records if r["type"] == "val"]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    a1.plot([r["step"] for r in tr], [r["loss"] for r in tr], label="train")
    a1.plot([r["step"] for r in va], [r["val_loss"] for r in va], "o-", label="validation")
    a1.axhline(math.log(256), ls=":", c="gray", label="ln 256 (uniform bytes)")
    a1.set_ylabel("loss (nats/byte)")
    a1.legend()
    a2.plot([r["step"] for r in tr], [r["lr"] for r in tr], c="C2")
    a2.set_ylabel("learning rate")
    a2.set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class _Log:
    """metrics.jsonl on rank 0; on resume, lines past the resumed step are dropped."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None):
        self.path, self.enabled = path, enabled
        self.records: list[dict] = []
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and path.exists():
            keep = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            self.records = [r for r in keep if r.get("step", 0) <= resume_step]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
            tmp.replace(path)
        elif path.exists():
            path.unlink()

    def __call__(self, record: dict) -> None:
        if self.enabled:
            self.records.append(record)
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def train(cfg: Config, resume: str | None = None) -> dict[str, Any]:
    info = init_distributed(cfg.train.device, cfg.comm.backend, cfg.comm.timeout_s)
    rank, world = info.rank, info.world_size
    torch.set_num_threads(_threads(cfg))
    torch.manual_seed(cfg.train.seed)  # same initial weights on every rank

    tokens = load_tokens(cfg.data.path)
    if int(tokens.max()) >= cfg.model.vocab_size:
        raise DataError(f"data holds token id {int(tokens.max())} but model.vocab_size is "
                        f"{cfg.model.vocab_size}; raise model.vocab_size")
    train_tok, val_tok = train_val_split(tokens, cfg.data.val_fraction)
    T, mbs, accum = cfg.model.block_size, cfg.data.micro_batch_size, cfg.data.grad_accum_steps
    sampler = WindowSampler(train_tok, T, cfg.train.seed)
    val_set = eval_batches(val_tok, T, rank, world, mbs, cfg.logging.eval_batches)

    engine = Engine(GPT(cfg.model), cfg, info.device)
    run_dir = Path(cfg.logging.run_dir)
    ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    if resume is not None:
        src = ckpt_root if resume in ("", "latest") else Path(resume)
        try:
            resolve(src)
        except CheckpointError as e:
            raise CheckpointError(f"--resume: {e}") from None
        load_engine(engine, src)
    log = _Log(run_dir / "metrics.jsonl", rank == 0,
               engine.global_step if resume is not None else None)
    if rank == 0:
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    mem = engine.memory_report()
    log({"type": "memory", "step": engine.global_step, **mem})
    if rank == 0:
        ms = mem["model_states"]
        print(f"[zerotrain] {world} rank(s), {engine.strategy.name}, "
              f"{engine.module.num_params():,} params, {engine.policy.describe()}")
        print("[zerotrain] model states on rank 0 (bytes): " + ", ".join(
            f"{place} {k}={v:,}" for place in ("device", "host") for k, v in ms[place].items()
            if v))

    global_tokens = mbs * world * accum * T
    bar = None
    if rank == 0 and cfg.logging.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.train.steps, initial=engine.global_step, unit="step",
                   dynamic_ncols=True)
    first_val = None
    if engine.global_step == 0 and cfg.logging.eval_every:
        first_val = evaluate(engine, val_set)
        log({"type": "val", "step": 0, "val_loss": first_val})
    t_start = time.perf_counter()
    steps_run = 0
    sinfo: StepInfo | None = None
    loss_avg = float("nan")
    while engine.global_step < cfg.train.steps:
        step = engine.global_step
        t0 = time.perf_counter()
        loss_sum = 0.0
        for m in range(accum):
            x, y = sampler.batch(step, m, rank, world, mbs, accum)
            loss = engine(x.to(info.device), y.to(info.device))
            engine.backward(loss)
            sinfo = engine.step()
            loss_sum += loss.item()
        assert sinfo is not None
        dt = time.perf_counter() - t0
        steps_run += 1
        last = engine.global_step
        if last % cfg.logging.log_every == 0 or last == cfg.train.steps:
            loss_avg = float(engine.comm.all_reduce_scalars([loss_sum / accum])[0]) / world
            sent, _ = engine.last_traffic_bytes
            rec = {"type": "train", "step": last, "loss": loss_avg, "lr": sinfo.lr,
                   "grad_norm": sinfo.grad_norm, "tokens_per_s": global_tokens / dt,
                   "step_time_s": dt, "loss_scale": sinfo.loss_scale,
                   "skipped_total": sinfo.skipped_total, "bytes_sent": sent}
            log(rec)
            if bar is not None:
                post = {"loss": f"{loss_avg:.3f}", "lr": f"{sinfo.lr:.2e}",
                        "tok/s": f"{global_tokens / dt:,.0f}", "gnorm": f"{sinfo.grad_norm:.2f}",
                        "skip": sinfo.skipped_total}
                if engine.policy.loss_scaling:
                    post["scale"] = f"{sinfo.loss_scale:g}"
                bar.set_postfix(post, refresh=False)
        if bar is not None:
            bar.update(1)
        if cfg.logging.eval_every and last % cfg.logging.eval_every == 0 \
                and last != cfg.train.steps:
            v = evaluate(engine, val_set)
            log({"type": "val", "step": last, "val_loss": v})
            if bar is not None:
                bar.write(f"step {last}: validation loss {v:.4f}")
        if cfg.checkpoint.every and last % cfg.checkpoint.every == 0 and last != cfg.train.steps:
            save_engine(engine, ckpt_root)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t_start

    final_val = evaluate(engine, val_set)
    log({"type": "val", "step": engine.global_step, "val_loss": final_val})
    ckpt = save_engine(engine, ckpt_root)
    sample = ""
    if cfg.logging.sample_tokens:
        sample = generate_text(engine, "def ", cfg.logging.sample_tokens, cfg.train.seed)
    summary = {
        "type": "summary", "step": engine.global_step, "steps_run": steps_run,
        "first_val_loss": first_val, "final_val_loss": final_val, "final_train_loss": loss_avg,
        "seconds": elapsed, "tokens_per_s": steps_run * global_tokens / max(elapsed, 1e-9),
        "skipped_steps": engine.scaler.skipped, "checkpoint": str(ckpt),
        "world_size": world, "strategy": engine.strategy.name,
    }
    log(summary)
    if rank == 0:
        if cfg.logging.plot and log.records:
            _plot(log.records, run_dir / "curves.png")
        if sample:
            (run_dir / "sample.txt").write_text(sample)
            print("\n----- sample -----\n" + sample + "\n------------------")
        fv = f"{first_val:.4f} -> " if first_val is not None else ""
        print(f"[zerotrain] validation loss {fv}{final_val:.4f} (ln 256 = {math.log(256):.4f}); "
              f"{steps_run} steps in {elapsed:.1f}s; checkpoint {ckpt}; metrics "
              f"{run_dir / 'metrics.jsonl'}")
    barrier()
    engine.close()
    return summary
