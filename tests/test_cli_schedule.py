"""`zerotrain schedule`: the key-point table, the plot, and one-line errors."""

from __future__ import annotations

import pytest

from zerotrain.cli.schedule import main_schedule
from zerotrain.config import TrainConfig
from zerotrain.optim.schedule import lr_at


def test_cli_prints_table_and_plots(capsys, tmp_path):
    png = tmp_path / "lr.png"
    rc = main_schedule(["--peak-lr", "3e-4", "--steps", "200", "--warmup", "20", "--hold", "10",
                        "--min-lr", "3e-5", "--kind", "linear", "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "end of warmup" in out and "3.0000e-04" in out and "3.0000e-05" in out
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(("argv", "needle"), [
    (["--warmup", "5000"], "--warmup + --hold"),
    (["--min-lr", "1"], "--min-lr"),
    (["--kind", "exp"], "--kind"),
    (["--steps", "ten"], "--steps"),
    (["--peak-lr", "inf"], "--peak-lr"),
    (["--min-lr", "nan"], "--min-lr"),
    (["--plot", "lr.txt"], ".png"),
    (["--plot", "lr"], ".svg"),
])
def test_cli_bad_input_is_one_message(argv, needle, capsys):
    assert main_schedule(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and err.startswith("zerotrain schedule")


def test_printed_lrs_are_lr_at(capsys):
    """Every row of the table is lr_at at that step, printed to 5 significant digits."""
    assert main_schedule(["--steps", "300", "--warmup", "30", "--kind", "wsd", "--hold", "0",
                          "--peak-lr", "1e-3", "--min-lr", "1e-4", "--warmup-start-lr", "0",
                          "--wsd-fraction", "0.2"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()[2:]]
    assert len(rows) >= 4
    for *_, step, lr in rows:
        want = lr_at(int(step), peak_lr=1e-3, total_steps=300, kind="wsd", warmup_steps=30,
                     min_lr=1e-4)
        assert float(lr) == pytest.approx(want, rel=1e-4)


def test_help_shows_defaults(capsys):
    assert main_schedule(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--peak-lr", "--warmup", "--hold", "--min-lr", "--kind"):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(flag))
        assert line  # every option has a one-line description
    steps = TrainConfig.model_fields["steps"].default
    flat = " ".join(out.split())  # argparse wraps lines
    assert f"(default: {steps})" in flat and "(default: cosine)" in flat
