"""`DeepSpeedEngine`: zerotrain's Engine with DeepSpeed's optimizer, scheduler and
checkpoint semantics, for scripts written against DeepSpeed.

What it changes in the Engine, and nothing else:
- optimizer groups are the user's groups (`model_parameters` dicts or a client
  optimizer's groups), each with its own hyper-parameters, read before every update
  from the `ParamGroups` object `initialize` returns (`apply_lr`);
- the lr of each update is whatever the scheduler left in those groups, and the
  scheduler is stepped after each applied update, as DeepSpeed does (so a config
  WarmupLR runs lr(0), lr(0), lr(1), ... where the native engine runs lr(0), lr(1), ...);
- checkpoints carry the scheduler's state and the groups' hyper-parameters, and take
  DeepSpeed's arguments (`save_latest`, `load_optimizer_states`, ...).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerotrain.comm.dist import local_rank
from zerotrain.config import Config
from zerotrain.deepspeed import group as ds_group
from zerotrain.deepspeed import zero
from zerotrain.deepspeed.optim import (
    HYPER,
    ParamGroups,
    client_optimizer_name,
    config_scheduler,
    group_index,
    hyper_of,
    user_groups,
)
from zerotrain.deepspeed.surface import HFSurface
from zerotrain.deepspeed.zero3_check import check_model, watch_first_forward
from zerotrain.engine import Engine, StepInfo
from zerotrain.models import Group, plan_for
from zerotrain.optim import build_optimizer
from zerotrain.optim.torch_rule import arithmetic_of

_UNCAUGHT = False
_previous_hook = sys.excepthook


def _note_uncaught(*exc: Any) -> None:
    global _UNCAUGHT
    _UNCAUGHT = True
    _previous_hook(*exc)


sys.excepthook = _note_uncaught


@atexit.register
def _close_all() -> None:
    """DeepSpeed scripts end without closing anything: stop each engine's communication
    thread and close the group we opened before the interpreter does (torn down under a
    rank still using it, gloo aborts the process at exit). The barrier first, so no rank
    tears its connections down under another's, unless this rank is dying of an error
    (the others may never get there)."""
    for engine in list(zero.ENGINES):
        engine.close()
    if ds_group.OPENED and torch.distributed.is_initialized():
        if not _UNCAUGHT:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _rank0(msg: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"[zerotrain.deepspeed] {msg}", flush=True)


class DeepSpeedEngine(HFSurface, Engine, nn.Module):
    def __init__(self, model: nn.Module, config: Config, ds: dict[str, Any],
                 client_optimizer: Any = None, model_parameters: Any = None,
                 client_lr_scheduler: Any = None, collate_fn: Any = None):
        """`config`: the zerotrain Config mapped from the DeepSpeed dict `ds` (with the
        client optimizer's name when there is one)."""
        nn.Module.__init__(self)  # an nn.Module whose one submodule is `module`
        self.ds_config = ds  # `engine.config` answers it (surface.py)
        if callable(client_optimizer) and not isinstance(client_optimizer,
                                                         torch.optim.Optimizer):
            client_optimizer = client_optimizer(user_groups(model, model_parameters))
        self.client_optimizer = client_optimizer
        name = config.optimizer.name
        if isinstance(client_optimizer, torch.optim.Optimizer):
            name = client_optimizer_name(client_optimizer)
            # as DeepSpeed: groups without parameters leave the client optimizer
            client_optimizer.param_groups[:] = [g for g in client_optimizer.param_groups
                                                if g["params"]]
            self.param_source = ParamGroups(client_optimizer.param_groups, {})  # shared dicts
        elif client_optimizer is not None:
            raise ValueError(f"optimizer must be a torch.optim.Optimizer or a callable "
                             f"returning one, not {type(client_optimizer).__name__}")
        else:
            groups = user_groups(model, model_parameters)
            # the defaults DeepSpeed's optimizer class gives, as zerotrain maps them
            probe = build_optimizer(config.optimizer, [{"params": [torch.zeros(1)]}])
            defaults = {k: v for k, v in probe.defaults.items() if k in HYPER[name]}
            self.param_source = ParamGroups(groups, defaults)
        if name != config.optimizer.name:
            config = config.model_copy(update={"optimizer": config.optimizer.model_copy(
                update={"name": name})})
        self.uses_muon = name == "muon"
        self.torch_rule = self._torch_rule(name, ds)
        plan = plan_for(model)
        src = self.param_source.param_groups
        where = group_index(model, src)
        self.synced = HYPER[name]
        #: optimizer group id -> the user group whose hyper-parameters it takes
        self.source_of = {i: i for i in range(len(src))}
        if self.uses_muon:
            plan = self._muon_plan(plan, where)
        else:
            plan = dataclasses.replace(plan, groups=where)
        pending = zero.take_pending(model)  # weights written under zero.GatheredParameters
        meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
        whole = bool(pending) and all(n in pending for n in meta)  # from_pretrained's case
        super().__init__(model, config, plan=plan, weights=(lambda n, a, b: torch.zeros(
            b - a)) if whole else None)  # laid out; the values come next
        self.collate_fn = collate_fn
        self.training_dataloader = None
        self.client_lr_scheduler = self._scheduler(client_lr_scheduler, config, ds)
        if pending:
            from zerotrain.deepspeed.pending import hand_out

            hand_out(self, pending, whole)
        self.mark_status()
        check_model(self.strategy, model)  # parameters tied across ZeRO-3 units
        self._watch_forward = True  # the first forward looks for reads outside a unit
        self.apply_lr()  # the sharded optimizer starts with the groups' settings
        zero.ENGINES.add(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._watch_forward:  # once: a model reading a block's weights outside it
            self._watch_forward = False
            mode = watch_first_forward(self.strategy, self.module)
            if mode is not None:
                with mode:
                    return super().__call__(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def _scheduler(self, client: Any, config: Config, ds: dict[str, Any]) -> Any:
        """The client lr_scheduler (object, or callable taking the optimizer), else the
        config's `scheduler` block, else None."""
        if client is None:
            return config_scheduler(self.param_source, config, ds)
        if "scheduler" in ds:
            _rank0("the config's `scheduler` block is not used: the client lr_scheduler "
                   "is, as in DeepSpeed")
        return client(self.param_source) if callable(client) else client

    def write_weights(self, values: dict[str, torch.Tensor], params: Any = None) -> None:
        """Make the master weights every rank keeps equal the parameters as they are now
        (whole: call inside `full_parameters(params)`), with `values` (by name) taking the
        place of theirs; with `params`, only the masters of the units holding them."""
        full = dict(self.module.named_parameters())

        def read(name: str, start: int, stop: int) -> torch.Tensor:
            t = values[name] if name in values else full[name].detach()
            return t.reshape(-1)[start:stop]
        units_of = getattr(self.strategy, "units_of", None)
        only = None if params is None or units_of is None else \
            {u.index for u in units_of(params)}
        self.strategy.load_weights(read, only)

    # ------------------------------------------------------------------ optimizer
    def _muon_plan(self, plan: Any, where: dict[str, int]) -> Any:
        """Muon: the plan's weight matrices form group 0, orthogonalised (at stages 1-3 by
        one owner rank each, zero/muon.py), with the hyper-parameters of the user group
        holding them; everything else of user group i is group 1+i, on the AdamW path."""
        mats = {n for n, g in plan.groups.items() if g == Group.MATRIX}
        users = sorted({where[n] for n in mats if n in where})
        if len(users) > 1:
            raise ValueError(f"optimizer Muon: the weight matrices are split between param "
                             f"groups {users}; zerotrain's Muon updates all matrices as one "
                             "group: keep them in one group (biases and norms may have their "
                             "own)")
        self.source_of = {0: users[0] if users else 0,
                          **{1 + i: i for i in range(len(self.param_source.param_groups))}}
        return dataclasses.replace(plan, groups={
            n: 0 if n in mats else 1 + i for n, i in where.items()})

    def group_options(self) -> dict[int, dict[str, Any]]:
        src = self.param_source.param_groups
        out = {gid: hyper_of(src[i], self.synced) for gid, i in self.source_of.items()}
        if self.uses_muon:  # None: Muon for the matrices; the rest on its AdamW fallback
            for gid, opts in out.items():
                opts["use_muon"] = None if gid == 0 else False
        if self.torch_rule:  # the arithmetic of the torch optimizer DeepSpeed would step
            for gid, i in self.source_of.items():
                out[gid]["arithmetic"] = arithmetic_of(src[i]) \
                    if self.client_optimizer is not None else "torch"
        return out

    def _torch_rule(self, name: str, ds: dict[str, Any]) -> bool:
        """Whether DeepSpeed would step a torch.optim Adam/AdamW here — the client's, or
        the config's with `torch_adam: true` — so zerotrain runs torch's arithmetic."""
        if name not in ("adam", "adamw"):
            return False
        if self.client_optimizer is not None:
            return True
        params = (ds.get("optimizer") or {}).get("params") or {}
        return params.get("torch_adam") is True

    def apply_lr(self) -> float:
        """Copy each user group's hyper-parameters (lr and, for a client optimizer, betas,
        momentum, ... as a scheduler may change them) onto its optimizer groups."""
        src = self.param_source.param_groups
        for g in self.optimizer.param_groups:
            g.update(hyper_of(src[self.source_of[g["group_id"]]], self.synced))
        return float(src[0]["lr"])

    def _step(self) -> StepInfo | None:
        info = super()._step()
        if info is not None:
            self.param_source.overflow = info.skipped
        if info is not None and not info.skipped:  # DeepSpeed skips it on overflow
            if self.client_optimizer is not None:
                # a torch scheduler checks that its optimizer stepped before it does
                self.client_optimizer._opt_called = True  # type: ignore[attr-defined]
            if self.client_lr_scheduler is not None:
                self.client_lr_scheduler.step()
        return info

    @property
    def lr_scheduler(self) -> Any:  # type: ignore[override]
        return self.client_lr_scheduler

    def get_lr(self) -> list[float]:
        """Each group's lr now: the one the next update uses (DeepSpeed's get_lr)."""
        return [float(g["lr"]) for g in self.param_source.param_groups]

    # ------------------------------------------------------------------ DeepSpeed's API
    @property
    def local_rank(self) -> int:
        return local_rank()

    @property
    def global_rank(self) -> int:
        return self.rank

    @property
    def dp_world_size(self) -> int:
        return self.world_size

    def fp16_enabled(self) -> bool:
        return self.config.precision.dtype == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.config.precision.dtype == "bf16"

    def zero_optimization_stage(self) -> int:
        """The config's stage, as DeepSpeed answers (ZeRO-1 + Offload runs as ZeRO-2)."""
        given = (self.ds_config.get("zero_optimization") or {}).get("stage")
        return given if isinstance(given, int) else self.config.zero.stage

    def zero_optimization(self) -> bool:
        return self.config.zero.stage > 0

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.is_boundary()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,  # type: ignore[override]
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        if retain_graph:
            raise ValueError("engine.backward: retain_graph=True is not supported by "
                             "zerotrain.deepspeed; call backward(loss)")
        # scale_wrt_gas=False (the HF Trainer): the loss is already divided by the
        # accumulation steps; the engine's own 1/accum is undone
        super().backward(loss if scale_wrt_gas else loss * self.accum)
        return loss

    def deepspeed_io(self, dataset: Any, batch_size: int | None = None,
                     collate_fn: Any = None, **_: Any) -> torch.utils.data.DataLoader:
        from zerotrain.deepspeed.data import distributed_loader

        return distributed_loader(dataset, batch_size or self.train_micro_batch_size_per_gpu(),
                                  self.rank, self.world_size, collate_fn or self.collate_fn,
                                  drop_last=bool(self.ds_config.get("dataloader_drop_last",
                                                                    False)))

    # ------------------------------------------------------------------ checkpoints
    def _compat_state(self) -> dict[str, Any]:
        sched = self.client_lr_scheduler
        state = {"scheduler": sched.state_dict() if sched is not None else None,
                 "groups": [{k: list(v) if isinstance(v, tuple) else v
                             for k, v in hyper_of(g, self.synced).items()}
                            for g in self.param_source.param_groups]}
        try:
            json.dumps(state)
        except TypeError as e:
            raise ValueError(f"the lr scheduler's state_dict() cannot be saved in a zerotrain "
                             f"checkpoint (JSON only): {e}") from None
        return state

    def save_checkpoint(self, save_dir: str | Path, tag: str | None = None,  # type: ignore[override]
                        client_state: dict | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Collective: save to save_dir/tag (default global_step<N>); `latest` names it
        unless save_latest=False. Returns True, as DeepSpeed does."""
        from zerotrain.checkpoint import save

        self.extra_meta["deepspeed"] = self._compat_state()
        save(self.state_dict(lazy=True), save_dir, step=self.global_step, rank=self.rank,
             world=self.world_size, keep=self.config.checkpoint.keep, client_state=client_state
             if client_state is not None else {}, name=str(tag) if tag is not None
             else f"global_step{self.global_step}", latest=save_latest)
        return True

    def load_checkpoint(self, load_dir: str | Path, tag: str | None = None,  # type: ignore[override]
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Any = None) -> tuple[Path | None, Any]:
        """DeepSpeed's flags: module only (weights and buffers), or also the optimizer
        state and/or the scheduler. Returns (path, client_state), or (None, None) when
        `load_dir` has no `latest` and no tag is given (as DeepSpeed)."""
        from zerotrain.checkpoint import load

        if custom_load_fn is not None:
            raise ValueError("load_checkpoint(custom_load_fn=...) is not supported by "
                             "zerotrain.deepspeed")
        from zerotrain.deepspeed import checkpoint as ds_checkpoint

        folder = ds_checkpoint.find(load_dir, tag)
        if folder is not None:  # written by DeepSpeed: a run migrating to zerotrain
            return self._load_deepspeed(folder, load_optimizer_states, load_lr_scheduler_states,
                                        load_module_only)
        root = Path(load_dir)
        if tag is None and not (root / "latest").is_file() and not (root / "meta.json").is_file():
            _rank0(f"no 'latest' file in '{root}': nothing loaded (pass tag= to name one)")
            return None, None
        src = root / str(tag) if tag is not None else root
        keep_optimizer = load_optimizer_states and not load_module_only
        # lazy: states in an NVMe tier are read and filled one unit at a time
        sd, info = load(src, self.state_dict(lazy=not load_module_only), self.rank,
                        reset_optimizer=not keep_optimizer)
        if load_module_only:
            self.strategy.load_state_dict(sd["strategy"])
            self._load_buffers(sd.get("buffers", {}))
        else:
            sd.pop("rng", None)  # as DeepSpeed: the process's RNG is the script's to restore
            self.load_state_dict(sd)
            saved = info.meta.get("extra", {}).get("deepspeed") or {}
            if keep_optimizer and saved.get("groups"):
                for g, h in zip(self.param_source.param_groups, saved["groups"], strict=True):
                    g.update({k: tuple(v) if isinstance(v, list) else v for k, v in h.items()})
            if (load_lr_scheduler_states and self.client_lr_scheduler is not None
                    and saved.get("scheduler") is not None):
                self.client_lr_scheduler.load_state_dict(saved["scheduler"])
            self.apply_lr()
        self.last_load = info
        return info.path, info.client_state

    def _load_deepspeed(self, folder: Path, load_optimizer_states: bool,
                        load_lr_scheduler_states: bool, load_module_only: bool
                        ) -> tuple[Path, Any]:
        """A DeepSpeed checkpoint folder: weights, moments, steps, scheduler (see
        deepspeed/checkpoint.py), with DeepSpeed's flags."""
        from zerotrain.checkpoint.state import resliced
        from zerotrain.deepspeed.checkpoint import DeepSpeedShards

        name_of = {id(p): n for n, p in self.module.named_parameters()}
        names = [[name_of[id(p)] for p in g["params"]] for g in self.param_source.param_groups]
        shapes = {n: torch.Size(s) for u in self.strategy.layout()["units"]
                  for n, s, *_ in u["params"]}
        shards = DeepSpeedShards(folder, names, shapes)
        sd = resliced(shards, self.state_dict())  # type: ignore[arg-type]
        if load_module_only:
            self.strategy.load_state_dict(sd["strategy"])
            self._load_buffers(sd["buffers"])
            return folder, shards.client_state()
        if not load_optimizer_states:
            sd["optimizer"] = {"state": {}}
        steps = shards.global_steps
        sd.update(scaler=self.scaler.state_dict(), counters={
            "global_step": steps, "micro_step": steps * self.accum, "spike_guard": None})
        self.load_state_dict(sd)
        if load_optimizer_states and len(shards.groups) == len(self.param_source.param_groups):
            for g, saved in zip(self.param_source.param_groups, shards.groups, strict=True):
                g["lr"] = float(saved["lr"])
        sched = shards.model.get("lr_scheduler")
        if load_lr_scheduler_states and self.client_lr_scheduler is not None and sched:
            self.client_lr_scheduler.load_state_dict(sched)
        self.apply_lr()
        return folder, shards.client_state()

    def _load_buffers(self, values: dict[str, torch.Tensor]) -> None:
        named = dict(self.module.named_buffers())
        with torch.no_grad():
            for name, value in values.items():
                if name in named:
                    named[name].copy_(value)
