"""zerotrain.deepspeed: a DeepSpeed-style script run through the compatibility layer,
against independent references: plain torch optimizers and schedulers on an untouched
copy of the model, fed the very batches each rank drew, with DeepSpeed's lr sequence
computed from tests/ds_reference.py (lr(0) at updates 1 and 2, lr(k−2) at update k).

One 2-rank launch covers stages 0–3 with the config optimizer + WarmupLR and two param
groups, every client torch.optim class, a client scheduler, training_data, zero.Init +
GatheredParameters(modifier_rank=0), and save → fresh engine → load → continue.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from torch import nn

import zerotrain.deepspeed as deepspeed
from ds_reference import ds_warmup_cosine_lr, ds_warmup_lr

from multirank import run_ranks

STEPS = 5
LO, HI, WARM = 1e-4, 5e-3, 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def dataset(n: int = 48) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g),
                                          torch.randint(0, 3, (n,), generator=g))


def ds_config(stage: int, optimizer: bool = True, scheduler: str | None = "WarmupLR") -> dict:
    cfg: dict = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0}
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}
    if scheduler == "WarmupLR":
        cfg["scheduler"] = {"type": scheduler, "params": {
            "warmup_min_lr": LO, "warmup_max_lr": HI, "warmup_num_steps": WARM}}
    elif scheduler == "WarmupCosineLR":
        cfg["scheduler"] = {"type": scheduler, "params": {
            "warmup_min_ratio": 0.1, "warmup_num_steps": WARM, "total_num_steps": 10}}
    return cfg


def groups_of(net: nn.Module) -> list[dict]:
    """The usual split: no weight decay on biases and norm gains."""
    return [{"params": [p for p in net.parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in net.parameters() if p.ndim < 2], "weight_decay": 0.0}]


def client(kind: str, net: nn.Module) -> torch.optim.Optimizer:
    g = groups_of(net)
    g[1]["lr"] = 3e-3  # a group with its own lr
    if kind == "Adam":
        return torch.optim.Adam(g, lr=2e-3, betas=(0.8, 0.95), eps=1e-7)
    if kind == "AdamW":
        return torch.optim.AdamW(g, lr=2e-3, betas=(0.9, 0.95))
    if kind == "SGD":
        return torch.optim.SGD(g, lr=2e-2, momentum=0.9, nesterov=True)
    if kind == "Adagrad":
        return torch.optim.Adagrad(g, lr=2e-2, lr_decay=0.01, initial_accumulator_value=0.1)
    return torch.optim.RMSprop(g, lr=2e-3, alpha=0.9, momentum=0.5, centered=True)


def train(engine, opt, batches) -> tuple[list[float], list[list[float]]]:
    """The getting-started loop; the lr each update applies is read before it."""
    losses, lrs = [], []
    for x, y in batches:
        lrs.append([g["lr"] for g in opt.param_groups])
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, lrs


def first(loader, n: int) -> list:
    out = []
    while len(out) < n:
        out += list(loader)
    return out[:n]


def _ranks(tmp: str) -> dict:
    """Every case on this rank; returns what the main process checks."""
    out: dict = {}
    args = argparse.Namespace(deepspeed_config=None)
    for stage in range(4):  # config AdamW + WarmupLR, two groups, training_data
        torch.manual_seed(0)
        net = Net()
        eng, opt, loader, _sched = deepspeed.initialize(
            args=args, model=net, model_parameters=groups_of(net), training_data=dataset(),
            config=ds_config(stage))
        batches = first(loader, STEPS)
        out[f"config{stage}"] = (*train(eng, opt, batches), batches,
                                 [i for x, _ in batches for i in x[:, 0].tolist()])
    out["comm"] = (deepspeed.comm.get_rank(), deepspeed.comm.get_world_size())
    for stage, kind in enumerate(("Adam", "SGD", "Adagrad", "RMSprop")):
        torch.manual_seed(0)
        net = Net()
        o = client(kind, net)
        eng, opt, loader, _ = deepspeed.initialize(model=net, optimizer=o,
                                                   training_data=dataset(),
                                                   config=ds_config(stage, optimizer=False,
                                                                    scheduler=None))
        batches = first(loader, STEPS)
        out[f"client{kind}{stage}"] = (*train(eng, opt, batches), batches)
    # Muon with the no-decay grouping at ZeRO-2 (owner scheme) vs the native engine's Muon
    # with decay_1d off: the same groups, built from the model's plan instead
    torch.manual_seed(0)
    net = Net()
    muon = {**ds_config(2, scheduler=None), "optimizer": {"type": "Muon", "params": {
        "lr": 2e-2, "weight_decay": 0.1}}}
    eng, opt, loader, _ = deepspeed.initialize(model=net, model_parameters=groups_of(net),
                                               training_data=dataset(), config=muon)
    batches = first(loader, STEPS)
    got = train(eng, opt, batches)[0]
    cfg = eng.config.model_copy(update={"optimizer": eng.config.optimizer.model_copy(
        update={"decay_1d": False})})
    torch.manual_seed(0)
    from zerotrain.engine import Engine
    native = Engine(Net(), cfg)
    out["muon2"] = (got, train(native, native.optimizer, batches)[0],
                    sorted({g["group_id"] for g in eng.optimizer.param_groups}))
    # client AdamW + a client scheduler, saved mid-run and resumed in a fresh engine
    for stage, sched_kind in ((1, "client"), (3, "config")):
        torch.manual_seed(0)
        net = Net()
        if sched_kind == "client":
            o = client("AdamW", net)
            kw = {"optimizer": o, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(
                o, lambda s: 1.0 / (1 + 0.5 * s))}
            cfg = ds_config(stage, optimizer=False, scheduler=None)
        else:
            kw, cfg = {"model_parameters": groups_of(net)}, ds_config(stage)
        eng, opt, loader, _ = deepspeed.initialize(model=net, training_data=dataset(),
                                                   config=cfg, **kw)
        batches = first(loader, 2 * STEPS)
        a = train(eng, opt, batches[:STEPS])
        eng.save_checkpoint(f"{tmp}/{sched_kind}", client_state={"epoch": 3})
        b = train(eng, opt, batches[STEPS:])
        torch.manual_seed(5)  # other initial weights: all must come from the checkpoint
        net2 = Net()
        if sched_kind == "client":
            o2 = client("AdamW", net2)
            kw = {"optimizer": o2, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(
                o2, lambda s: 1.0 / (1 + 0.5 * s))}
        else:
            kw = {"model_parameters": groups_of(net2)}
        eng2, opt2, _, _ = deepspeed.initialize(model=net2, config=cfg, **kw)
        path, client_state = eng2.load_checkpoint(f"{tmp}/{sched_kind}")
        c = train(eng2, opt2, batches[STEPS:])
        out[f"resume_{sched_kind}{stage}"] = (a, b, c, client_state, path.name,
                                              eng2.global_steps, batches)
    # zero.Init: built on the meta device; rank 0's weights spread by GatheredParameters,
    # before initialize (DeepSpeed's way to load weights) or after it
    torch.manual_seed(0)
    reference = Net().state_dict()

    def load(net: nn.Module, rank: int) -> None:
        with deepspeed.zero.GatheredParameters(list(net.parameters()), modifier_rank=0), \
                torch.no_grad():
            for name, p in net.named_parameters():
                p.copy_(reference[name] if rank == 0 else torch.full_like(p, 7.0))

    for stage, when in ((3, "after"), (3, "before"), (1, "before")):
        with deepspeed.zero.Init():
            net = Net()
        built_on_meta = all(p.device.type == "meta" for p in net.parameters())
        if when == "before":
            load(net, torch.distributed.get_rank())
            still_meta = all(p.device.type == "meta" for p in net.parameters())
        eng, opt, loader, _ = deepspeed.initialize(
            model=net, model_parameters=groups_of(net), training_data=dataset(),
            config=ds_config(stage))
        if when == "after":
            load(net, eng.global_rank)
            still_meta = True
        with deepspeed.zero.GatheredParameters(list(net.parameters())):
            held = {n: p.detach().clone() for n, p in net.named_parameters()}
        out[f"init_{when}{stage}"] = (built_on_meta and still_meta, held, reference,
                                      *train(eng, opt, first(loader, STEPS)))
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_ranks, 2, str(tmp_path_factory.mktemp("ds")))


def ds_lr_sequence(n: int) -> list[float]:
    """DeepSpeed's engine: WarmupLR sets lr(0) when built, steps after each update."""
    return [ds_warmup_lr(max(k - 1, 0), LO, HI, WARM, "log") for k in range(n)]


