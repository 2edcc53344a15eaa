"""The fourth new-user audit's findings (../shared/findings/new-user-audit-3.md), one test
each, on genuine DeepSpeed 0.19.8 checkpoints (tests/data/ds_ckpt, see its README): a
checkpoint of another model refused as DeepSpeed refuses it, every user error one line,
tensors in client_state kept, and no silent change of what a run trains on."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import zerotrain.deepspeed as deepspeed
from cli_run import one_error, run
from zerotrain.checkpoint.io import CheckpointError

DS = Path(__file__).resolve().parent / "data" / "ds_ckpt"


class Mlp(torch.nn.Module):
    """The audit's ds_case.py model: 16 -> hidden -> 4 with a LayerNorm."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, hidden)
        self.ln = torch.nn.LayerNorm(hidden)
        self.fc2 = torch.nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.ln(torch.relu(self.fc1(x))))


def mlp_engine(hidden: int = 32):
    torch.manual_seed(0)
    net = Mlp(hidden)
    groups = [
        {"params": [q for q in net.parameters() if q.ndim >= 2], "weight_decay": 0.1},
        {"params": [q for q in net.parameters() if q.ndim < 2], "weight_decay": 0.0},
    ]
    engine, _, _, _ = deepspeed.initialize(
        model=net, model_parameters=groups, config=str(DS / "ds_stage2.json")
    )
    return engine


def copy(name: str, tmp_path: Path) -> Path:
    out = tmp_path / name
    shutil.copytree(DS / name, out)
    return out




