"""Experiment trackers: where the training loop's metric records go (rank 0 only).

A record is a flat-or-nested dict with a `type` ("train", "val", "memory", "summary",
...) and a `step`; every backend receives every record:
- jsonl:        metrics.jsonl, one record per line as given (nesting kept)
- csv:          metrics-<type>.csv, one file per record type (see CsvTracker)
- tensorboard:  event files under tensorboard/, scalar tag "<type>/<key>" (float64)
- wandb:        a W&B run under wandb/, key "<type>/<key>"; offline unless the
                environment sets WANDB_MODE (so it works without network)
Nested dicts become "a/b/c" keys (`flatten`); tensorboard, wandb and csv keep only
numbers (bools as 0/1; strings such as the strategy name are skipped), jsonl keeps all.

tensorboard and wandb are optional extras (`pip install 'zerotrain[tensorboard]'`);
`check_backends` finds a missing one before any rank starts.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from zerotrain.config import Config, ConfigError

#: backend -> (module it imports, the extra that installs it)
_EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


class Tracker(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}, "c": [2, 3]} -> {"a/b": 1, "c/0": 2, "c/1": 3}."""
    out: dict[str, Any] = {}
    for k, v in record.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        elif isinstance(v, list | tuple):
            out.update(flatten(dict(enumerate(v)), key + "/"))
        else:
            out[key] = v
    return out


def numeric(record: dict[str, Any]) -> dict[str, float]:
    """The flattened record's numbers (bools as 0/1), without `type` and `step`."""
    return {k: float(v) for k, v in flatten(record).items()
            if k not in ("type", "step") and isinstance(v, int | float)}


def check_backends(backends: Iterable[str]) -> None:
    """One clear error for a backend whose package is missing (call it in the launcher)."""
    for b in backends:
        if b in _EXTRAS and importlib.util.find_spec(_EXTRAS[b][0]) is None:
            raise ConfigError(
                f"logging.backends includes {b}, but the {_EXTRAS[b][0]} package is not "
                f"installed; pip install 'zerotrain[{_EXTRAS[b][1]}]' or drop {b} from "
                "logging.backends")


