"""Trackers: every record reaches every backend, read back with each tool's own reader
(TensorBoard's event accumulator, W&B's `wandb leet inspect` of the offline run log)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from zerotrain.config import ConfigError, build_config
from zerotrain.run.trackers import check_backends, flatten, make_trackers, numeric

ALL = ["jsonl", "csv", "tensorboard", "wandb"]


def records() -> list[dict]:
    """What the training loop emits: memory at start, val, train, a late new key, summary."""
    mem = {"type": "memory", "step": 0, "rank": 0, "world_size": 2, "strategy": "zero2",
           "model_states": {"device": {"params": 7_410_000, "grads": 3_705_000},
                            "host": {"optimizer": 0}},
           "peak_allocated_bytes": 123_456_789}
    out = [mem, {"type": "val", "step": 0, "val_loss": 5.5412}]
    for step in (5, 10, 15):
        out.append({"type": "train", "step": step, "loss": 5.0 / step, "lr": 3e-3 * step / 40,
                    "grad_norm": 1.0 + step / 100, "tokens_per_s": 13_812.5 + step,
                    "step_time_s": 0.3, "loss_scale": 65536.0, "skipped_total": step // 10,
                    "bytes_sent": 7_412_224 * step})
        if step == 10:
            out.append({"type": "val", "step": 10, "val_loss": 2.25})
    out.append({"type": "train", "step": 20, "loss": 0.2, "lr": 1e-3, "grad_norm": 0.5,
                "tokens_per_s": 14_000.0, "step_time_s": 0.29, "loss_scale": 32768.0,
                "skipped_total": 1, "bytes_sent": 148_244_480, "fp8_overflows": 3})
    out.append({"type": "summary", "step": 20, "steps_run": 20, "first_val_loss": 5.5412,
                "final_val_loss": 1.81, "skipped_steps": 1, "checkpoint": "runs/x/ckpt",
                "strategy": "zero2", "tokens_per_s": 13_900.0})
    return out


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")


def cfg_with(backends, run_dir):
    return build_config({"logging": {"backends": backends, "run_dir": str(run_dir),
                                     "wandb": {"project": "zt-test"}}})


def log_all(run_dir: Path, backends=ALL, resume_step=None, recs=None):
    t = make_trackers(cfg_with(backends, run_dir), run_dir, rank=0, resume_step=resume_step)
    for r in recs if recs is not None else records():
        t.log(r)
    t.close()
    return t


def expected_scalars(recs) -> dict[str, dict[int, float]]:
    """"<type>/<key>" -> {step: value} for every number in the records."""
    out: dict[str, dict[int, float]] = {}
    for r in recs:
        for k, v in numeric(r).items():
            out.setdefault(f"{r['type']}/{k}", {})[r["step"]] = v
    return out


def read_tensorboard(log_dir: Path) -> dict[str, dict[int, float]]:
    """Scalar summaries by tag and step, through the event reader TensorBoard's server
    itself uses (it also purges what a restarted writer orphaned)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["tensors"]:
        assert acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"  # shown as such
        out[tag] = {e.step: make_ndarray(e.tensor_proto).item() for e in acc.Tensors(tag)}
    return out


def read_wandb(run_dir: Path) -> tuple[dict[int, dict], dict]:
    """(history rows by step, final summary) of the offline run, via W&B's own reader."""
    (run,) = (run_dir / "wandb").glob("offline-run-*")
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run)],
                         capture_output=True, text=True, check=True).stdout
    history: dict[int, dict] = {}
    summary: dict = {}
    for line in out.splitlines():
        rec = json.loads(line)
        if rec["type"] == "history":
            history[int(rec["history"]["step"].get("num", 0))] = rec["history"]["item"]
        elif rec["type"] == "summary":
            summary.update(rec["summary"]["update"])
    return history, summary


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_flatten_and_numeric():
    rec = {"type": "memory", "step": 3, "a": {"b": {"c": 1}}, "l": [2, 3.5], "s": "zero2",
           "ok": True, "none": None}
    assert flatten(rec) == {"type": "memory", "step": 3, "a/b/c": 1, "l/0": 2, "l/1": 3.5,
                            "s": "zero2", "ok": True, "none": None}
    assert numeric(rec) == {"a/b/c": 1.0, "l/0": 2.0, "l/1": 3.5, "ok": 1.0}