def reference_run(per_rank: list, make_opt, lrs=None, sched=None, clip: float = 1.0):
    """Plain torch on one process: the mean of the two ranks' losses, clipped, stepped."""
    torch.manual_seed(0)
    net = Net()
    opt = make_opt(net)
    s = sched(opt) if sched else None
    losses: list[list[float]] = [[], []]
    for k in range(len(per_rank[0])):
        if lrs is not None:
            for g in opt.param_groups:
                g["lr"] = lrs[k]
        total = 0.0
        for r in range(2):
            x, y = per_rank[r][k]
            loss = nn.functional.cross_entropy(net(x), y)
            losses[r].append(loss.item())
            total = total + loss / 2
        total.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if s is not None:
            s.step()
    return losses


def close(a: list[float], b: list[float], tol: float = 2e-5) -> bool:
    return all(math.isclose(x, y, rel_tol=tol, abs_tol=1e-6) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("stage", range(4))
def test_config_optimizer_warmup_two_groups_matches_deepspeed_sequence(ranks, stage):
    want_lrs = ds_lr_sequence(STEPS)
    for r in range(2):
        _losses, lrs, _, _ = ranks[r][f"config{stage}"]
        assert [g[0] for g in lrs] == pytest.approx(want_lrs, rel=1e-12)
        assert all(g[0] == g[1] for g in lrs)
    ref = reference_run([ranks[r][f"config{stage}"][2] for r in range(2)],
                        lambda n: torch.optim.AdamW(groups_of(n), lr=1e-3), lrs=want_lrs)
    for r in range(2):
        assert close(ranks[r][f"config{stage}"][0], ref[r]), (stage, r)


def test_training_data_is_split_disjointly_in_micro_batches(ranks):
    assert [ranks[r]["comm"] for r in range(2)] == [(0, 2), (1, 2)]  # deepspeed.comm
    seen = [ranks[r]["config0"][3] for r in range(2)]
    assert all(len(x) == 4 * STEPS for x in seen)  # micro batch 4 from the config
    drawn = [set(x) for x in seen]  # STEPS batches are within the first epoch (6 per rank)
    assert not drawn[0] & drawn[1] and len(drawn[0]) == len(drawn[1]) == 4 * STEPS
    assert drawn[0] | drawn[1] <= set(dataset().tensors[0][:, 0].tolist())


@pytest.mark.parametrize("kind", ["Adam", "SGD", "Adagrad", "RMSprop"])
def test_client_optimizers_keep_groups_and_hyperparameters(ranks, kind):
    stage = ("Adam", "SGD", "Adagrad", "RMSprop").index(kind)
    res = [ranks[r][f"client{kind}{stage}"] for r in range(2)]
    ref = reference_run([x[2] for x in res], lambda n: client(kind, n))
    for r in range(2):
        assert close(res[r][0], ref[r]), (kind, res[r][0], ref[r])


def test_muon_with_param_groups_at_zero2(ranks):
    # group 0: the matrices (orthogonalised); 2: user group 1 (biases, norms) on AdamW;
    # group 1 (user group 0's non-matrices) is empty here
    assert set(ranks[0]["muon2"][2]) | set(ranks[1]["muon2"][2]) == {0, 2}
    for r in range(2):
        got, native, _ = ranks[r]["muon2"]
        assert close(got, native, tol=1e-6)


@pytest.mark.parametrize("case", ["client1", "config3"])
def test_resume_in_a_fresh_engine_continues_bit_identically(ranks, case):
    for r in range(2):
        a, b, c, client_state, tag, steps, _batches = ranks[r][f"resume_{case}"]
        assert c == b  # losses and applied lrs, exactly
        assert client_state == {"epoch": 3} and tag == f"global_step{STEPS}" and steps == 2 * STEPS
    if case == "client1":  # and the whole run equals torch's AdamW + LambdaLR
        ref = reference_run([ranks[r][f"resume_{case}"][6] for r in range(2)],
                            lambda n: client("AdamW", n),
                            sched=lambda o: torch.optim.lr_scheduler.LambdaLR(
                                o, lambda s: 1.0 / (1 + 0.5 * s)))
        for r in range(2):
            a, b = ranks[r][f"resume_{case}"][:2]
            assert close(a[0] + b[0], ref[r])


@pytest.mark.parametrize("case", ["after3", "before3", "before1"])
def test_zero_init_and_gathered_parameters_modifier_rank(ranks, case):
    for r in range(2):
        meta, held, reference, _losses, _ = ranks[r][f"init_{case}"]
        assert meta
        for name, t in reference.items():
            assert torch.equal(held[name], t), name  # rank 0's values, on every rank
    # the same run as the config case at that stage, from the same weights
    stage = case[-1]
    assert close(ranks[0][f"init_{case}"][3], ranks[0][f"config{stage}"][0], tol=1e-6)


# ----------------------------------------------------------------------------- one rank
def _single(cfg: dict, **kw):
    """One process; `model_parameters` given are rebuilt over the engine's model."""
    torch.manual_seed(0)
    net = Net()
    if "model_parameters" in kw:
        kw["model_parameters"] = groups_of(net)
    return deepspeed.initialize(model=net, config=cfg, **kw), net


def test_warmup_cosine_applies_zero_first_as_deepspeed():
    """WarmupCosineLR's get_lr() is 0 before it starts: update 1 runs at 0, update k at
    the value at k−2."""
    cfg = ds_config(2, scheduler="WarmupCosineLR")
    (eng, opt, _, _), _net = _single(cfg, model_parameters=groups_of(Net()))
    g = torch.Generator().manual_seed(0)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        eng.backward(eng(torch.randn(4, 8, generator=g)).square().mean())
        eng.step()
    want = [0.0] + [ds_warmup_cosine_lr(k, 1e-3, WARM, 10, 0.1, 1e-4, "log") for k in range(5)]
    assert lrs == pytest.approx(want, rel=1e-12)


def test_config_sources_follow_deepspeed():
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed and args.deepspeed_config == "ds.json"
    with pytest.raises(ValueError, match="given deepspeed configs in the deepspeed arguments"):
        deepspeed.initialize(args=args, model=Net(), config=ds_config(0))
    with pytest.raises(ValueError, match="requires --deepspeed_config"):
        deepspeed.initialize(model=Net())
    eng = deepspeed.initialize(model=Net(), config_params=ds_config(1))[0]
    assert eng.zero_optimization_stage() == 1


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match=r"torch\.optim\.Adamax"):
        net = Net()
        deepspeed.initialize(model=net, optimizer=torch.optim.Adamax(net.parameters()),
                             config=ds_config(0, optimizer=False))
    with pytest.raises(ValueError, match="amsgrad"):
        net = Net()
        deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(),
                                                                    amsgrad=True),
                             config=ds_config(0, optimizer=False))
    net = Net()
    used = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 8)).sum().backward()
    used.step()
    with pytest.raises(ValueError, match="has already stepped"):
        deepspeed.initialize(model=net, optimizer=used, config=ds_config(0, optimizer=False))
    with pytest.raises(ValueError, match="mpu"):
        deepspeed.initialize(model=Net(), mpu=object(), config=ds_config(0))
    # no optimizer at all: DeepSpeed's ZeRO inference engine (forward only), as DeepSpeed
    net = Net()
    engine, opt, _, sched = deepspeed.initialize(model=net, config=ds_config(0, optimizer=False))
    x = torch.randn(2, 8)
    assert opt is None and sched is None and engine.module is net
    assert torch.equal(engine(x), net(x))
    with pytest.raises(RuntimeError, match="built without an optimizer"):
        engine.step()
    net = Net()
    with pytest.raises(ValueError, match="in no optimizer group"):
        deepspeed.initialize(model=net, model_parameters=[net.head.weight], config=ds_config(0))


