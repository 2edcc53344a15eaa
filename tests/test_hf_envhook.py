"""ZEROTRAIN_DEEPSPEED=1 with the start-up hook (`zerotrain.hf.envhook`): `import deepspeed`
resolves to zerotrain.deepspeed in a process started without zerotrain (plain torchrun,
accelerate launch, python), and nothing changes without the variable. Each case is a fresh
interpreter whose site directory holds the hook file, processed as site-packages' .pth
files are at start-up (`site.addsitedir`, the code path of start-up)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerotrain.hf import envhook

SRC = str(Path(__file__).resolve().parents[1] / "src")
PROBE = """
import json, site, sys, importlib.util
site.addsitedir(sys.argv[1])
spec = importlib.util.find_spec("deepspeed")
out = {"found": spec is not None}
if spec is not None:
    import deepspeed, importlib.metadata as md
    out.update(version=deepspeed.__version__, meta=md.version("deepspeed"),
               zerotrain=deepspeed.initialize.__module__.startswith("zerotrain"))
print(json.dumps(out))
"""


def run(site_dir: Path, value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != envhook.VAR}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    if value is not None:
        env[envhook.VAR] = value
    return subprocess.run(
        [sys.executable, "-c", PROBE, str(site_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.fixture
def site_dir(tmp_path: Path) -> Path:
    path = envhook.install_hook(tmp_path)
    assert path == tmp_path / "zerotrain-deepspeed.pth"
    assert path.read_text() == envhook.PTH_LINE
    return tmp_path


def test_with_the_variable_import_deepspeed_is_zerotrains(site_dir):
    out = run(site_dir, "1")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "found": True,
        "version": "0.19.8",
        "meta": "0.19.8",
        "zerotrain": True,
    }
    assert out.stdout.count("resolves to zerotrain.deepspeed") == 1  # said once (rank 0)


@pytest.mark.parametrize("value", [None, "0", ""])
def test_without_it_nothing_changes(site_dir, value):
    out = run(site_dir, value)
    assert out.returncode == 0, out.stderr
    real = json.loads(run_without_hook(value))
    assert json.loads(out.stdout.splitlines()[-1]) == real
    assert "zerotrain" not in out.stdout + out.stderr


def run_without_hook(value: str | None) -> str:
    """The same probe with no hook file at all: what the machine has (in this venv no
    DeepSpeed; where the real one is installed, it)."""
    import tempfile

    with tempfile.TemporaryDirectory() as empty:
        out = run(Path(empty), value)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()[-1]


def test_a_bad_value_is_one_line_naming_the_variable(site_dir):
    out = run(site_dir, "deepspeed")
    assert out.returncode == 2
    assert "zerotrain: error: ZEROTRAIN_DEEPSPEED='deepspeed': set it to 1" in out.stderr


def test_install_and_remove_through_the_cli(tmp_path, monkeypatch):
    monkeypatch.setattr(envhook, "site_dir", lambda: tmp_path)
    from zerotrain.hf.__main__ import main

    main(["--install-hook"])
    assert (tmp_path / envhook.PTH_NAME).read_text() == envhook.PTH_LINE
    main(["--remove-hook"])
    assert not (tmp_path / envhook.PTH_NAME).exists()
    assert envhook.remove_hook(tmp_path) is False
