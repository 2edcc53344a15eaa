"""The fourth new-user audit's findings (../shared/findings/new-user-audit-3.md), one test
each, on genuine DeepSpeed 0.19.8 checkpoints (tests/data/ds_ckpt, see its README): a
checkpoint of another model refused as DeepSpeed refuses it, every user error one line,
tensors in client_state kept, and no silent change of what a run trains on."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import zerotrain.deepspeed as deepspeed
from zerotrain.checkpoint.io import CheckpointError
from zerotrain.cli import main

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


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error(err: str, name: str) -> str:
    assert "Traceback" not in err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("[zerotrain]")]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"zerotrain {name}: error: "), err
    return lines[0]


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
