"""Runs you can trust (issue 12): one run per folder, values that train wrongly refused,
one resume rule, non-finite training stopped, damaged checkpoints named, data checks,
library defaults. Every test here fails on the code before these fixes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import zerotrain
from zerotrain.checkpoint import CheckpointError, resolve
from zerotrain.config import ConfigError, build_config, load_config
from zerotrain.data.errors import DataError
from zerotrain.engine import Engine
from zerotrain.models.gpt import GPT
from zerotrain.numerics.guard import SpikeGuard
from zerotrain.run.loop import train
from zerotrain.run.setup import Diverged

from zero_harness import batches, corpus, make_config, run_config


def _cfg(tmp_path, run: str = "run", steps: int = 6, **extra):
    return run_config(tmp_path, run, steps, layers=1, **extra)


def _steps(cfg) -> list[str]:
    root = Path(cfg.logging.run_dir) / "checkpoints"
    return sorted(p.name for p in root.glob("step_*"))


# ----------------------------------------------------------------------------- 1 run folders


def test_second_run_in_a_folder_is_refused_not_destroyed(tmp_path):
    first = _cfg(tmp_path, steps=6)
    train(first)
    before = _steps(first)
    with pytest.raises(ConfigError, match=r"holds another run.*--resume.*--logging.run_dir.*"
                       r"--logging.overwrite"):
        train(_cfg(tmp_path, steps=3))
    assert _steps(first) == before  # nothing lost
    # an explicit overwrite starts afresh; pruning keeps this run's newest, latest resolves
    over = _cfg(tmp_path, steps=3, logging={"overwrite": True})
    train(over)
    assert _steps(over) == ["step_00000002", "step_00000003"]
    assert resolve(tmp_path / "run" / "checkpoints").name == "step_00000003"


def test_prune_by_recency_within_the_run(tmp_path):
    cfg = _cfg(tmp_path, steps=6)
    train(cfg)
    assert _steps(cfg) == ["step_00000004", "step_00000006"]
    # resuming to a longer run keeps the newest of this run, whatever the step numbers
    longer = _cfg(tmp_path, steps=9)
    train(longer, resume="latest")
    assert _steps(longer) == ["step_00000008", "step_00000009"]
    assert resolve(tmp_path / "run" / "checkpoints").name == "step_00000009"


def test_resume_auto(tmp_path, capsys):
    cfg = _cfg(tmp_path, steps=4)
    s = train(cfg, resume="auto")  # nothing to resume: starts afresh
    assert s["steps_run"] == 4 and "resumed" not in capsys.readouterr().out
    more = _cfg(tmp_path, steps=6)
    s = train(more, resume="auto")
    out = capsys.readouterr().out
    assert s["steps_run"] == 2 and "resumed from" in out and "at step 4" in out


def test_run_dir_problems_are_one_error_before_building(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        train(_cfg(tmp_path, logging={"run_dir": str(f)}))
    with pytest.raises(ConfigError, match="not writable"):
        train(_cfg(tmp_path, logging={"run_dir": "/proc/zt"}))


# ----------------------------------------------------------------------------- 2 values


@pytest.mark.parametrize("override, message", [
    ({"optimizer": {"grad_clip": -1.0}}, "grad_clip must be > 0"),
    ({"optimizer": {"lr": math.inf}}, "finite"),
    ({"zero": {"stage": True}}, "zero.stage is a number"),
    ({"train": {"steps": True}}, "train.steps is a number"),
    ({"optimizer": {"momentum": 0.9}}, "momentum .* does nothing with optimizer.name adamw"),
    ({"zero": {"param_persistence_threshold": 100}}, "applies to zero.stage 3 only"),
    ({"optimizer": {"betas": "0.9, 0.95"}}, r"written \[0.9,0.95\]"),
    ({"schedule": {"decay_steps": 5000}, "train": {"steps": 1000}}, "ends the decay at step"),
    ({"data": {"path": ""}}, "data.path is empty"),
])
def test_values_that_train_wrongly_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        build_config(override)


def test_duplicate_yaml_keys_are_refused(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optimizer:\n  lr: 1e-3\n  lr: 2e-3\n")
    with pytest.raises(ConfigError, match="'lr' appears twice"):
        load_config(f)


# ----------------------------------------------------------------------------- 3/4 resume


def test_shape_free_changes_resume_and_settings_changes_are_named(tmp_path, capsys):
    train(_cfg(tmp_path, steps=4))
    changed = _cfg(tmp_path, steps=6, model={"dropout": 0.1, "activation_checkpointing": True},
                   optimizer={"weight_decay": 0.5, "betas": [0.5, 0.6]})
    train(changed, resume="latest")
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 4" in out
    assert "optimizer.weight_decay: checkpoint 0.1 → config 0.5" in out
    assert "optimizer.betas" in out and "train.steps: checkpoint 4 → config 6" in out


def _engine(cfg, seed=0):
    torch.manual_seed(seed)
    return Engine(GPT(cfg.model), cfg, torch.device("cpu"))


@pytest.mark.parametrize("stage", [0, 2])
def test_one_rule_for_hyperparameters_whatever_the_layout(tmp_path, stage):
    """The config's settings win on resume, same layout or resharded (audit M1)."""
    src = _engine(make_config({"zero": {"stage": stage}}, 1, 10))
    X, Y = next(iter(batches(1)))
    src.backward(src(X, Y))
    src.step()
    src.save_checkpoint(tmp_path / "ck")
    new = make_config({"optimizer": {"weight_decay": 0.5, "betas": [0.5, 0.6], "eps": 1e-3}},
                      1, 10)
    eng = _engine(new, seed=1)
    eng.load_checkpoint(tmp_path / "ck")
    for g in eng.optimizer.param_groups:
        assert tuple(g["betas"]) == (0.5, 0.6) and g["eps"] == 1e-3
        assert g["weight_decay"] in (0.5, 0.0)