# ------------------------------------------------------------------ BROKEN 1
def test_deepspeed_checkpoint_of_another_model_is_refused_as_deepspeed_does():
    engine = mlp_engine(32)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    with pytest.raises(
        CheckpointError,
        match=r"size mismatch .*fc1\.weight: checkpoint "
        r"\[64, 16\], this model \[32, 16\]",
    ):
        engine.load_checkpoint(DS / "ds_ckpt_other")
    for n, p in engine.module.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    # the same model's checkpoint still loads: its saved weights, exactly
    path, client_state = engine.load_checkpoint(DS / "ds_ckpt_stage2")
    saved = torch.load(path / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert client_state == {"mystep": 6}
    for n, p in engine.module.named_parameters():
        assert torch.allclose(p.detach(), saved[n].float(), atol=1e-6), n


def test_convert_refuses_a_rank_file_of_another_model_or_an_extra_rank(tmp_path, capsys):
    mixed = copy("ds_ckpt_stage2", tmp_path)
    shutil.copy(
        DS / "ds_ckpt_other/global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        mixed / "global_step6",
    )
    code, _, err = run(
        capsys, "convert", "--from-deepspeed", str(mixed), "--out", str(tmp_path / "a")
    )
    assert code == 2 and "mixes files of different runs" in one_error(err, "convert")
    assert not (tmp_path / "a").exists()
    extra = tmp_path / "extra"
    shutil.copytree(DS / "ds_ckpt_stage2", extra)
    step = extra / "global_step6"
    shutil.copy(
        step / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        step / "zero_pp_rank_2_mp_rank_00_optim_states.pt",
    )
    code, _, err = run(
        capsys, "convert", "--from-deepspeed", str(extra), "--out", str(tmp_path / "b")
    )
    line = one_error(err, "convert")
    assert code == 2 and "saved by 2 data-parallel ranks" in line
    assert "extra: zero_pp_rank_2_mp_rank_00_optim_states.pt" in line
    (step / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    (step / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    code, _, err = run(
        capsys, "convert", "--from-deepspeed", str(extra), "--out", str(tmp_path / "c")
    )
    assert code == 2 and "missing: rank(s) 1" in one_error(err, "convert")
    # a stage-3 folder with a rank file of a ZeRO-2 run
    mixed3 = copy("ds_ckpt_stage3", tmp_path)
    shutil.copy(
        DS / "ds_ckpt_other/global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        mixed3 / "global_step6",
    )
    code, _, err = run(
        capsys, "convert", "--from-deepspeed", str(mixed3), "--out", str(tmp_path / "d")
    )
    assert code == 2 and "come from different runs" in one_error(err, "convert")


# ------------------------------------------------------------------ BROKEN 2 / 3, MISLEADING 8
TIERED = [
    "--model.n_layer",
    "1",
    "--model.n_embd",
    "32",
    "--model.n_head",
    "2",
    "--model.block_size",
    "16",
    "--data.micro_batch_size",
    "2",
    "--train.steps",
    "1",
    "--schedule.warmup_steps",
    "0",
    "--logging.progress",
    "false",
    "--logging.sample_tokens",
    "0",
    "--logging.plot",
    "false",
    "--zero.stage",
    "3",
    "--zero.offload_param",
    "nvme",
    "--zero.offload_optimizer",
    "nvme",
]


@pytest.fixture
def no_launch(monkeypatch):
    """The launcher must refuse before starting any rank."""
    import zerotrain.comm.launch as launch

    def started(*_a, **_k):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(launch, "launch_local", started)


def test_bad_nvme_paths_are_one_line_before_ranks_start(tmp_path, capsys, no_launch):
    (tmp_path / "afile").write_text("a file")
    for path, why in (
        (tmp_path / "afile", "it is a file, not a directory"),
        (tmp_path / "afile" / "sub", "Not a directory"),
        (Path("/proc/zt_nvme"), "No such file or directory"),
    ):
        code, _, err = run(
            capsys,
            "train",
            *TIERED,
            "--nproc",
            "2",
            "--zero.nvme_path",
            str(path),
            "--logging.run_dir",
            str(tmp_path / "run"),
        )
        line = one_error(err, "train")
        assert (
            code == 2
            and f"zero.nvme_path {path}: cannot create the run's offload files there ({why})"
            in line
        ), line


def test_too_small_disk_is_one_line_before_ranks_start(tmp_path, capsys, no_launch, monkeypatch):
    import zerotrain.run.tier_check as tier_check
    from zerotrain.config import build_config

    monkeypatch.setattr(tier_check, "free_bytes", lambda _p: 4096)
    code, _, err = run(
        capsys,
        "train",
        *TIERED,
        "--nproc",
        "2",
        "--zero.nvme_path",
        str(tmp_path / "swap"),
        "--logging.run_dir",
        str(tmp_path / "run"),
    )
    line = one_error(err, "train")
    cfg = build_config(
        {
            "model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 16},
            "zero": {
                "stage": 3,
                "offload_param": "nvme",
                "offload_optimizer": "nvme",
                "nvme_path": "x",
            },
        }
    )
    need = 2 * tier_check.disk_bytes_per_rank(cfg, 2, "cpu")
    assert need > 4096
    assert code == 2 and f"need about {need} bytes" in line and "only 4096 bytes" in line


def test_tier_error_inside_the_run_is_one_line(tmp_path, capsys):
    """One process: the engine's own check (a TierError) is a user error, not a traceback."""
    (tmp_path / "afile").write_text("a file")
    code, _, err = run(
        capsys,
        "train",
        *TIERED,
        "--zero.nvme_path",
        str(tmp_path / "afile" / "sub"),
        "--logging.run_dir",
        str(tmp_path / "run"),
    )
    assert code == 2 and "cannot create the run's offload files" in one_error(err, "train")


def test_muon_with_the_optimizer_on_nvme_is_a_config_error(tmp_path):
    from zerotrain.config import ConfigError, build_config
    from zerotrain.deepspeed_config import map_deepspeed

    with pytest.raises(
        ConfigError,
        match=r"optimizer\.name muon with zero\.offload_optimizer "
        r"nvme",
    ):
        build_config(
            {
                "optimizer": {"name": "muon"},
                "zero": {"stage": 3, "offload_optimizer": "nvme", "nvme_path": str(tmp_path)},
            }
        )
    mapped = map_deepspeed(
        {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "Muon", "params": {"lr": 0.02}},
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
            },
        }
    )
    with pytest.raises(ConfigError, match=r"muon with zero\.offload_optimizer nvme"):
        build_config(mapped.config)


@pytest.mark.parametrize(
    ("zero", "name"),
    [
        ({"nvme_path": "/x"}, "zero.nvme_path (/x)"),
        ({"nvme_threads": 8}, "zero.nvme_threads (8)"),
        ({"stage": 3, "offload_param": "cpu", "nvme_block_mb": 2.0}, "zero.nvme_block_mb"),
        ({"offload_prefetch": 3}, "zero.offload_prefetch (3)"),
    ],
)
def test_tier_settings_without_their_tier_are_refused_as_idle(zero, name):
    from zerotrain.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=re.escape(name)):
        build_config({"zero": zero})
    # with their tier they are taken
    build_config({"zero": {**zero, "stage": 3, "offload_param": "nvme", "nvme_path": "/x"}})