def test_client_optimizer_wins_over_the_config_block_and_engine_surface(capsys):
    net = Net()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    eng, opt, loader, sched = deepspeed.initialize(model=net, optimizer=sgd,
                                                   config=ds_config(0, scheduler=None))
    assert "optimizer` block is not used" in capsys.readouterr().out
    assert type(eng.optimizer).__name__ == "SGD" and loader is None and sched is None
    assert opt.param_groups[0] is sgd.param_groups[0]  # the client's own group dicts
    x = torch.randn(2, 8)
    assert torch.equal(eng(x), net(x))  # the module's outputs
    assert (eng.local_rank, eng.fp16_enabled(), eng.bfloat16_enabled()) == (0, False, False)
    assert eng.is_gradient_accumulation_boundary()
    with pytest.raises(RuntimeError, match=r"engine\.step"):
        opt.step()
    from zerotrain.deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    assert acc.is_available() and acc.device_name(0) in ("cpu", "cuda:0")
    assert acc.communication_backend_name() in ("gloo", "nccl")
    assert (deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()) == (0, 1)


def test_checkpoint_flags(tmp_path):
    (eng, _opt, _, _sched), _net = _single(ds_config(0), model_parameters=groups_of(Net()))
    x = torch.randn(4, 8)
    for _ in range(3):
        eng.backward(eng(x).square().mean())
        eng.step()
    eng.save_checkpoint(tmp_path, tag="a")
    eng.save_checkpoint(tmp_path, tag="b", save_latest=False)
    assert (tmp_path / "latest").read_text().strip() == "a"
    (tmp_path / "none").mkdir()
    assert _single(ds_config(0))[0][0].load_checkpoint(tmp_path / "none") == (None, None)
    (fresh, _, _, fsched), _ = _single(ds_config(0), model_parameters=groups_of(Net()))
    fresh.load_checkpoint(tmp_path, load_lr_scheduler_states=False)
    assert fresh.global_steps == 3 and fsched.last_batch_iteration == -1
    (only, _, _, _), _ = _single(ds_config(0), model_parameters=groups_of(Net()))
    only.load_checkpoint(tmp_path, tag="b", load_module_only=True)
    assert only.global_steps == 0 and not only.optimizer.state
    for p, q in zip(only.module.parameters(), eng.module.parameters(), strict=True):
        assert torch.equal(p, q)


