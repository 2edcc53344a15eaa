"""The `zerotrain` command as a user meets it: help, version, one-line errors, pipes, and
the commands that work on checkpoints and data."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import zerotrain
from zerotrain.checkpoint.io import CheckpointError
from zerotrain.cli import COMMANDS, main
from zerotrain.cli.args import UsageError, command, parse_count, parse_size
from zerotrain.cli.train import SECTIONS
from zerotrain.config import Config, ConfigError
from zerotrain.data.corpus import DataError
from zerotrain.numerics.scaler import LossScaleError

TINY = ["--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2",
        "--model.block_size", "16", "--data.micro_batch_size", "2", "--train.steps", "2",
        "--schedule.warmup_steps", "0", "--logging.eval_every", "0",
        "--logging.sample_tokens", "0", "--logging.progress", "false"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error(err: str, name: str) -> str:
    """The single error line of `zerotrain <name>`, checked for shape."""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"zerotrain {name}: error: "), err
    return lines[0]


def undocumented(help_text: str) -> list[str]:
    """Options listed in argparse help without a description after them."""
    lines = help_text.splitlines()
    bare = []
    for i, line in enumerate(lines):
        m = re.match(r"  (-\S.*?)(\s{2,}\S.*)?$", line)
        if m and not m.group(2):
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            if not re.match(r"\s{20,}\S", nxt):
                bare.append(m.group(1))
    return bare


# ---------------------------------------------------------------------- top level
def test_version(capsys):
    assert run(capsys, "--version") == (0, f"zerotrain {zerotrain.__version__}\n", "")


def test_top_level_help_describes_every_command(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and out.startswith("usage: zerotrain COMMAND")
    for name, c in COMMANDS.items():
        assert re.search(rf"^  {name}\s+{re.escape(c.summary)}$", out, re.M), name
    assert "module" not in out and "--version" in out and "docs/design.md" in out


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_has_help(name, capsys):
    code, out, err = run(capsys, name, "--help")
    assert code == 0 and err == ""
    assert out.startswith(f"usage: zerotrain {name}")
    assert not undocumented(out), undocumented(out)
    assert "SPEC" not in out  # help cites docs inside the repository


def test_help_shows_defaults(capsys):
    out = " ".join(run(capsys, "sample", "--help")[1].split())
    for default in ("(default: 'def ')", "(default: 300)", "(default: 0.8)", "(default: 50)"):
        assert default in out


def test_train_help(capsys):
    code, out, _ = run(capsys, "train", "--help")
    assert code == 0
    for flag in ("--config FILE", "--nproc N", "--resume [CKPT|auto]", "--deepspeed FILE",
                 "--max-restarts K"):
        assert flag in out, flag
    for section, info in Config.model_fields.items():
        assert re.search(rf"^  {section}\s+\S", out, re.M), section
        for key in info.annotation.model_fields:
            assert key in out, (section, key)


def test_train_help_names_every_config_section():
    assert list(SECTIONS) == list(Config.model_fields)


def test_config_help(capsys):
    code, out, _ = run(capsys, "config", "--help")
    assert code == 0 and "show" in out
    code, out, _ = run(capsys, "config", "show", "--help")
    assert code == 0 and out.startswith("usage: zerotrain config show")
    assert "--json" in out and "--section.key VALUE" in out
    code, _, err = run(capsys, "config")
    assert code == 2 and "ACTION" in one_error(err, "config")


def test_config_show_overrides_and_yaml(capsys):
    code, out, _ = run(capsys, "config", "show", "--zero.stage", "3", "--optimizer.lr=-1e-3",
                       "--model.n_layer", "2")
    assert code == 2  # a negative lr is refused by the config, in one line
    code, out, _ = run(capsys, "config", "show", "--zero.stage", "3", "--model.n_layer", "2")
    assert code == 0 and "stage: 3" in out and "n_layer: 2" in out


@pytest.mark.parametrize("argv", [["--help"], ["float", "5"], ["formats"]])
def test_closed_pipe_exits_quietly(argv):
    """`zerotrain float 5 | head -1`: the reader goes away; no BrokenPipeError traceback."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.Popen([sys.executable, "-m", "zerotrain", *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    p.stdout.close()  # before the child has written anything: every write hits EPIPE
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141
    assert err == "", err


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize("error", [UsageError, ConfigError, DataError, CheckpointError,
                                   LossScaleError])
def test_user_errors_are_one_line(error, capsys):
    @command("demo")
    def demo(argv: list[str]) -> int:
        raise error("what went wrong\nand how to fix it")

    assert demo([]) == 2
    line = one_error(capsys.readouterr().err, "demo")
    assert line.endswith("what went wrong and how to fix it")


def test_bugs_keep_their_traceback():
    @command("demo")
    def demo(argv: list[str]) -> int:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError):
        demo([])


def test_nproc_errors_share_the_prefix(capsys):
    for bad in ("x", "0", "-2"):
        code, _, err = run(capsys, "train", "--nproc", bad, *TINY)
        assert code == 2 and "--nproc" in one_error(err, "train")
    code, _, err = run(capsys, "train", *TINY, "--nproc")
    assert code == 2 and "--nproc needs a value" in one_error(err, "train")