# ------------------------------------------------------------------ BROKEN 4
def test_tensors_in_client_state_round_trip(tmp_path):
    """DeepSpeed pickles client_state; zerotrain keeps the same values and types
    without a pickle."""
    import numpy as np

    engine = mlp_engine(32)
    gen = torch.Generator().manual_seed(3)
    state = {
        "mystep": 2,
        "t": torch.ones(3),
        "ema": torch.randn(4, 5, generator=gen),
        "half": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "rng": gen.get_state(),
        "np_rng": np.random.default_rng(1).random(4),
        "py": (1, (2, 3), None),
        7: "int key",
        "inf": float("inf"),
    }
    engine.save_checkpoint(tmp_path, client_state=state)
    _, back = mlp_engine(32).load_checkpoint(tmp_path)
    assert set(back) == set(state)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
        elif isinstance(v, np.ndarray):
            assert np.array_equal(back[k], v), k
        else:
            assert back[k] == v, k
    with pytest.raises(CheckpointError, match=r"client_state\['o'\] is a builtins.object"):
        engine.save_checkpoint(tmp_path / "b", client_state={"o": object()})


def test_convert_keeps_a_tensor_in_deepspeeds_client_state(tmp_path, capsys):
    code, _, err = run(
        capsys,
        "convert",
        "--from-deepspeed",
        str(DS / "ds_ckpt_client_tensor"),
        "--out",
        str(tmp_path / "zt"),
    )
    assert code == 0, err
    _, client_state = mlp_engine(32).load_checkpoint(tmp_path / "zt")
    assert client_state["mystep"] == 2 and torch.equal(client_state["t"], torch.ones(3))


# ------------------------------------------------------------------ BROKEN 5, MISLEADING 3 / 9
def test_convert_user_errors_are_one_line(tmp_path, capsys):
    src = str(DS / "ds_ckpt_stage2")
    (tmp_path / "afile").write_text("x")
    cases = [
        (["--from-deepspeed", src, "--out", str(tmp_path / "afile")], "is a file: give a "),
        (["--from-deepspeed", src, "--out", "/proc/zt_out"], "cannot write there"),
        (
            ["--from-deepspeed", src, "--tag", "nope", "--out", str(tmp_path / "n")],
            "has no DeepSpeed checkpoint tagged 'nope'; its tags: global_step6",
        ),
    ]
    binary = copy("ds_ckpt_stage2", tmp_path)
    (binary / "latest").write_bytes(b"\x00\xff\xfe")
    cases.append(
        (
            ["--from-deepspeed", str(binary), "--out", str(tmp_path / "o1")],
            "latest' is damaged (it names no folder: b'\\x00\\xff\\xfe'); its tags: global_step6",
        )
    )
    tensor = tmp_path / "tensor"
    shutil.copytree(DS / "ds_ckpt_stage2", tensor)
    torch.save(torch.ones(3), tensor / "global_step6" / "mp_rank_00_model_states.pt")
    cases.append(
        (
            ["--from-deepspeed", str(tensor), "--out", str(tmp_path / "o2")],
            "is not a DeepSpeed model-states file",
        )
    )
    for argv, want in cases:
        code, _, err = run(capsys, "convert", *argv)
        assert code == 2 and want in one_error(err, "convert"), (argv, err)
    assert not (tmp_path / "n").exists() and not (tmp_path / "o2").exists()


def test_a_deepspeed_folder_given_to_export_or_resume_names_convert(tmp_path, capsys):
    src = DS / "ds_ckpt_stage2"
    hint = (
        f"is a DeepSpeed checkpoint ('global_step6' holds DeepSpeed's "
        f"mp_rank_00_model_states.pt), not a zerotrain one: convert it first with "
        f"zerotrain convert --from-deepspeed {src} --out CKPT"
    )
    code, _, err = run(capsys, "export", str(src), "--out", str(tmp_path / "w.safetensors"))
    assert code == 2 and hint in one_error(err, "export")
    from zerotrain.checkpoint.io import resolve

    with pytest.raises(CheckpointError, match=re.escape(hint)):
        resolve(src)