def test_another_optimizer_needs_an_explicit_reset(tmp_path, capsys):
    train(_cfg(tmp_path, steps=4))
    with pytest.raises(CheckpointError, match=r"optimizer 'adamw'.*uses 'sgd'.*reset"):
        train(_cfg(tmp_path, steps=6, optimizer={"name": "sgd"}), resume="latest")
    reset = _cfg(tmp_path, steps=6, optimizer={"name": "sgd"},
                 checkpoint={"reset_optimizer": True})
    train(reset, resume="latest")
    assert "optimizer state reset (adamw -> sgd)" in capsys.readouterr().out


# ----------------------------------------------------------------------------- 5 non-finite


def test_divergence_stops_and_never_saves_nonfinite_weights(tmp_path):
    cfg = _cfg(tmp_path, steps=40, optimizer={"lr": 1e6}, schedule={"min_lr": 0.0},
               train={"max_skipped_steps": 3}, checkpoint={"every": 0})
    with pytest.raises(Diverged, match="in a row had non-finite gradients"):
        train(cfg)
    assert _steps(cfg) == []  # nothing non-finite was written


def test_a_nonfinite_checkpoint_is_refused(tmp_path):
    from zerotrain.run.setup import setup

    run = setup(_cfg(tmp_path, steps=4), None)
    with torch.no_grad():
        run.engine.strategy.units[0].master[0] = float("nan")
    with pytest.raises(Diverged, match=r"not finite .* not saving"):
        run.save()
    run.report.close()


def test_spike_guard_rule():
    g = SpikeGuard(build_config({"train": {"spike_guard": {"enabled": True, "window": 10}}})
                   .train.spike_guard)
    for i in range(10):
        assert g.check(3.0 + 0.01 * (i % 3), 1.0 + 0.01 * (i % 2)) is None
    assert "loss" in g.check(30.0, 1.0)
    assert "grad_norm" in g.check(3.0, 50.0)
    assert g.check(3.01, 1.0) is None and g.skipped == 2  # outliers did not enter the window


