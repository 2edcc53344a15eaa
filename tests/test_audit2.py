"""The third new-user audit's findings (../shared/findings/new-user-audit-2.md), one test
each: every user error one line (no traceback, no hang), nothing stale trained on, and
the run that diverges at its end reported as divergence."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_run import one_error, run
from zerotrain.checkpoint.state import config_changes
from zerotrain.config import ConfigError, build_config, load_config
from zerotrain.data.dataset import BPE_RECORD, cached_shards, clear_caches, resolve_tokenizer
from zerotrain.data.errors import DataError
from zerotrain.data.shards import prepare
from zerotrain.data.tokenizer import ByteTokenizer, train_bpe
from zerotrain.models.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2",
        "--model.block_size", "16", "--data.micro_batch_size", "2",
        "--logging.eval_every", "0", "--logging.sample_tokens", "0",
        "--logging.progress", "false", "--logging.plot", "false", "--train.threads", "1"]


def text(n_lines: int, seed: int = 0) -> str:
    """Code-like lines with recurring words (so a BPE finds merges)."""
    rng = np.random.default_rng(seed)
    words = ["def", "return", "self", "value", "items", "for", "in", "if", "None", "x"]
    return "".join(" ".join(rng.choice(words, 6)) + "\n" for _ in range(n_lines))


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    p = tmp_path / "corpus.txt"
    p.write_text(text(400))
    return p




def train(capsys, run_dir: Path, data: Path, *extra: str) -> tuple[int, str, str]:
    return run(capsys, "train", *TINY, "--data.path", str(data), "--logging.run_dir",
               str(run_dir), *extra)


# ----------------------------------------------------------------- BROKEN 1 / TRACEBACKS 9
def test_divergence_in_the_last_steps_is_reported_and_nothing_is_saved(tmp_path, corpus,
                                                                       capsys):
    # sgd at lr 1e6 turns the loss non-finite within three steps: far fewer non-finite
    # steps than train.max_skipped_steps (50) before the end at step 5
    code, out, err = train(capsys, tmp_path / "r", corpus, "--optimizer.name", "sgd",
                           "--optimizer.lr", "1e6", "--optimizer.grad_clip", "0",
                           "--optimizer.weight_decay", "0", "--train.steps", "5",
                           "--schedule.warmup_steps", "0", "--logging.sample_tokens", "5",
                           "--checkpoint.every", "3", "--logging.log_every", "1")
    line = one_error(err, "train")
    assert code == 2 and "diverged" in line and "not saved" in line
    losses = [json.loads(ln)["loss"] for ln in (tmp_path / "r" / "metrics.jsonl").open()
              if '"train"' in ln]
    assert len(losses) == 5 and not np.isfinite(losses[2])  # non-finite by step 3
    assert "step 3: no checkpoint, the loss is not finite" in out
    assert not any((tmp_path / "r" / "checkpoints").glob("step_*"))  # no NaN checkpoint


def test_sample_of_non_finite_weights_is_one_line(tmp_path, corpus, capsys, monkeypatch):
    assert train(capsys, tmp_path / "r", corpus, "--train.steps", "1")[0] == 0
    import zerotrain.checkpoint as ckpt

    real = ckpt.full_state_dict

    def poisoned(path):  # finite weights whose outputs overflow: the diverged run's kind
        sd, meta = real(path)
        return {k: v * 1e30 if v.is_floating_point() else v for k, v in sd.items()}, meta

    monkeypatch.setattr(ckpt, "full_state_dict", poisoned)
    for temp in ("0.8", "0"):
        code, _, err = run(capsys, "sample", str(tmp_path / "r"), "--tokens", "3",
                           "--temperature", temp)
        assert code == 2 and "not finite" in one_error(err, "sample")


# ----------------------------------------------------------------- BROKEN 2 / MISLEADING 3
@pytest.mark.parametrize("preset", list(PRESETS))
def test_estimate_model_resolves_every_preset(tmp_path, preset, capsys):
    from zerotrain.models import count_params
    from zerotrain.models.presets import planned_model_config

    cfg = tmp_path / "p.yaml"
    cfg.write_text(f"model:\n  preset: {preset}\n")
    code, out, err = run(capsys, "estimate", "--model", str(cfg), "--gpus", "2", "--json")
    assert code == 0, err
    want = count_params(planned_model_config(load_config(cfg).model))
    assert json.loads(out)["psi"] == want


def test_estimate_and_config_show_resolve_model_hf_and_llama_bpe(tmp_path, capsys):
    from test_hf import hf_folder

    folder, model = hf_folder(tmp_path, "llama")
    cfg = tmp_path / "hf.yaml"
    cfg.write_text(f"model:\n  hf: {folder}\n  block_size: 16\n")
    code, out, err = run(capsys, "estimate", "--model", str(cfg), "--gpus", "2", "--json")
    assert code == 0, err
    assert json.loads(out)["psi"] == sum(p.numel() for p in model.parameters())
    code, out, _ = run(capsys, "config", "show", "--config", str(cfg), "--json")
    shown = json.loads(out)["model"]
    assert (shown["n_layer"], shown["n_embd"], shown["vocab_size"]) == (2, 32, 80)
    # a tiny model's peak table (the CPU runtime's ~400 MB beside KB of states) keeps its
    # columns: every row as wide as its header, every cell a number of the table's unit
    code, out, _ = run(capsys, "estimate", "--model", str(cfg), "--gpus", "2", "--device",
                       "cpu")
    peak = out[out.index("predicted peak per rank"):].split("\n\n")[0].splitlines()
    assert peak[0].endswith(", MB:")
    assert all(len(row) == len(peak[1]) for row in peak[3:]) and len(peak) == 9
    for row in peak[3:]:
        cells = row.split("|")[1].split() + row.split("|")[2].split()
        assert len(cells) == 5 and all(300 < float(c) < 1000 for c in cells)
    # the shipped llama config: a preset and a bpe:4096 tokenizer
    shipped = str(ROOT / "configs" / "llama-bpe.yaml")
    assert run(capsys, "estimate", "--model", shipped, "--gpus", "2")[0] == 0
    code, out, _ = run(capsys, "config", "show", "--config", shipped, "--json")
    shown = json.loads(out)["model"]
    assert (shown["arch"], shown["n_layer"], shown["n_embd"], shown["vocab_size"]) == \
        ("llama", 4, 128, 4096)


# ----------------------------------------------------------------- BROKEN 3
@pytest.mark.parametrize("n", ["0", "-5"])
def test_prepare_refuses_shard_tokens_below_one(tmp_path, corpus, n, capsys):
    code, _, err = run(capsys, "prepare", str(corpus), "--shard-tokens", n,
                       "--out", str(tmp_path / "out"))
    assert code == 2 and "--shard-tokens" in one_error(err, "prepare")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
    with pytest.raises(DataError, match="shard_tokens"):
        prepare([corpus], "bytes", tmp_path / "lib", shard_tokens=int(n))


def test_prepare_of_an_empty_source_is_an_error(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, _, err = run(capsys, "prepare", str(empty), "--out", str(tmp_path / "out"))
    assert code == 2 and "holds no text" in one_error(err, "prepare")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


# ----------------------------------------------------------------- BROKEN 4
def test_tokenizer_train_says_when_the_text_gives_fewer_tokens(tmp_path, corpus, capsys):
    code, out, err = run(capsys, "tokenizer", "train", str(corpus), "--vocab", "5000",
                         "--out", str(tmp_path / "t.json"))
    saved = json.loads((tmp_path / "t.json").read_text())
    real = len(set(saved["model"]["vocab"]) | {t["content"] for t in saved["added_tokens"]})
    assert code == 0 and f"{real:,} tokens" in out
    warn = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(warn) == 1 and f"only {real:,} tokens" in warn[0] and "5,000" in warn[0]
    empty = tmp_path / "e.txt"
    empty.write_text("")
    code, _, err = run(capsys, "tokenizer", "train", str(empty), "--vocab", "300",
                       "--out", str(tmp_path / "e.json"))
    assert code == 2 and "empty" in one_error(err, "tokenizer")
    assert not (tmp_path / "e.json").exists()


def test_bpe_n_short_of_n_is_accepted_again_by_the_same_spec(tmp_path, corpus):
    run_dir = tmp_path / "run"
    tok = resolve_tokenizer("bpe:5000", corpus, run_dir)
    assert 258 <= tok.vocab_size < 5000
    assert json.loads((run_dir / BPE_RECORD).read_text())["requested"] == 5000
    again = resolve_tokenizer("bpe:5000", corpus, run_dir)  # a resume: same file, accepted
    assert again.sha256 == tok.sha256
    with pytest.raises(DataError, match=r"--data\.tokenizer"):  # another N is still refused
        resolve_tokenizer("bpe:4000", corpus, run_dir)
    # a tokenizer file replaced behind the record's back is not vouched for
    train_bpe([text(50, seed=1)], 270, run_dir / "tokenizer.json")
    with pytest.raises(DataError, match="has 270 tokens"):
        resolve_tokenizer("bpe:5000", corpus, run_dir)


def test_bpe_run_short_of_n_resumes_with_the_same_flags(tmp_path, corpus, capsys):
    flags = ["--data.tokenizer", "bpe:5000", "--resume", "auto"]
    code, out, err = train(capsys, tmp_path / "r", corpus, *flags, "--train.steps", "1")
    assert code == 0, err
    assert "the corpus supplies only" in out
    code, out, err = train(capsys, tmp_path / "r", corpus, *flags, "--train.steps", "2")
    assert code == 0, err
    assert "resumed from" in out


# ----------------------------------------------------------------- BROKEN 5
def test_token_cache_follows_the_content_not_the_path(tmp_path, corpus):
    tok, notes = ByteTokenizer(), []
    out = cached_shards(corpus, tok, tmp_path / "run", notes=notes)
    first = json.loads((out / "manifest.json").read_text())["tokens"]
    assert first == len(corpus.read_bytes()) + 2  # the text and one document separator
    with corpus.open("a") as f:
        f.write(text(100, seed=2))  # the same path, new content
    cached_shards(corpus, tok, tmp_path / "run", notes=notes)
    now = json.loads((out / "manifest.json").read_text())["tokens"]
    assert now == len(corpus.read_bytes()) + 2 and now > first
    assert len(notes) == 1 and "changed since its tokens were cached" in notes[0]


def test_clear_caches_removes_only_zerotrains_files(tmp_path, corpus):
    run_dir = tmp_path / "run"
    resolve_tokenizer("bpe:300", corpus, run_dir)
    cached_shards(corpus, ByteTokenizer(), run_dir)
    (run_dir / "notes.txt").write_text("mine")
    gone = clear_caches(run_dir, corpus, "bpe:300")
    assert sorted(p.name for p in gone) == ["tokenizer.json", "tokens"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]
    # a tokenizer the run reads as data.tokenizer, and shards it trains on, are the user's
    resolve_tokenizer("bpe:300", corpus, run_dir)
    shards = cached_shards(corpus, ByteTokenizer(), run_dir)
    assert clear_caches(run_dir, shards, str(run_dir / "tokenizer.json")) == []
    assert (run_dir / "tokenizer.json").is_file() and (shards / "manifest.json").is_file()


def test_overwrite_trains_on_the_new_corpus(tmp_path, corpus, capsys):
    flags = ["--data.tokenizer", "bpe:300", "--train.steps", "1"]
    assert train(capsys, tmp_path / "r", corpus, *flags)[0] == 0
    old_tok = (tmp_path / "r" / "tokenizer.json").read_bytes()
    other = tmp_path / "other.txt"
    other.write_text("".join(f"class C{i}: pass  # {i * i}\n" for i in range(3000)))
    code, out, err = train(capsys, tmp_path / "r", other, *flags,
                           "--logging.overwrite", "true")
    assert code == 0, err
    assert "removed" in out
    assert (tmp_path / "r" / "tokenizer.json").read_bytes() != old_tok
    # the same tokens as a tokenizer trained on the new corpus alone gives
    fresh = resolve_tokenizer("bpe:300", other, tmp_path / "fresh")
    manifest = json.loads((tmp_path / "r" / "tokens" / "manifest.json").read_text())
    assert (tmp_path / "r" / "tokenizer.json").read_bytes() == \
        (tmp_path / "fresh" / "tokenizer.json").read_bytes()
    assert manifest["tokens"] == prepare([other], fresh, tmp_path / "ref")["tokens"]


def test_changed_data_settings_are_warned_on_resume():
    a = build_config({}).to_dict()
    b = build_config({"data": {"path": "x.txt", "val_fraction": 0.1,
                               "tokenizer": "bpe:300"}}).to_dict()
    changed = {c.split(":")[0] for c in config_changes(a, b)}
    assert {"data.path", "data.val_fraction", "data.tokenizer"} <= changed


# ----------------------------------------------------------------- warmup default
def test_default_warmup_scales_to_a_short_run_and_says_so(tmp_path, corpus, capsys):
    for steps, warmup in [(6, 0), (50, 5), (420, 42), (1000, 100), (5000, 100)]:
        assert build_config({"train": {"steps": steps}}).schedule.warmup_steps == warmup
    with pytest.raises(ConfigError, match=r"--schedule.warmup_steps 0 \(at most 6\)"):
        build_config({"train": {"steps": 6}, "schedule": {"warmup_steps": 40}})
    code, out, err = train(capsys, tmp_path / "r", corpus, "--train.steps", "20",
                           "--logging.log_every", "1")
    assert code == 0, err
    assert "schedule.warmup_steps not set: 2" in out
    lrs = [json.loads(ln)["lr"] for ln in (tmp_path / "r" / "metrics.jsonl").open()
           if '"train"' in ln][:3]
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(5e-4) and lrs[2] == pytest.approx(1e-3)


# ----------------------------------------------------------------- TRACEBACKS 1-4
def test_init_from_errors_are_one_line(tmp_path, corpus, capsys):
    assert train(capsys, tmp_path / "r", corpus, "--train.steps", "1")[0] == 0
    assert run(capsys, "export", str(tmp_path / "r"), "--out",
               str(tmp_path / "w.safetensors"))[0] == 0
    step = next((tmp_path / "r" / "checkpoints").glob("step_*"))
    cases = {tmp_path / "missing.safetensors": "do not exist",
             tmp_path / "r": "--resume",
             step: "zerotrain export",
             tmp_path / "w.safetensors": "do not fit the model"}
    for path, says in cases.items():
        code, _, err = train(capsys, tmp_path / "new", corpus, "--train.steps", "1",
                             "--model.init_from", str(path), "--model.n_embd", "64",
                             "--logging.overwrite", "true")
        line = one_error(err, "train")
        assert code == 2 and "model.init_from" in line and says in line, line


# ----------------------------------------------------------------- TRACEBACKS 6
def test_seed_outside_the_generators_range_is_a_config_error():
    for bad in (-1, 10**20):
        with pytest.raises(ConfigError, match=r"train\.seed"):
            build_config({"train": {"seed": bad}})
    top = build_config({"train": {"seed": 2**63 - 1}}).train.seed
    torch.manual_seed(top)  # the largest accepted seed works where seeds are used
    from zerotrain.data.sampler import WindowSampler

    x, _ = WindowSampler(np.arange(400, dtype=np.uint16), 8, top).batch(0, 0, 0, 1, 2, 1)
    assert x.shape == (2, 8)


@pytest.mark.parametrize("seed", ["-1", "99999999999999999999"])
def test_sample_seed_outside_the_generators_range_is_one_line(seed, capsys):
    code, _, err = run(capsys, "sample", "nowhere", "--seed", seed)
    assert code == 2 and "--seed must be in 0..2^63-1" in one_error(err, "sample")


# ----------------------------------------------------------------- TRACEBACKS 7 / MISLEADING 8
def test_a_raw_byte_file_named_bin_is_refused(tmp_path, corpus, capsys):
    from zerotrain.data.corpus import load_tokens

    raw = tmp_path / "raw.bin"
    raw.write_bytes(b"ab" * 300)  # even size: read as uint16 it holds 25185 ('ab')
    with pytest.raises(DataError, match=r"holds 25185 at token 0, not a byte token"):
        load_tokens(raw)
    code, _, err = train(capsys, tmp_path / "r", raw, "--train.steps", "1")
    assert code == 2 and "zerotrain prepare" in one_error(err, "train")
    # prepare's own .bin loads, with its sidecar and without it (its values are bytes)
    assert run(capsys, "prepare", str(corpus), "--out", str(tmp_path / "ok.bin"))[0] == 0
    assert len(load_tokens(tmp_path / "ok.bin")) == len(corpus.read_bytes())
    (tmp_path / "ok.json").unlink()
    assert len(load_tokens(tmp_path / "ok.bin")) == len(corpus.read_bytes())


# ----------------------------------------------------------------- TRACEBACKS 8
def test_damaged_latest_is_one_line_naming_what_still_loads(tmp_path, corpus, capsys):
    assert train(capsys, tmp_path / "r", corpus, "--train.steps", "1")[0] == 0
    root = tmp_path / "r" / "checkpoints"
    (root / "latest").write_bytes(b"\x00\xff")
    code, _, err = train(capsys, tmp_path / "r", corpus, "--train.steps", "2", "--resume")
    line = one_error(err, "train")
    assert code == 2 and "latest' is damaged" in line
    assert f"--resume {root / 'step_00000001'}" in line


# ----------------------------------------------------------------- silently accepted
def test_contradicting_or_repeated_flags_are_refused(tmp_path, corpus, capsys):
    code, _, err = train(capsys, tmp_path / "r", corpus, "--resume", "--logging.overwrite",
                         "true")
    assert code == 2 and "give one of them" in one_error(err, "train")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  steps: 3\n")
    code, _, err = run(capsys, "train", "--config", str(cfg), "--config", str(cfg))
    assert code == 2 and "--config is given twice" in one_error(err, "train")


def test_cpu_cost_warning_for_a_huge_block_size():
    from zerotrain.run.report import cpu_cost_warning

    small = build_config({"model": {"n_layer": 2, "n_head": 2, "n_embd": 32,
                                    "block_size": 64}, "data": {"micro_batch_size": 4}})
    assert cpu_cost_warning(small, 36_000) is None
    huge = small.model_copy(update={"model": small.model.model_copy(
        update={"block_size": 100_000})})
    line = cpu_cost_warning(huge, 3_200_000)
    # 6·N·tokens + 12·L·h·b·s² FLOPs, at 1e11 FLOP/s
    flops = 6 * 3_200_000 * 4 * 100_000 + 12 * 2 * 32 * 4 * 100_000**2
    assert line is not None and f"{flops:.1e} FLOPs" in line
    assert f"about {flops / 1e11 / 60:.0f} min per step" in line


# ----------------------------------------------------------------- MISLEADING 4, 9, 12
def test_run_summary_names_the_metrics_files_written(tmp_path, corpus, capsys):
    code, out, err = train(capsys, tmp_path / "r", corpus, "--train.steps", "1",
                           "--logging.backends", "csv")
    assert code == 0, err
    last = [ln for ln in out.splitlines() if "metrics " in ln][-1]
    assert last.endswith(f"metrics {tmp_path / 'r' / 'metrics-*.csv'}")
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
    assert list((tmp_path / "r").glob("metrics-*.csv"))


def test_help_texts_name_every_family_and_export_format(capsys):
    out = run(capsys, "--help")[1]
    assert re.search(r"export\s+.*safetensors.*HF", out)
    out = " ".join(run(capsys, "train", "--help")[1].split())
    assert "llama" in out and "Hugging Face" in out and "reference GPT" in out
    out = " ".join(run(capsys, "tokenizer", "train", "--help")[1].split())
    assert "fewer tokens" in out


def test_shared_checkpoint_dir_error_names_checkpoint_dir(tmp_path, corpus, capsys):
    shared = tmp_path / "ckpts"
    assert train(capsys, tmp_path / "a", corpus, "--train.steps", "1", "--checkpoint.dir",
                 str(shared))[0] == 0
    code, _, err = train(capsys, tmp_path / "b", corpus, "--train.steps", "1",
                         "--checkpoint.dir", str(shared))
    line = one_error(err, "train")
    assert code == 2 and f"checkpoint.dir '{shared}' holds another run" in line
    assert "--checkpoint.dir" in line and "logging.run_dir" not in line


# ----------------------------------------------------------------- MISLEADING 10
def test_lr_find_json_counts_its_points():
    from zerotrain.run.lr_find import RangeTest, _result, summary_lines

    t = RangeTest(beta=0.5)
    losses = [5.0, 4.0, 3.0, 2.5, 3.0, 8.0, 30.0]
    for i, loss in enumerate(losses):
        if t.add(1e-3 * 2**i, loss):
            break
    r = _result(t, build_config({}), 1e-3, 1.0, 10, len(t.lrs) + 1, 6.0)
    assert r["points"] == len(r["lrs"]) == r["steps_run"] - 1
    text_ = "\n".join(summary_lines(r, Path("out")))
    assert "running (lagging) average" in text_ and "lag-free smoothed curve" in text_


def test_interrupted_is_said_once_per_job(monkeypatch, capsys):
    from zerotrain.cli.args import command

    @command("demo")
    def body(argv):
        raise KeyboardInterrupt

    monkeypatch.setenv("RANK", "1")
    assert body([]) == 130 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert body([]) == 130 and "interrupted" in capsys.readouterr().err
    monkeypatch.delenv("RANK")
    assert os.environ.get("RANK") is None


def test_launcher_flags_under_torchrun_are_said_to_be_ignored(monkeypatch, capsys):
    import zerotrain.comm.dist as dist
    import zerotrain.run.lifecycle as lifecycle
    import zerotrain.run.loop as train_mod

    ran = []
    monkeypatch.setattr(dist, "launched_by_torchrun", lambda: True)
    monkeypatch.setattr(lifecycle, "die_with_parent", lambda: None)
    monkeypatch.setattr(train_mod, "train", lambda cfg, resume=None: ran.append(cfg))
    monkeypatch.setenv("RANK", "0")
    code, _, err = run(capsys, "train", "--max-restarts", "2", "--train.steps", "3")
    assert code == 0 and len(ran) == 1
    assert "--max-restarts ignored under torchrun" in err


def test_an_interrupted_rank_0_tells_the_launcher_it_saved(tmp_path, monkeypatch, capsys):
    from zerotrain.cli.args import command
    from zerotrain.comm.launch import SAVED_MARKER, interrupted_status
    from zerotrain.run.lifecycle import EXIT_INTERRUPTED, Interrupted

    @command("demo")
    def body(argv):
        raise Interrupted(3, "ckpt/step_00000003")

    monkeypatch.setenv("ZEROTRAIN_ERROR_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    assert body([]) == EXIT_INTERRUPTED and not (tmp_path / SAVED_MARKER).exists()
    assert interrupted_status(tmp_path) == 130  # the launcher: nothing saved yet
    monkeypatch.setenv("RANK", "0")
    assert body([]) == EXIT_INTERRUPTED
    assert "step_00000003" in (tmp_path / SAVED_MARKER).read_text()
    assert interrupted_status(tmp_path) == EXIT_INTERRUPTED
    assert capsys.readouterr().err.count("interrupted at step 3") == 1