# ------------------------------------------------------------------ MISLEADING 6
def test_resume_at_another_data_parallel_degree_says_the_global_batch_changes():
    from zerotrain.config import build_config
    from zerotrain.run.setup import global_batch_change

    sp2 = {
        "world_size": 2,
        "config": {
            "data": {"micro_batch_size": 2, "grad_accum_steps": 1},
            "sequence": {"parallel": 2},
        },
    }
    cfg = build_config({"data": {"micro_batch_size": 2}})
    (line,) = global_batch_change(sp2, cfg, dp=2)  # SP 2 -> 1 on the same 2 ranks
    assert (
        "the global batch changes from 2 sequences per step (micro-batch 2 × "
        "accumulation 1 × 1 data-parallel rank(s)) to 4 (2 × 1 × 2)" in line
    )
    assert line.endswith("to keep 2, resume with --data.micro_batch_size 1")
    assert global_batch_change(sp2, cfg, dp=1) == []  # SP 2 -> 1 on one rank: DP 1 both
    two = {"world_size": 2, "config": {"data": {"micro_batch_size": 2, "grad_accum_steps": 1}}}
    (line,) = global_batch_change(two, cfg, dp=1)  # 2 ranks -> 1 halves it
    assert "from 4 sequences" in line and "to 2 (2 × 1 × 1)" in line
    assert "--data.grad_accum_steps 2 or --data.micro_batch_size 4" in line
    kept = build_config({"data": {"micro_batch_size": 4}})
    (line,) = global_batch_change(two, kept, dp=1)
    assert line.startswith("[zerotrain] the global batch is kept: 4 sequences per step")
    assert global_batch_change(two, cfg, dp=2) == []


# ------------------------------------------------------------------ MISLEADING 2
def test_estimate_max_seq_fits_its_own_predicted_peak(tmp_path, capsys):
    import json

    from zerotrain.cli.estimate_peaks import peak_at
    from zerotrain.config import load_config

    path = tmp_path / "run.yaml"
    path.write_text(
        "model: {arch: llama, n_layer: 2, n_head: 2, n_embd: 64, "
        "vocab_size: 4096, block_size: 262144, activation_checkpointing: true}\n"
        "sequence: {tile_tokens: 512}\ndata: {micro_batch_size: 1}\n"
        "zero: {stage: 3}\n"
    )
    base = ["estimate", "--model", str(path), "--stage", "3", "--device", "cpu", "--json"]

    def longest(limit: str, gpus: str = "2") -> dict:
        code, out, err = run(capsys, *base, "--gpus", gpus, "--max-seq", "--gpu-mem", limit)
        assert code == 0, err
        return json.loads(out)["rows"][0]

    peak = peak_at(load_config(str(path)), 2, 3, device="cpu", micro_batch=1)
    n = longest("1GiB")["max_seq"]
    assert n > 0 and peak(n) <= 2**30 < peak(n + 1)
    code, out, err = run(capsys, *base, "--gpus", "2", "--seq", str(n), "--gpu-mem", "1GiB")
    assert code == 0, err
    row = json.loads(out)["rows"][0]
    assert row["fits"] and max(row["peaks"]["init"], row["peaks"]["steady"]) <= 2**30
    assert longest("1MB")["max_seq"] == 0  # the CPU runtime alone is hundreds of MB
    # layouts zerotrain train refuses are refused here too
    path.write_text(path.read_text().replace("sequence: {", "sequence: {parallel: 2, "))
    for gpus in ("1", "3"):
        code, _, err = run(capsys, *base, "--gpus", gpus, "--max-seq", "--gpu-mem", "1GiB")
        assert code == 2 and "sequence.parallel (2) must divide the world size" in one_error(
            err, "estimate"
        )
    path.write_text(
        "model: {n_layer: 2, n_head: 2, n_embd: 64, block_size: 256}\n"
        "data: {document_mask: true, tokenizer: bytes}\n"
    )
    code, _, err = run(capsys, *base, "--gpus", "1")
    assert code == 2 and "byte tokenizer has none" in one_error(err, "estimate")