@pytest.mark.parametrize(("argv", "needle"), [
    (["ring", "--gpus", "4", "--size", "1e400GB"], "too large"),
    (["ring", "--gpus", "1"], "at least 2"),
    (["ring", "--gpus", "64", "--run"], "--run"),
    (["float", "1", "--frobnicate"], "unrecognized"),
    (["prepare", "/nonexistent/corpus", "--out", "x.bin"], "SOURCE '/nonexistent/corpus'"),
    (["export", "/nonexistent/ckpt", "--out", "m.safetensors"], "does not exist"),
    (["sample", "--prompt", "", "some/ckpt"], "--prompt is empty"),
    (["sample", "some/ckpt", "--tokens", "-5"], "--tokens must be >= 0"),
    (["sample", "some/ckpt", "--temperature", "-1"], "--temperature must be >= 0"),
    (["sample", "some/ckpt", "--top-k", "-1"], "--top-k"),
    (["sample", "a", "--checkpoint", "b"], "give the checkpoint once"),
    (["sample"], "give the checkpoint once"),
])
def test_bad_input_is_one_line(argv, needle, capsys):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert needle in one_error(err, argv[0])
    assert "data.path" not in err


def test_prepare_messages_name_the_argument(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "prepare", str(tmp_path / "empty"), "--out",
                       str(tmp_path / "x.bin"))
    line = one_error(err, "prepare")
    assert code == 2 and "SOURCE" in line and "data.path" not in line
    (tmp_path / "a.txt").write_text("hello world\n" * 10)
    code, out, _ = run(capsys, "prepare", str(tmp_path / "a.txt"), "--out",
                       str(tmp_path / "a.bin"))
    assert code == 0 and "120 tokens" in out
    assert (tmp_path / "a.bin").stat().st_size == 2 * 120


# ---------------------------------------------------------------------- sizes and counts
def test_parse_size_units():
    assert parse_size("80", "--x", bare_unit="GB") == (80 * 10**9, False)
    assert parse_size("80", "--x", bare_unit="B") == (80, False)
    assert parse_size("80G", "--x", bare_unit="B") == (80 * 10**9, False)
    assert parse_size("2 tib", "--x", bare_unit="B") == (2 * 2**40, True)
    for bad in ("80XB", "", "-1GB", "0", "1e400GB", "nanGB", "1e22"):
        with pytest.raises(UsageError, match="--x"):
            parse_size(bad, "--x", bare_unit="B")


def test_parse_count():
    assert parse_count("7.5B", "--n") == 7_500_000_000
    assert parse_count("125M", "--n") == 125_000_000
    assert parse_count("1e3", "--n") == 1000
    for bad in ("lots", "0", "1e400", "inf", "2e18"):
        with pytest.raises(UsageError, match="--n"):
            parse_count(bad, "--n")
    assert parse_count("7.1B", "--n") == 7_100_000_000  # whole up to float rounding
    assert parse_count("0", "--n", minimum=0) == 0
    with pytest.raises(UsageError, match=r"--n must be a whole number, got '2\.5'"):
        parse_count("2.5", "--n")
    with pytest.raises(UsageError, match="--n must be at least 1, got '-2'"):
        parse_count("-2", "--n")


def test_config_command_flags_come_out_of_the_overrides():
    from zerotrain.cli.run_command import LAUNCHER_FLAGS, drop_flags, split_flags

    argv = ["--nproc", "2", "--optimizer.lr", "3e-4", "--resume", "--max-restarts=1",
            "--zero.stage", "2"]
    opts, rest = split_flags(argv, ("--nproc", "--resume", "--max-restarts"))
    assert opts == {"--nproc": "2", "--resume": "", "--max-restarts": "1"}
    assert rest == ["--optimizer.lr", "3e-4", "--zero.stage", "2"]
    # what the launched ranks see: everything but the launcher's own flags
    assert drop_flags(argv, LAUNCHER_FLAGS) == ["--optimizer.lr", "3e-4", "--resume",
                                                "--zero.stage", "2"]


# ---------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A two-step run of a tiny GPT, in this process."""
    root = tmp_path_factory.mktemp("run")
    corpus = root / "corpus.txt"
    corpus.write_text(Path(__file__).read_text() * 3)
    assert main(["train", *TINY, "--data.path", str(corpus),
                 "--logging.run_dir", str(root / "r")]) == 0
    return root / "r"


@pytest.mark.slow
def test_sample_takes_the_checkpoint_like_export(run_dir, capsys):
    ckpt = str(run_dir / "checkpoints")
    code, first, _ = run(capsys, "sample", ckpt, "--tokens", "8", "--prompt", "ab")
    assert code == 0 and first.startswith("ab")
    assert run(capsys, "sample", "--checkpoint", ckpt, "--tokens", "8", "--prompt", "ab")[1] \
        == first  # the older flag still works
    assert run(capsys, "sample", str(run_dir), "--tokens", "8", "--prompt", "ab")[1] == first


@pytest.mark.slow
def test_export_refuses_a_directory_before_any_work(run_dir, tmp_path, capsys):
    out_dir = tmp_path / "some_dir"
    out_dir.mkdir()
    code, _, err = run(capsys, "export", str(run_dir), "--out", str(out_dir))
    assert code == 2 and "is a directory" in one_error(err, "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["some_dir"]  # no .tmp left
    code, out, _ = run(capsys, "export", str(run_dir), "--out", str(tmp_path / "m.safetensors"))
    assert code == 0 and "fp32" in out and (tmp_path / "m.safetensors").is_file()


def test_cited_design_sections_exist():
    """Every `docs/design.md §name` the commands cite is a section of that page."""
    root = Path(__file__).resolve().parents[1]
    sections = set(re.findall(r"^## §(\w+)", (root / "docs/design.md").read_text(), re.M))
    cited = set()
    for f in (root / "src/zerotrain").rglob("*.py"):
        for ref in re.findall(r"docs/design\.md((?:,? ?§\w+)+)", f.read_text()):
            cited |= set(re.findall(r"§(\w+)", ref))
    assert cited and cited <= sections, cited - sections