def test_launch_runs_a_script_and_names_the_failed_rank(tmp_path):
    """`zerotrain launch` (torchrun underneath): the ranks get torchrun's environment, the
    script its own arguments, and a failure is one line naming the rank."""
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    done = tmp_path / "rank0.done"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '0':\n"
                      "    print('rank 0 of', os.environ['WORLD_SIZE'], sys.argv[1:], flush=True)\n"
                      f"    open({str(done)!r}, 'w').close()\n"
                      "    time.sleep(60)\n"
                      f"while not os.path.exists({str(done)!r}):\n"
                      "    time.sleep(0.05)\n"
                      "sys.exit(3)\n")

    r = subprocess.run([sys.executable, "-m", "zerotrain", "launch", "--nproc", "2",
                        str(script), "--deepspeed_config", "ds.json", "--fail"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert "rank 0 of 2 ['--deepspeed_config', 'ds.json', '--fail']" in r.stdout  # its args
    assert r.returncode == 3
    assert "zerotrain: rank 1 of 2 failed (exit code 3)" in r.stderr


class _NotAllowed:
    """A type DeepSpeed never writes: unpickling it must be refused."""


def _ds_stage0_folder(root, net: nn.Module, opt: torch.optim.Optimizer, steps: int,
                      extra: dict) -> None:
    """A ZeRO-0 DeepSpeed checkpoint as DeepSpeed 0.19.8 lays it out (bench/ds_compat.py
    checks the reader against folders real DeepSpeed wrote, at stages 0-3)."""
    folder = root / f"global_step{steps}"
    folder.mkdir(parents=True)
    torch.save({"module": net.state_dict(), "optimizer": opt.state_dict(),
                "lr_scheduler": None, "global_steps": steps, "skipped_steps": 0,
                "buffer_names": [], "param_shapes": None, "ds_version": "0.19.8", **extra},
               folder / "mp_rank_00_model_states.pt")
    (root / "latest").write_text(folder.name)


def test_deepspeed_checkpoint_folder_resumes_and_unknown_types_are_refused(tmp_path):
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))

    def step(model, opt=None, engine=None) -> float:
        loss = nn.functional.cross_entropy((engine or model)(x), y)
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        return loss.item()

    torch.manual_seed(0)
    ref = Net()
    ref_opt = client("AdamW", ref)
    for _ in range(3):
        step(ref, ref_opt)
    _ds_stage0_folder(tmp_path / "ds", ref, ref_opt, 3, {"epoch": 7})
    torch.manual_seed(5)
    net = Net()
    eng, _, _, _ = deepspeed.initialize(model=net, optimizer=client("AdamW", net),
                                        config=ds_config(0, optimizer=False, scheduler=None))
    path, client_state = eng.load_checkpoint(tmp_path / "ds")
    assert path.name == "global_step3" and client_state == {"epoch": 7}
    assert eng.global_steps == 3
    got = [step(net, engine=eng) for _ in range(3)]
    want = [step(ref, ref_opt) for _ in range(3)]
    assert close(got, want, tol=1e-6)

    _ds_stage0_folder(tmp_path / "bad", ref, ref_opt, 3, {"payload": _NotAllowed()})
    with pytest.raises(ValueError, match=r"weights_only=True.*_NotAllowed is not on the "
                                         r"allow-list"):
        eng.load_checkpoint(tmp_path / "bad")


