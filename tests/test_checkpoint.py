"""Checkpoints: exact resume, atomic saves, resharding across stages/world sizes, export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from zerotrain.checkpoint import CheckpointError, consolidate, export, resolve
from zerotrain.engine import Engine
from zerotrain.models.gpt import GPT
from zerotrain.run.loop import train

from multirank import run_ranks
from zero_harness import batches, local_batch, make_config, run_config, train_losses


def _train_cfg(tmp_path, run: str, steps: int, **extra):
    return run_config(tmp_path, run, steps, warmup=3, every=4, keep=5, **extra)


def test_resume_is_bit_exact(tmp_path):
    full = _train_cfg(tmp_path, "full", 10)
    train(full)
    part = _train_cfg(tmp_path, "part", 10)
    # the interrupted run: same config, stopped after its step-4 checkpoint
    train(part.model_copy(update={"train": part.train.model_copy(update={"steps": 4})}))
    train(part, resume="latest")
    a, b = train_losses(tmp_path / "full"), train_losses(tmp_path / "part")
    assert sorted(a) == sorted(b) == list(range(1, 11))
    for step in range(5, 11):
        assert a[step] == b[step], f"step {step}: {a[step]!r} != {b[step]!r}"


def _resume_ranks(tmp, stage):
    full = _train_cfg(tmp, f"full{stage}", 8, zero={"stage": stage})
    train(full)
    part = _train_cfg(tmp, f"part{stage}", 8, zero={"stage": stage})
    train(part.model_copy(update={"train": part.train.model_copy(update={"steps": 4})}))
    train(part, resume="latest")
    return train_losses(tmp / f"full{stage}"), train_losses(tmp / f"part{stage}")


def test_resume_is_bit_exact_sharded(tmp_path):
    """The application's resume (data position, schedule, RNG) at 2 ranks, stage 3. Stage
    2 and the other stages and world sizes: the Engine's save/load in
    test_checkpoint_matrix.py, bit for bit (docs/testing.md)."""
    a, b = run_ranks(_resume_ranks, 2, tmp_path, 3)[0]
    assert all(a[s] == b[s] for s in range(5, 9)), (a, b)


_KILLER = textwrap.dedent("""
    import os, sys
    import safetensors.torch as st
    from zerotrain.checkpoint import stream
    from zerotrain.config import load_config
    from zerotrain.run.loop import train
    real = stream.write
    calls = []
    def dying_save(path, tensors, *a, **k):
        calls.append(path)
        if len(calls) == 2:          # the second checkpoint: die half-way through writing it
            with open(path, "wb") as f:
                f.write(b"partial")
            os._exit(9)
        return real(path, tensors, *a, **k)
    stream.write = dying_save
    train(load_config(sys.argv[1]))
