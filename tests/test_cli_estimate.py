"""`zerotrain estimate`: the table, JSON, plot and inverse question against the formulas of
`memory.py` (tested on their own in test_memory_model.py) and the ZeRO paper's numbers."""

from __future__ import annotations

import json

import pytest

from zerotrain.cli.estimate import main_estimate
from zerotrain.config import ConfigError, ModelConfig, build_config
from zerotrain.memory import activation_bytes, estimate
from zerotrain.models.gpt import GPT

PAPER = ["--params", "7.5e9", "--gpus", "64", "--gpu-mem", "80GB"]


def test_cli_table(capsys):
    assert main_estimate(PAPER) == 0
    out = capsys.readouterr().out
    rows = {ln.split("|")[0].strip(): ln for ln in out.splitlines() if "|" in ln}
    assert "120.00" in rows["DDP"] and rows["DDP"].endswith("DOES NOT FIT")
    for label, total in [("ZeRO-1", "31.41"), ("ZeRO-2", "16.64"), ("ZeRO-3", "1.88"),
                         ("ZeRO-2+offload", "15.00"), ("ZeRO-3+offload", "0.23")]:
        assert total in rows[label] and rows[label].endswith(" FITS"), label
    assert "in GB (10^9 bytes)" in out


def test_cli_json_and_inverse(capsys):
    assert main_estimate([*PAPER, "--json", "--max-params"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in rep["rows"]][:4] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    assert rep["rows"][0]["device_total"] == 120 * 10**9
    assert rep["rows"][0]["traffic"]["sent_bytes"] == 2 * 63 * (7_500_000_000 // 64) * 2
    # closed forms: DDP 16Ψ ≤ 80e9 → 5e9; ZeRO-3 16·ceil(Ψ/64) ≤ 80e9 → 320e9
    assert rep["rows"][0]["max_params"] == 5 * 10**9
    assert rep["rows"][3]["max_params"] == 320 * 10**9
    for r in rep["rows"]:
        kw = dict(offload=r["offload"])
        mp = r["max_params"]
        assert estimate(mp, 64, r["stage"], **kw).device_total <= 80e9
        assert estimate(mp + 1, 64, r["stage"], **kw).device_total > 80e9


def test_cli_gib_and_model_config(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: {n_layer: 2, n_embd: 64, n_head: 4, block_size: 32}\n"
                   "precision: {dtype: fp32}\n")
    assert main_estimate(["--model", str(cfg), "--gpus", "2", "--gpu-mem", "1GiB",
                          "--micro-batch", "3", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    c = ModelConfig(n_layer=2, n_embd=64, n_head=4, block_size=32)
    assert rep["unit"] == "GiB" and rep["gpu_mem"] == 2**30 and rep["precision"] == "fp32"
    model = GPT(c)
    assert rep["psi"] == sum(p.numel() for p in model.parameters())
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    root = rep["psi"] - sum(blocks)  # embeddings, final norm: the ZeRO-3 root unit
    assert rep["rows"][0]["activations"] == activation_bytes(c, 3, 32, act_bytes=4)
    assert rep["rows"][3]["gathered"] == max(root, *blocks) * 4


def test_cli_plot(tmp_path, capsys):
    png = tmp_path / "mem.png"
    assert main_estimate([*PAPER, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv", [
    ["--params", "7.5e9", "--gpus", "0"],
    ["--params", "lots", "--gpus", "8"],
    ["--params", "7.5e9", "--gpus", "8", "--gpu-mem", "80XB"],
    ["--gpus", "8"],
    ["--params", "7.5e9", "--gpus", "8", "--max-params"],
    ["--params", "7.5e9", "--gpus", "8", "--optimizer", "adamq"],
    ["--params", "7.5e9", "--gpus", "8", "--bogus"],
    ["--model", "/nonexistent.yaml", "--gpus", "8"],
    ["--params", "7.5e9", "--gpus", "8", "--stage", "1", "--offload"],
    ["--params", "1e400", "--gpus", "8"],
    ["--params", "7.5e9", "--gpus", "8", "--gpu-mem", "1e400GB"],
    ["--params", "7.5e9", "--gpus", "8", "--host-mem", "1e400"],
    ["--params", "7.5e9", "--gpus", "8", "--bandwidth", "inf"],
    ["--params", "7.5e9", "--gpus", "8", "--plot", "mem.txt"],
])
def test_cli_bad_input(argv, capsys):
    assert main_estimate(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("zerotrain estimate: error:") and "\n" not in err


def test_host_memory_bounds_the_offload_rows(capsys):
    """M11: without --host-mem the offload rows say what host memory their Ψ needs; with it,
    their largest Ψ keeps the host part within the limit (and one more parameter does not)."""
    assert main_estimate([*PAPER, "--max-params"]) == 0
    out = capsys.readouterr().out
    # ZeRO-3+offload at 2.56e12 params: 14 host bytes per param over 64 ranks = 560 GB
    (line,) = [ln for ln in out.splitlines() if ln.split()[:2] == ["ZeRO-3+offload",
                                                                    "2,560,000,000,000"]]
    assert "needing 560.00 GB of host memory per rank" in line
    assert main_estimate([*PAPER, "--max-params", "--host-mem", "100GB", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["host_mem"] == 100 * 10**9
    for r in rep["rows"]:
        mp, kw = r["max_params"], dict(offload=r["offload"])
        ok = estimate(mp, 64, r["stage"], **kw)
        over = estimate(mp + 1, 64, r["stage"], **kw)
        assert ok.device_total <= 80e9 and ok.host_total <= 100e9
        assert over.device_total > 80e9 or over.host_total > 100e9
    assert rep["rows"][-1]["max_params"] < 2_560_000_000_000  # the host bound bites


def test_host_limit_flags_rows(capsys):
    assert main_estimate([*PAPER, "--host-mem", "1GB"]) == 0
    rows = {ln.split("|")[0].strip(): ln for ln in capsys.readouterr().out.splitlines()
            if "|" in ln}
    assert rows["ZeRO-2+offload"].endswith("DOES NOT FIT (host)")  # 1.64 GB of host state
    assert rows["ZeRO-2"].endswith(" FITS")


def test_tables_choose_their_unit(capsys):
    """A 1M-parameter model is shown in MB (not as 0.00 GB); 7.5B stays in GB."""
    assert main_estimate(["--params", "1e6", "--gpus", "4"]) == 0
    out = capsys.readouterr().out
    rows = {ln.split("|")[0].strip(): ln for ln in out.splitlines() if "|" in ln}
    assert "in MB (10^6 bytes)" in out
    assert rows["DDP"].split("|")[1].split()[-1] == "16.00"  # 16 bytes/param × 1e6
    assert main_estimate(["--params", "1e6", "--gpus", "4", "--gpu-mem", "1GiB"]) == 0
    assert "in MiB (2^20 bytes); device limit 1 GiB" in capsys.readouterr().out


def test_plot_says_where(tmp_path, capsys):
    png = tmp_path / "mem.svg"
    assert main_estimate([*PAPER, "--plot", str(png)]) == 0
    assert f"plot written to {png}" in capsys.readouterr().out
    assert png.read_text().lstrip().startswith("<?xml")


def _trains(optimizer: str, stage: int, offload: bool = False) -> bool:
    try:
        build_config({"optimizer": {"name": optimizer}, "zero": {
            "stage": stage, "offload_optimizer": "cpu" if offload else "none"}})
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_muon_stages_follow_training(stage, capsys):
    """An explicit stage is shown only if `zerotrain train` accepts Muon there; without
    --stage, exactly the rows training accepts are shown and the others are named."""
    argv = ["--params", "1e9", "--gpus", "8", "--optimizer", "muon"]
    assert main_estimate([*argv, "--stage", str(stage)]) == (0 if _trains("muon", stage) else 2)
    err = capsys.readouterr().err
    assert ("zerotrain train refuses" in err) != _trains("muon", stage)
    assert main_estimate(argv) == 0
    out = capsys.readouterr().out
    shown = {ln.split("|")[0].strip() for ln in out.splitlines() if "|" in ln}
    left_out = "".join(ln.split("(")[0] for ln in out.splitlines()
                       if ln.startswith("not shown:"))
    for label, st, off in [("DDP", 0, False), ("ZeRO-1", 1, False), ("ZeRO-2", 2, False),
                           ("ZeRO-3", 3, False), ("ZeRO-2+offload", 2, True),
                           ("ZeRO-3+offload", 3, True)]:
        assert (label in shown) == _trains("muon", st, off), label
        assert (f" {label}," in left_out + ",") != _trains("muon", st, off), label