# ------------------------------------------------------------------ MISLEADING 1
def test_estimate_disk_bytes_on_a_cpu_are_the_engines(tmp_path, capsys):
    """The optimizer on NVMe on a CPU: the engine streams the gradient shards through the
    disk too; `estimate --device cpu` counts them (the engine's tier_bytes for this run,
    measured with `zerotrain train`: 714,240 B read and written per step; both tiers:
    1,285,632 read, 714,240 written)."""
    import json

    path = tmp_path / "t.yaml"
    path.write_text(
        "model: {n_layer: 2, n_head: 2, n_embd: 32, block_size: 64}\n"
        "data: {micro_batch_size: 2, grad_accum_steps: 2}\n"
    )
    for param, read, written in (("none", 714240, 714240), ("nvme", 1285632, 714240)):
        code, out, err = run(
            capsys,
            "estimate",
            "--model",
            str(path),
            "--gpus",
            "1",
            "--precision",
            "fp32",
            "--device",
            "cpu",
            "--offload-param",
            param,
            "--offload-optimizer",
            "nvme",
            "--json",
        )
        assert code == 0, err
        disk = json.loads(out)["rows"][0]["tier_traffic"]["disk"]
        assert disk == {"read": read, "written": written}, param


# ------------------------------------------------------------------ MISLEADING 7
def test_a_damaged_swap_file_is_named_not_blamed_on_the_lr(tmp_path, capsys, monkeypatch):
    """The optimizer's swap file overwritten mid-run (as a failing disk or another process
    would): the run stops with one line that names the file."""
    import zerotrain.run.loop as loop

    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    real = loop.train_step
    damaged = []

    def step_then_damage(run):
        out = real(run)
        if run.engine.global_step == 2:
            for tier in run.engine.strategy.moving_tiers():
                size = tier.file.stat().st_size
                tier.file.write_bytes(b"\xff" * size)  # NaN in every float
                damaged.append(str(tier.file))
        return out

    monkeypatch.setattr(loop, "train_step", step_then_damage)
    argv = [*TIERED[:-4], "--zero.offload_optimizer", "nvme", "--train.steps", "4"]
    code, _, err = run(
        capsys,
        "train",
        *argv,
        "--zero.nvme_path",
        str(tmp_path / "swap"),
        "--data.path",
        str(corpus),
        "--logging.eval_every",
        "0",
        "--logging.run_dir",
        str(tmp_path / "run"),
    )
    line = one_error(err, "train")
    assert (
        code == 2
        and damaged
        and "suspect the offload swap file rather than the learning rate" in line
        and damaged[0] in line
    ), line


# ------------------------------------------------------------------ MISLEADING 4
def test_a_converted_checkpoint_of_another_model_is_described_by_its_parameters(tmp_path, capsys):
    assert (
        run(
            capsys,
            "convert",
            "--from-deepspeed",
            str(DS / "ds_ckpt_stage2"),
            "--out",
            str(tmp_path / "conv"),
        )[0]
        == 0
    )
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 300)
    code, _, err = run(
        capsys,
        "train",
        "--model.n_layer",
        "2",
        "--model.n_embd",
        "32",
        "--model.n_head",
        "2",
        "--model.block_size",
        "16",
        "--data.path",
        str(corpus),
        "--resume",
        str(tmp_path / "conv"),
        "--logging.run_dir",
        str(tmp_path / "r"),
        "--train.steps",
        "2",
        "--schedule.warmup_steps",
        "0",
    )
    line = one_error(err, "train")
    assert code == 2 and "not built from a model: section" in line
    assert "fc1.weight [32, 16]" in line and "model.n_layer" not in line, line


# ------------------------------------------------------------------ MISLEADING 8
def test_gathered_parameters_with_a_rank_outside_the_job_is_refused():
    engine = mlp_engine(32)
    params = list(engine.module.parameters())
    with (
        pytest.raises(ValueError, match=r"modifier_rank=5\): the job has 1 rank\(s\), 0 to 0"),
        deepspeed.zero.GatheredParameters(params, modifier_rank=5),
    ):
        pass
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
        pass