def test_spike_guard_skips_the_update():
    cfg = make_config({"train": {"spike_guard": {"enabled": True, "window": 10, "zscore": 10}},
                       "optimizer": {"grad_clip": None}}, 1, 30)
    eng = _engine(cfg)
    it = iter(batches(30))
    for _ in range(12):
        X, Y = next(it)
        eng.backward(eng(X, Y))
        assert not eng.step().skipped
    before = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    X, Y = next(it)
    eng.backward(eng(X, Y) * 1e4)  # a poisoned batch: loss and gradient blow up together
    info = eng.step()
    assert info.skipped and info.spike
    assert all(torch.equal(p, before[n]) for n, p in eng.module.named_parameters())


# ----------------------------------------------------------------------------- 9 integrity


def test_damaged_shard_is_named_with_the_older_checkpoint_that_loads(tmp_path):
    cfg = _cfg(tmp_path, steps=4)
    train(cfg)
    root = tmp_path / "run" / "checkpoints"
    shard = root / "step_00000004" / "rank00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank00000.safetensors' is damaged.*"
                       r"step_00000002 still loads: resume from it with --resume"):
        train(_cfg(tmp_path, steps=6), resume="latest")
    # the named fallback really loads
    s = train(_cfg(tmp_path, steps=6), resume=str(root / "step_00000002"))
    assert s["steps_run"] == 4
    modes = {f.name: f.stat().st_mode & 0o777 for f in (root / "step_00000006").iterdir()}
    assert len(set(modes.values())) == 1, modes  # shards and JSON: one permission


def test_damaged_meta_is_one_checkpoint_error(tmp_path):
    cfg = _cfg(tmp_path, steps=2)
    train(cfg)
    meta = tmp_path / "run" / "checkpoints" / "step_00000002" / "meta.json"
    d = json.loads(meta.read_text())
    del d["scaler"]
    meta.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="lacks scaler"):
        train(_cfg(tmp_path, steps=4), resume="latest")


# ----------------------------------------------------------------------------- 10 data


def test_too_little_data_names_the_split(tmp_path):
    p = tmp_path / "tiny.txt"
    p.write_text("x" * 200)
    cfg = _cfg(tmp_path, data={"path": str(p)})
    with pytest.raises(DataError, match=r"validation split .*data.val_fraction"):
        train(cfg)


# ----------------------------------------------------------------------------- 12 library


def test_library_mode_trains_at_a_constant_lr(capsys):
    torch.manual_seed(0)
    eng = zerotrain.initialize(GPT(make_config({}, 1, 10).model), {"train": {"device": "cpu"}})
    X, Y = next(iter(batches(1)))
    for _ in range(3):
        eng.backward(eng(X, Y))
        info = eng.step()
        assert info.lr == eng.config.optimizer.lr
    assert "lr:" not in capsys.readouterr().out  # nothing configured, nothing to print
    zerotrain.initialize(GPT(make_config({}, 1, 10).model),
                         {"train": {"device": "cpu", "steps": 50},
                          "schedule": {"kind": "cosine", "warmup_steps": 5}})
    assert "warmup" in capsys.readouterr().out


def test_folder_data_skips_dot_dirs_and_binaries_and_is_summarised(tmp_path, capsys):
    data = tmp_path / "data"
    (data / ".git").mkdir(parents=True)
    (data / ".git" / "HEAD").write_text("ref: refs/heads/main\n" * 50)
    (data / "lr.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 20)
    (data / "a.txt").write_text(Path(corpus(tmp_path)).read_text())
    train(_cfg(tmp_path, steps=2, data={"path": str(data)}))
    line = next(x for x in capsys.readouterr().out.splitlines() if "data:" in x)
    size = (data / "a.txt").stat().st_size
    assert "1 files (1 skipped)" in line and f"{size:,} bytes of text" in line, line