""")


def test_killed_save_leaves_previous_checkpoint(tmp_path):
    cfg = _train_cfg(tmp_path, "killed", 12)
    f = tmp_path / "cfg.json"
    f.write_text(json.dumps(cfg.to_dict()))
    r = subprocess.run(
        [sys.executable, "-c", _KILLER, str(f)],
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 9, r.stderr.decode()[-2000:]
    root = tmp_path / "killed" / "checkpoints"
    assert (root / "step_00000008.tmp").exists()  # the interrupted save
    ckpt = resolve(root)
    assert ckpt.name == "step_00000004"
    eng = Engine(GPT(cfg.model), cfg)
    path, _ = eng.load_checkpoint(root)
    assert path.name == "step_00000004" and eng.global_step == 4


def _train_engine(cfg, steps):
    torch.manual_seed(0)
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    from zerotrain.comm.dist import world

    rank, _ = world()
    b = cfg.data.micro_batch_size
    for X, Y in batches(steps):
        eng.backward(eng(*local_batch(X, Y, rank, 2, b)))
        eng.step()
    return eng


def _save_one(path, stage, dtype):
    """One process: train 5 steps and save (the matrix covers 2 and 3 ranks)."""
    cfg = make_config({"zero": {"stage": stage}, "precision": {"dtype": dtype}}, 1, 10)
    torch.manual_seed(0)
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    for X, Y in batches(5):
        eng.backward(eng(X, Y))
        eng.step()
    eng.save_checkpoint(path)


def _continue(eng, steps):
    b = eng.config.data.micro_batch_size
    for i, (X, Y) in enumerate(batches(5 + steps)):
        if i >= 5:
            eng.backward(eng(X[:b], Y[:b]))
            eng.step()
    return {n: p.detach().clone() for n, p in eng.module.named_parameters()}


def test_per_parameter_optimizer_cut_resumes_into_flat_cut(tmp_path, monkeypatch):
    """Stage-0 checkpoints written when the optimizer got one tensor per parameter (the
    cut Muon still uses) resume into today's flat per-group cut with identical results;
    and how the update runs (`compiled`) follows the running config, not the file."""
    import zerotrain.engine as engine_mod

    cfg = make_config({}, 1, 10)
    flat = _train_engine(cfg, 5)
    n_params = len(list(flat.module.parameters()))
    assert len(flat.strategy.rank_layout()["segments"]) < n_params
    flat.save_checkpoint(tmp_path / "flat")
    with monkeypatch.context() as m:
        m.setattr(engine_mod, "is_elementwise", lambda name: False)  # the old cut
        old = _train_engine(cfg, 5)
    assert len(old.strategy.rank_layout()["segments"]) == n_params
    for g in old.optimizer.param_groups:
        g["compiled"] = True  # as if saved by a run that compiled
    old.save_checkpoint(tmp_path / "old")
    want = _continue(flat, 3)
    for ck in ("old", "flat"):
        torch.manual_seed(99)
        eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
        eng.load_checkpoint(tmp_path / ck)
        assert all(g["compiled"] is False for g in eng.optimizer.param_groups)
        got = _continue(eng, 3)
        assert all(torch.equal(got[k], want[k]) for k in want), ck


def test_export_roundtrip(tmp_path):
    """A bf16 ZeRO-3 checkpoint exports its fp32 masters, loadable strictly by the plain
    model. (Exports of every stage at 1-3 ranks: test_checkpoint_matrix.py.)"""
    ck = tmp_path / "ck"
    _save_one(ck, 3, "bf16")
    out = export(ck, tmp_path / "model.safetensors")
    cfg = make_config({}, 1, 10)
    fresh = GPT(cfg.model)
    fresh.load_state_dict(load_file(str(out)))  # strict: tied names included, no zerotrain
    X, Y = next(iter(batches(1)))
    weights, meta = consolidate(ck)
    assert json.loads(json.dumps(meta["config"]["model"])) == cfg.model.model_dump(mode="json")
    assert weights["wte.weight"].dtype == torch.float32  # bf16 run: the fp32 master
    with torch.no_grad():
        want = fresh(X, Y).item()
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    eng.load_checkpoint(ck)
    with torch.no_grad():
        got = eng(X, Y).item()
    assert got == want


def test_bad_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        resolve(tmp_path / "empty")
    ck = tmp_path / "ck"
    cfg = make_config({}, 1, 10)
    _train_engine(cfg, 1).save_checkpoint(ck)
    other = make_config({"model": {"n_layer": 3}}, 1, 10)
    with pytest.raises(CheckpointError, match=r"no tensor 'blocks.2.ln1.weight'"):
        Engine(GPT(other.model), other).load_checkpoint(ck)
    meta_file = resolve(ck) / "meta.json"
    good = meta_file.read_text()
    for fmt, says in (
        (
            1,
            r"format 1, which this zerotrain no longer reads; export its "
            r"weights .* --model\.init_from weights\.safetensors",
        ),
        (3, "format 3, this zerotrain reads format 2"),
    ):
        meta_file.write_text(json.dumps(dict(json.loads(good), format=fmt)))
        with pytest.raises(CheckpointError, match=says):
            Engine(GPT(cfg.model), cfg).load_checkpoint(ck)
    meta_file.write_text(
        json.dumps({k: v for k, v in json.loads(good).items() if k != "checksums"})
    )
    with pytest.raises(CheckpointError, match="is damaged: it lacks checksums"):
        Engine(GPT(cfg.model), cfg).load_checkpoint(ck)
    meta_file.write_text(good)
    (resolve(ck) / "rank00000.safetensors").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        Engine(GPT(cfg.model), cfg).load_checkpoint(ck)


_LLAMA = [
    "--model.arch",
    "llama",
    "--model.n_layer",
    "2",
    "--model.n_embd",
    "32",
    "--model.n_head",
    "2",
    "--model.block_size",
    "32",
    "--data.micro_batch_size",
    "4",
    "--schedule.warmup_steps",
    "0",
    "--checkpoint.every",
    "2",
    "--logging.eval_every",
    "0",
    "--logging.sample_tokens",
    "0",
    "--logging.progress",
    "false",
    "--logging.log_every",
    "1",
    "--train.threads",
    "1",
]


def _ckpt_bytes(path) -> int:
    return sum(f.stat().st_size for f in resolve(path).iterdir())


@pytest.mark.slow
def test_cli_two_rank_stage0_checkpoint_exports_and_resumes_at_one(tmp_path, capsys):
    """The new user's path: `train --nproc 2` at the default stage 0 (DDP), then `export`
    (plain and --format hf) and `--resume` at 1 rank (resharded). Each rank wrote its
    slice of the replicated state, so the checkpoint is the 1-rank one's size up to
    metadata. (Resuming it at 3 ranks: the matrix's z0-w2 -> world 3 pairs.)"""
    import math

    from zerotrain.cli import main
    from zerotrain.models.hf_export import hf_name

    from zero_harness import corpus

    args = [*_LLAMA, "--data.path", corpus(tmp_path)]

    def launch(run: str, nproc: int, steps: int, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "zerotrain",
                "train",
                *args,
                "--nproc",
                str(nproc),
                "--train.steps",
                str(steps),
                "--logging.run_dir",
                str(tmp_path / run),
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )

    r = launch("two", 2, 2)
    assert r.returncode == 0, r.stderr[-3000:]
    ck = resolve(tmp_path / "two")
    # the master weights as the rank files hold them, read without zerotrain's reader:
    # rank 0's slice of each unit, then rank 1's
    units = json.loads((ck / "meta.json").read_text())["layout"]["units"]
    files = [load_file(str(ck / f"rank{r:05d}.safetensors")) for r in (0, 1)]
    want = {}
    for i, unit in enumerate(units):
        flat = torch.cat([f[f"strategy.master.{i}"] for f in files])
        assert flat.numel() == unit["padded_numel"]  # on disk once, not once per rank
        for name, shape, off, _g in unit["params"]:
            want[name] = flat[off : off + math.prod(shape)].view(shape)
    assert main(["export", str(tmp_path / "two"), "--out", str(tmp_path / "m.safetensors")]) == 0
    got = load_file(str(tmp_path / "m.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
    assert (
        main(["export", str(tmp_path / "two"), "--format", "hf", "--out", str(tmp_path / "hf")])
        == 0
    )
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(torch.equal(got[hf_name("llama", k)[0]], v) for k, v in want.items())
    # resumed at one rank, in this process (at 3 ranks: test_checkpoint_matrix.py's
    # z0-w2 -> world 3 pairs, the state bit for bit)
    capsys.readouterr()
    assert (
        main(
            [
                "train",
                *args,
                "--train.steps",
                "4",
                "--logging.run_dir",
                str(tmp_path / "one"),
                "--resume",
                str(tmp_path / "two"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 2 (resharded)" in out
    losses = train_losses(tmp_path / "one")
    assert sorted(losses) == [3, 4] and all(math.isfinite(v) for v in losses.values())
    # sizes: the extra rank adds its RNG state (5 KiB), its JSON and a safetensors header
    one, two = (_ckpt_bytes(tmp_path / run) for run in ("one", "two"))
    assert 0 < two - one < 10_000, (one, two)


def test_prune_and_resolve_decode_latest_the_same_way(tmp_path):
    """One decoder of `latest`: prune keeps the folder it names, and a damaged `latest`
    is None to prune (it keeps going) and one error to resolve."""
    from zerotrain.checkpoint.io import latest_name, prune

    def steps():
        return sorted(p.name for p in tmp_path.glob("step_*"))

    for i, saved_at in ((1, 10.0), (2, 20.0), (3, 30.0)):
        (tmp_path / f"step_{i}").mkdir()
        (tmp_path / f"step_{i}" / "meta.json").write_text(json.dumps({"saved_at": saved_at}))
    (tmp_path / "latest").write_text("step_1\n")
    assert latest_name(tmp_path) == "step_1"
    prune(tmp_path, keep=1)
    assert steps() == ["step_1", "step_3"]
    for raw in (b"\xff\xfe", b"../step_3", b"", b"a\0b"):
        (tmp_path / "latest").write_bytes(raw)
        assert latest_name(tmp_path) is None
        with pytest.raises(CheckpointError, match=r"latest' is damaged .* resume one with"):
            resolve(tmp_path)
    prune(tmp_path, keep=1)
    assert steps() == ["step_3"]
    (tmp_path / "latest").unlink()
    assert latest_name(tmp_path) is None