class JsonlTracker:
    """metrics.jsonl; a resumed run keeps the lines up to its step, a new run starts empty."""

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = path
        self.kept: list[dict[str, Any]] = []  # the resumed run's history, for curves.png
        if path.exists() and resume_step is not None:
            old = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            self.kept = [r for r in old if r.get("step", 0) <= resume_step]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.kept))
        tmp.replace(path)

    def log(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        pass


class CsvTracker:
    """metrics-<type>.csv per record type, columns `step` then the numbers in order of
    first appearance. A record bringing a new key rewrites its file once with the wider
    header (earlier rows get empty cells there), so the header always names every column
    and no value is dropped; a key a record lacks is an empty cell."""

    def __init__(self, run_dir: Path, resume_step: int | None = None):
        self.dir = run_dir
        self.columns: dict[str, list[str]] = {}
        for p in sorted(run_dir.glob("metrics-*.csv")):
            header, rows = _read_csv(p) if resume_step is not None else ([], [])
            rows = [r for r in rows if r.get("step") and float(r["step"]) <= resume_step]
            kind = p.stem.removeprefix("metrics-")
            if rows:
                self.columns[kind] = header
                self._write(kind, rows)
            else:
                p.unlink()

    def _path(self, kind: str) -> Path:
        return self.dir / f"metrics-{kind}.csv"

    def _write(self, kind: str, rows: list[dict[str, Any]]) -> None:
        tmp = self._path(kind).with_suffix(".csv.tmp")
        with tmp.open("w", newline="") as f:
            w = csv.DictWriter(f, self.columns[kind], restval="")
            w.writeheader()
            w.writerows(rows)
        tmp.replace(self._path(kind))

    def log(self, record: dict[str, Any]) -> None:
        kind = str(record.get("type", "record"))
        row = {"step": record.get("step", ""), **{k: repr(v) for k, v in numeric(record).items()}}
        cols = self.columns.get(kind)
        if cols is None or any(k not in cols for k in row):
            old = _read_csv(self._path(kind))[1] if cols is not None else []
            cols = cols or ["step"]
            self.columns[kind] = cols + [k for k in row if k not in cols]
            self._write(kind, [*old, row])
            return
        with self._path(kind).open("a", newline="") as f:
            csv.DictWriter(f, cols, restval="").writerow(row)

    def close(self) -> None:
        pass


def _read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


class TensorBoardTracker:
    """Scalars "<type>/<key>" at the record's step, stored in float64 (TensorBoard's
    new-style scalar summaries; its classic ones round to float32, ~7 digits, which loses
    byte counts). A resumed run purges events past its step, as the event format allows."""

    def __init__(self, log_dir: Path, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        if resume_step is None:  # a new run starts empty
            for old in log_dir.glob("events.out.tfevents.*"):
                old.unlink()
        # Every run opens with a session-start event; TensorBoard takes each later one as a
        # restart and drops what earlier runs logged at or after its step.
        purge = 0 if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def log(self, record: dict[str, Any]) -> None:
        kind, step = record.get("type", "record"), int(record.get("step", 0))
        for key, value in numeric(record).items():
            self.writer.add_scalar(f"{kind}/{key}", value, step, new_style=True,
                                   double_precision=True)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """One W&B run; metrics "<type>/<key>" at the record's step, the summary record also
    into the run summary. Offline (files only) unless WANDB_MODE is set."""

    def __init__(self, run_dir: Path, cfg: Config):
        import wandb

        w = cfg.logging.wandb
        self.run = wandb.init(
            project=w.project, entity=w.entity, group=w.group, dir=str(run_dir),
            config=cfg.to_dict(), mode=os.environ.get("WANDB_MODE", "offline"),
            settings=wandb.Settings(console="off", silent=True))

    def log(self, record: dict[str, Any]) -> None:
        kind = record.get("type", "record")
        values = {f"{kind}/{k}": v for k, v in numeric(record).items()}
        self.run.log(values, step=int(record.get("step", 0)))
        if kind == "summary":
            self.run.summary.update(values)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """All configured backends behind one log/close; also keeps the records in memory (for
    curves.png; after a resume, starting with the jsonl history up to the resumed step).
    Empty, logging nothing, on ranks other than 0."""

    def __init__(self, trackers: list[Tracker], keep: bool, where: list[str] | None = None):
        self.trackers, self.keep = trackers, keep
        self.where = where or []  # the files/folders written, for the run's last line
        self.records: list[dict[str, Any]] = [
            r for t in trackers if isinstance(t, JsonlTracker) for r in t.kept]

    def log(self, record: dict[str, Any]) -> None:
        if self.keep:
            self.records.append(record)
        for t in self.trackers:
            t.log(record)

    __call__ = log

    def close(self) -> None:
        for t in self.trackers:
            t.close()
        self.trackers = []


def make_trackers(cfg: Config, run_dir: str | Path, rank: int,
                  resume_step: int | None = None) -> Trackers:
    """The backends of `cfg.logging.backends` on rank 0 (nothing elsewhere).

    resume_step: the step a resumed run continues from (its files keep what came before
    it); None for a new run (its files start empty).
    """
    if rank != 0:
        return Trackers([], keep=False)
    backends = cfg.logging.backends
    check_backends(backends)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # each backend: how it is made, and where its records go (the run summary names it)
    kinds: dict[str, tuple[Callable[[], Tracker], Path]] = {
        "jsonl": (lambda: JsonlTracker(run_dir / "metrics.jsonl", resume_step),
                  run_dir / "metrics.jsonl"),
        "csv": (lambda: CsvTracker(run_dir, resume_step), run_dir / "metrics-*.csv"),
        "tensorboard": (lambda: TensorBoardTracker(run_dir / "tensorboard", resume_step),
                        run_dir / "tensorboard"),
        "wandb": (lambda: WandbTracker(run_dir, cfg), run_dir / "wandb"),
    }
    made = [kinds[b][0]() for b in backends]
    where = [str(kinds[b][1]) for b in backends]
    if "jsonl" not in backends:  # a stale file would read as this run's
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    return Trackers(made, keep=True, where=where)