# ------------------------------------------------------------------ MISLEADING 5 / 9
def test_a_rank_whose_peer_died_ends_without_a_traceback():
    import subprocess
    import sys

    code = (
        "from zerotrain.comm.launch import quiet_when_peer_gone; quiet_when_peer_gone(); "
        "raise RuntimeError('[pair.cc:553] Connection closed by peer [127.0.0.1]:2')"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RANK": "0", "WORLD_SIZE": "2"},
    )
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip() == (
        "-c: rank 0 of 2 stopped: another rank closed its connection "
        "(that rank's own error is the cause)"
    )
    other = subprocess.run(
        [sys.executable, "-c", code.replace("Connection closed by peer", "a bug")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" in other.stderr  # the script's own errors print as always


def test_sigterm_to_the_launcher_says_nothing_was_saved():
    import signal
    import subprocess
    import sys

    code = (
        "from zerotrain.comm.launch import launch_local; import sys; "
        "sys.exit(launch_local(2, [], module='stuck_rank'))"
    )
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": f"{tests}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGTERM)
        p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
    err = p.stderr.read()
    assert p.returncode == 130 and "Traceback" not in err, err
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith("zerotrain: stopped by SIGTERM; this stop saved no checkpoint")
    ), err


def test_launch_hints_name_the_problem(tmp_path, capsys):
    code, _, err = run(capsys, "launch", "--nproc", "2")
    assert code == 2 and "give the training script to run" in one_error(err, "launch")
    code, _, err = run(capsys, "launch", str(tmp_path))
    assert code == 2 and f"script '{tmp_path}' is a directory" in one_error(err, "launch")


def test_a_bad_deepspeed_config_file_is_named_and_a_malicious_pickle_names_its_global(tmp_path):
    from zerotrain.config import ConfigError
    from zerotrain.deepspeed.checkpoint import read

    bad = tmp_path / "ds.json"
    bad.write_text(
        '{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 7},'
        ' "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}'
    )
    net = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=re.escape(f"DeepSpeed config '{bad}': 1 setting")):
        deepspeed.initialize(model=net, model_parameters=net.parameters(), config=str(bad))

    ran = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {ran}",)

    torch.save({"module": {}, "x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(
        CheckpointError,
        match=r"posix\.system is not on the allow-list \(its "
        r"module is blocked\); nothing in it ran",
    ):
        read(tmp_path / "evil.pt")
    (tmp_path / "noise.pt").write_bytes(bytes(range(256)) * 8)
    with pytest.raises(CheckpointError, match="the file is damaged or not a DeepSpeed"):
        read(tmp_path / "noise.pt")
    assert not ran.exists()


# ------------------------------------------------------------------ MISLEADING 10
def test_the_step_phase_prediction_shows_its_own_peak_beside_the_high_water_mark():
    """On a CPU the step phase was printed as backward's high-water mark only (733 MiB)
    while the step measured 99 MiB (memory returned by host_mmap_mb): the line shows the
    step's own peak too."""
    from zerotrain.config import build_config
    from zerotrain.memory import phase_estimates
    from zerotrain.models import build_model, plan_for
    from zerotrain.run.report import phase_text
    from zerotrain.zero import run_shape, strategy_class

    cfg = build_config(
        {
            "model": {"n_layer": 2, "n_embd": 256, "n_head": 4, "block_size": 64},
            "zero": {"stage": 3},
        }
    )
    model = build_model(cfg.model, device="meta")
    shape = run_shape(strategy_class(cfg.zero), cfg, model, plan_for(model), "cpu", 2)
    acts = 600 * 2**20
    high, own = (
        phase_estimates(shape, acts),
        phase_estimates(dataclasses.replace(shape, high_water=False), acts),
    )
    assert high["step"] == high["backward"] and own["step"] < own["backward"] - acts
    mib = 2**20
    ph = {
        "measured": {"backward": 700 * mib, "step": 99 * mib},
        "predicted": {k: high[k] for k in ("backward", "step")},
        "predicted_low": {k: own[k] for k in ("backward", "step")},
    }
    line = phase_text(ph, True, cpu=True)
    assert f"step 99.0 / {own['step'] / mib:.1f}–{high['step'] / mib:.1f}" in line, line
    assert "the phase's own peak if freed memory returns to the OS" in line