def test_every_record_reaches_every_backend(tmp_path, wandb_env):
    recs = records()
    t = log_all(tmp_path)
    assert t.records == recs  # kept in memory for curves.png
    want = expected_scalars(recs)
    assert "memory/model_states/device/params" in want and "summary/strategy" not in want
    # jsonl: the records as given, nesting and strings included
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == recs
    # tensorboard: every number, exactly (float64), at its step
    assert read_tensorboard(tmp_path / "tensorboard") == want
    # wandb: history rows merge the records of one step; the summary record's numbers
    history, summary = read_wandb(tmp_path)
    for tag, by_step in want.items():
        for step, v in by_step.items():
            assert history[step][tag] == pytest.approx(v, rel=1e-15), (tag, step)
    assert {k: summary[k] for k in want if k.startswith("summary/")} == \
        {k: want[k][20] for k in want if k.startswith("summary/")}
    # csv: one file per record type, numbers only
    for kind in ("train", "val", "memory", "summary"):
        header, rows = read_csv(tmp_path / f"metrics-{kind}.csv")
        got = {f"{kind}/{k}": {int(r["step"]): float(r[k]) for r in rows if r[k] != ""}
               for k in header if k != "step"}
        assert got == {tag: v for tag, v in want.items() if tag.startswith(kind + "/")}


def test_csv_header_widens_once_and_keeps_every_value(tmp_path):
    log_all(tmp_path, ["csv"])
    header, rows = read_csv(tmp_path / "metrics-train.csv")
    assert header[0] == "step" and header[-1] == "fp8_overflows"  # order of first appearance
    assert header[1:-1] == [k for k in records()[2] if k not in ("type", "step")]
    assert [r["fp8_overflows"] for r in rows] == ["", "", "", "3.0"]  # earlier rows: empty
    assert [float(r["loss"]) for r in rows] == [1.0, 0.5, 5.0 / 15, 0.2]


def test_resume_keeps_what_came_before_and_drops_the_rest(tmp_path):
    log_all(tmp_path, ["jsonl", "csv", "tensorboard"])
    later = {"type": "train", "step": 15, "loss": 9.0, "lr": 1.0}  # rerun of step 15
    t = log_all(tmp_path, ["jsonl", "csv", "tensorboard"], resume_step=10, recs=[later])
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 0, 5, 10, 10, 15]
    assert t.records == [*records()[:5], later]  # the whole history, for curves.png
    _, rows = read_csv(tmp_path / "metrics-train.csv")
    assert [(r["step"], float(r["loss"])) for r in rows] == [("5", 1.0), ("10", 0.5),
                                                             ("15", 9.0)]
    assert not (tmp_path / "metrics-summary.csv").exists()  # only past the resumed step
    tb = read_tensorboard(tmp_path / "tensorboard")
    assert tb["train/loss"] == {5: 1.0, 10: 0.5, 15: 9.0}  # step 15 and 20 purged
    log_all(tmp_path, ["jsonl", "csv", "tensorboard"], recs=[later])  # a new run: empty
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] \
        == [15]
    assert sorted(p.name for p in tmp_path.glob("metrics-*.csv")) == ["metrics-train.csv"]
    assert read_tensorboard(tmp_path / "tensorboard") == {"train/loss": {15: 9.0},
                                                          "train/lr": {15: 1.0}}


def test_only_rank_zero_writes(tmp_path):
    t = make_trackers(cfg_with(["jsonl", "csv"], tmp_path), tmp_path / "r1", rank=1)
    t.log(records()[2])
    t.close()
    assert not (tmp_path / "r1").exists() and t.records == []


def test_without_jsonl_no_stale_metrics_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"type": "train", "step": 1}\n')
    log_all(tmp_path, ["csv"])
    assert not (tmp_path / "metrics.jsonl").exists()


def test_wandb_mode_from_environment_wins(tmp_path, wandb_env, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    log_all(tmp_path, ["wandb"])
    assert not list(tmp_path.glob("wandb/offline-run-*"))


@pytest.mark.parametrize("backend,extra", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_missing_package_is_one_clear_error(tmp_path, monkeypatch, backend, extra):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == backend else real(name, *a))
    with pytest.raises(ConfigError, match=rf"pip install 'zerotrain\[{extra}\]'"):
        check_backends(["jsonl", backend])
    with pytest.raises(ConfigError, match=f"drop {backend} from logging.backends"):
        make_trackers(cfg_with([backend], tmp_path), tmp_path, rank=0)
    check_backends(["jsonl", "csv"])  # need no package


def test_backends_config_field():
    assert build_config({"logging": {"backends": "tensorboard, csv"}}).logging.backends == \
        ["tensorboard", "csv"]
    assert build_config({}).logging.backends == ["jsonl"]
    with pytest.raises(ConfigError, match="twice"):
        build_config({"logging": {"backends": ["csv", "csv"]}})
    with pytest.raises(ConfigError, match=r"logging\.backends\.0"):
        build_config({"logging": {"backends": ["tb"]}})