def test_convert_a_deepspeed_checkpoint_on_the_command_line(tmp_path, capsys):
    """`zerotrain convert --from-deepspeed`: no model code needed; the result resumes at
    another stage as torch's AdamW continues."""
    from zerotrain.cli import main

    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    torch.manual_seed(0)
    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)

    def ref_step() -> float:
        loss = nn.functional.cross_entropy(ref(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.item()

    for _ in range(3):
        ref_step()
    ds = {"train_micro_batch_size_per_gpu": 4, "train_batch_size": 8,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}
    _ds_stage0_folder(tmp_path / "ds", ref, opt, 3, {"ds_config": ds, "epoch": 2})
    assert main(["convert", "--from-deepspeed", str(tmp_path / "ds"),
                 "--out", str(tmp_path / "zt")]) == 0
    assert "wrote" in capsys.readouterr().out
    torch.manual_seed(5)
    net = Net()
    eng, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                        config={**ds, "train_batch_size": 4,
                                                "zero_optimization": {"stage": 1}})
    _, client_state = eng.load_checkpoint(tmp_path / "zt")
    assert client_state == {"epoch": 2} and eng.global_steps == 3
    got = []
    for _ in range(3):
        loss = nn.functional.cross_entropy(eng(x), y)
        eng.backward(loss)
        eng.step()
        got.append(loss.item())
    assert close(got, [ref_step() for _ in range(3)], tol=1e-6)
    assert main(["convert", "--from-deepspeed", str(tmp_path / "nothing"),
                 "--out", str(tmp_path / "o")]) == 2
    assert "holds no DeepSpeed checkpoint" in capsys.readouterr().err


def test_zero_infinity_config_saves_streamed_and_resumes(tmp_path, monkeypatch):
    """A DeepSpeed ZeRO-Infinity config (parameters and optimizer on NVMe) trains through
    the compat engine; its checkpoint is written without bringing the tier's states into
    memory (the disk home's `resident` never runs) and a fresh engine resumes it exactly."""
    from zerotrain.zero.states.disk import NvmeOffload

    def no_resident(self):
        raise AssertionError("a save or load made the tier's states resident")

    nvme = str(tmp_path / "nvme")
    cfg = ds_config(3, scheduler=None)
    cfg["zero_optimization"].update(
        offload_param={"device": "nvme", "nvme_path": nvme},
        offload_optimizer={"device": "nvme", "nvme_path": nvme},
        stage3_param_persistence_threshold=0)  # every unit in the tier, none kept gathered
    g = torch.Generator().manual_seed(0)
    xs = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g))
          for _ in range(6)]

    def train(eng, batches):
        out = []
        for x, y in batches:
            loss = nn.functional.cross_entropy(eng(x), y)
            eng.backward(loss)
            eng.step()
            out.append(loss.item())
        return out

    (eng, _, _, _), _net = _single(cfg)
    train(eng, xs[:3])
    monkeypatch.setattr(NvmeOffload, "resident", no_resident)
    eng.save_checkpoint(str(tmp_path / "ckpt"))
    after = train(eng, xs[3:])
    (eng2, _, _, _), _net2 = _single(cfg)
    eng2.load_checkpoint(str(tmp_path / "ckpt"))
    assert train(eng2, xs[3:]) == after
