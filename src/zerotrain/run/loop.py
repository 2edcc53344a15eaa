"""The training loop: steps, with logs, evaluations, checkpoints, and the end of a run.

Readable in one sitting on purpose: `train_step` runs one optimizer step, `train` is the
loop, `_finish` the end; the run it steps is built by `setup.py`, what the user sees is
`report.Reporter`, the run folder's rules are `run_dir.py`, preemption and faults are
`lifecycle.py`, and everything clever lives in the engine. Every rank runs this same
code; only rank 0 reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from zerotrain.comm.dist import patient_barrier, shutdown
from zerotrain.config import Config
from zerotrain.data.sampler import to_device
from zerotrain.data.tokenizer import Tokenizer, bits_per_byte
from zerotrain.engine import PHASE_STEPS, Engine, StepInfo
from zerotrain.models.moe import stats_record, take_stats
from zerotrain.models.sampling import generate
from zerotrain.run.fit import diagnose
from zerotrain.run.lifecycle import Interrupted, Preemption, maybe_inject_fault
from zerotrain.run.setup import Batches, Diverged, Run, setup


@torch.no_grad()
def evaluate(engine: Engine, batches: Batches) -> float:
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
def generate_text(engine: Engine, tok: Tokenizer, prompt: str, n_tokens: int,
                  seed: int) -> str:
    """Every rank generates with the same seed (ZeRO-3 needs all ranks in each forward)."""
    engine.eval()
    g = torch.Generator(device=engine.device).manual_seed(seed)
    idx = torch.tensor([tok.encode(prompt) or [0]], dtype=torch.long, device=engine.device)
    out = generate(engine.module, idx, n_tokens, engine.config.model.block_size, generator=g,
                   vocab_limit=tok.vocab_size)
    engine.train()
    return tok.decode(out[0].tolist())


def train_step(run: Run) -> tuple[StepInfo, torch.Tensor, float]:
    """One optimizer step over `grad_accum_steps` micro-batches: (info, mean loss as a
    float64 0-d tensor on the device, seconds). The loss stays on the device — reading
    it (`float(loss)`) waits for the GPU, so only log steps do."""
    eng, d, c = run.engine, run.dist, run.cfg
    step, accum = eng.global_step, c.data.grad_accum_steps
    t0 = time.perf_counter()
    loss_sum = torch.zeros((), dtype=torch.float64, device=d.device)
    sinfo = None
    for m in range(accum):
        # the ranks of a sequence-parallel group get the same batch (the engine slices it)
        sp = c.sequence.parallel
        x, y = run.sampler.batch(step, m, d.rank // sp, d.world_size // sp,
                                 c.data.micro_batch_size, accum)
        loss = eng(to_device(x, d.device), to_device(y, d.device))
        eng.backward(loss)
        sinfo = eng.step()
        loss_sum += loss.detach()  # fp32 -> fp64 exactly: the sum of loss.item()s
    assert sinfo is not None
    return sinfo, loss_sum / accum, time.perf_counter() - t0


def _log_step(run: Run, sinfo: StepInfo, loss: torch.Tensor, dt: float) -> float:
    """Log a step (rank 0 writes); the loss averaged over ranks, which every rank gets."""
    loss_avg = float(run.engine.comm.all_reduce_scalars(loss.reshape(1))[0]) \
        / run.dist.world_size
    stats = take_stats(run.engine.module)  # MoE routers: same layers on every rank
    moe = stats_record(run.engine.comm.all_reduce_scalars(stats.flatten()).view(stats.shape)) \
        if stats is not None else None
    run.report.log_step(run.engine, sinfo, loss_avg, run.global_tokens / dt, dt, moe)
    return loss_avg


class _Watch:
    """Per-step checks that stop a run: divergence, preemption, injected faults.

    Preemption at several ranks: every rank must stop at the same step boundary, so the
    flag is voted on (a MAX all-reduce). A blocking vote every step would drain the
    device queue at each step boundary (host → device, NCCL, device → host), so the
    vote is asynchronous: cast at step k, read at step k + 1, where the run stops (one
    step after the signal instead of at once — a preemption's grace period is seconds
    to minutes; a step is well under that)."""

    def __init__(self, run: Run, preemption: Preemption):
        self.run, self.preemption = run, preemption
        self.in_a_row = 0
        self._vote: Callable[[], float] | None = None  # the last vote's result, when ready

    def after_step(self, sinfo: StepInfo) -> None:
        run, cfg = self.run, self.run.cfg
        step = run.engine.global_step
        if sinfo.spike:
            run.report.say(f"[zerotrain] step {step} skipped by the spike guard: {sinfo.spike}")
        self.in_a_row = self.in_a_row + 1 if sinfo.skipped and not sinfo.spike else 0
        if self.in_a_row >= cfg.train.max_skipped_steps:
            raise Diverged(f"{self.in_a_row} optimizer steps in a row had non-finite "
                           f"gradients (up to step {step}); training has diverged. Lower "
                           f"optimizer.lr and {run._earlier()} (train.max_skipped_steps "
                           "sets this limit)")
        maybe_inject_fault(cfg.train.fault, run.dist.rank, step)
        if run.dist.world_size > 1:  # every rank stops at the same step boundary
            stop = self.finish() > 0  # the vote cast at the previous step
            if not stop:
                self._cast(self.preemption.requested)
        else:
            stop = self.preemption.requested
        if stop:
            path = run.save()
            run.report.close()
            raise Interrupted(step, str(path))

    def _cast(self, flag: bool) -> None:
        """Start this step's preemption vote (SUM of 0/1 flags) without waiting for it."""
        comm = self.run.engine.comm
        votes = torch.full((1,), float(flag), dtype=torch.float32, device=comm.device)
        handle = comm.all_reduce(votes, purpose="control", async_op=True)
        if comm.device.type == "cuda":  # the stream waits for NCCL, the host does not
            handle.wait()
            host = torch.empty(1, dtype=torch.float32, pin_memory=True)
            host.copy_(votes, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record()
            self._vote = lambda: (landed.synchronize(), float(host[0]))[1]
        else:  # gloo: the work runs on its own thread until waited for
            self._vote = lambda: (handle.wait(), float(votes[0]))[1]

    def finish(self) -> float:
        """The number of ranks asking to stop at the last vote (0 when none is pending);
        called at the end of the loop too, so no vote is left in flight."""
        vote, self._vote = self._vote, None
        return vote() if vote is not None else 0.0


def _validate(run: Run, step: int) -> float:
    v = evaluate(run.engine, run.val_set)
    run.report.record({"type": "val", "step": step, "val_loss": v,
                       "val_bits_per_byte": bits_per_byte(v, run.val_bpt)})
    return v


def train(cfg: Config, resume: str | None = None) -> dict[str, Any]:
    """Train; the process group is closed afterwards if this call opened it."""
    run = setup(cfg, resume)
    summary = _train(run)
    if run.dist.owns_group:  # a caller's own group (tests, notebooks) stays theirs
        shutdown()
    return summary


def _train(run: Run) -> dict[str, Any]:
    cfg, eng, report = run.cfg, run.engine, run.report
    if run.resumed and eng.global_step >= cfg.train.steps:
        report.say(f"[zerotrain] the run is already complete at step {eng.global_step} "
                   f"(train.steps {cfg.train.steps}); raise train.steps to continue it")
        report.close()
        eng.close()
        return {"type": "summary", "step": eng.global_step, "steps_run": 0}
    report.start(eng, run.dist.world_size)
    first_val = None
    if eng.global_step == 0 and cfg.logging.eval_every:
        first_val = _validate(run, 0)
    t_start = time.perf_counter()
    steps_run, loss_avg = 0, float("nan")
    with Preemption() as preemption, report.bar_closed_on_error():
        watch = _Watch(run, preemption)
        while eng.global_step < cfg.train.steps:
            sinfo, loss, dt = train_step(run)
            run.last_loss = loss
            steps_run += 1
            last = eng.global_step
            if last % cfg.logging.log_every == 0 or last == cfg.train.steps:
                loss_avg = _log_step(run, sinfo, loss, dt)
            report.advance()
            if last == PHASE_STEPS:
                report.phases(eng)
            watch.after_step(sinfo)
            if cfg.logging.eval_every and last % cfg.logging.eval_every == 0 \
                    and last != cfg.train.steps:
                v = _validate(run, last)
                report.say(f"step {last}: validation loss {v:.4f}, "
                           f"{bits_per_byte(v, run.val_bpt):.4f} bits/byte")
            if cfg.checkpoint.every and last % cfg.checkpoint.every == 0 \
                    and last != cfg.train.steps:
                if run.loss_finite():
                    report.say(f"[zerotrain] step {last}: checkpoint "
                               f"{run.save(loss_ok=True)}")
                else:  # weights that give a non-finite loss are no point to resume from
                    report.say(f"[zerotrain] step {last}: no checkpoint, the loss is not "
                               "finite (the spike guard or train.max_skipped_steps decides "
                               "whether training goes on)")
        watch.finish()
    report.close_bar()
    elapsed = time.perf_counter() - t_start
    return _finish(run, first_val, loss_avg, steps_run, elapsed)


def _finish(run: Run, first_val: float | None, loss_avg: float, steps_run: int,
            elapsed: float) -> dict[str, Any]:
    cfg, eng, report = run.cfg, run.engine, run.report
    final_val = _validate(run, eng.global_step)
    ckpt = run.save(val_loss=final_val)
    report.phases(eng)
    sample = ""
    if cfg.logging.sample_tokens:
        sample = generate_text(eng, run.tokenizer, "def ", cfg.logging.sample_tokens,
                               cfg.train.seed)
    summary = {
        "type": "summary", "step": eng.global_step, "steps_run": steps_run,
        "first_val_loss": first_val, "final_val_loss": final_val, "final_train_loss": loss_avg,
        "final_val_bits_per_byte": bits_per_byte(final_val, run.val_bpt),
        "seconds": elapsed,
        "tokens_per_s": steps_run * run.global_tokens / max(elapsed, 1e-9),
        "skipped_steps": eng.last_info.skipped_total if eng.last_info else 0,
        "checkpoint": str(ckpt), "world_size": run.dist.world_size,
        "strategy": eng.strategy.name,
    }
    fit = diagnose(report.log.records)  # the train–validation gap, its trend, a verdict
    summary.update(fit.record())
    report.finish(summary, fit, sample)
    patient_barrier()  # rank 0 wrote the summary, plots and sample alone
    eng.close()
    return summary
