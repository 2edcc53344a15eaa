"""zerotrain.hf: `import deepspeed` answered by zerotrain.deepspeed inside one process,
with the distribution metadata transformers and Accelerate read, the modules they and
DeepSpeedExamples import, and the version check. Each case runs in a fresh interpreter
(the alias and transformers' availability checks are per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zerotrain.hf.versions import TESTED, check_versions

SRC = str(Path(__file__).resolve().parents[1] / "src")


def run_py(code: str) -> dict:
    """Run `code` in a fresh interpreter (zerotrain from this tree); its last stdout
    line is JSON."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_deepspeed_resolves_with_metadata_and_says_so_once():
    r = run_py("""
import importlib.util, importlib.metadata as md, json, io, contextlib
before = importlib.util.find_spec("deepspeed") is not None
import zerotrain.hf
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    zerotrain.hf.install(); zerotrain.hf.install()
import deepspeed, zerotrain.deepspeed as zd
from deepspeed import comm as dist
from transformers.integrations.deepspeed import is_deepspeed_available as t_avail
from accelerate.utils import is_deepspeed_available as a_avail
from accelerate.utils import compare_versions
print(json.dumps({"before": before, "said": buf.getvalue().count("resolves to"),
  "version": deepspeed.__version__, "meta": md.version("deepspeed"),
  "init": deepspeed.initialize is zd.initialize, "rank": dist.get_rank(),
  "t": t_avail(), "a": a_avail(), "ge": compare_versions("deepspeed", ">=", "0.16.4")}))
""")
    assert r == {"before": r["before"], "said": 1, "version": "0.19.8", "meta": "0.19.8",
                 "init": True, "rank": 0, "t": True, "a": True, "ge": True}


def test_only_the_process_that_installs_sees_it():
    """uninstall() gives back what the machine has (here: whatever `deepspeed` resolved
    to before install, the real one or none)."""
    r = run_py("""
import importlib.util, importlib.metadata as md, json, zerotrain.hf
def seen():
    spec = importlib.util.find_spec("deepspeed")
    try:
        v = md.version("deepspeed")
    except md.PackageNotFoundError:
        v = None
    return [spec.origin if spec else None, v]
before = seen()
zerotrain.hf.install(quiet=True); import deepspeed
mine = [type(deepspeed).__name__, md.version("deepspeed")]
del deepspeed
zerotrain.hf.uninstall()
print(json.dumps({"before": before, "mine": mine, "after": seen()}))
""")
    assert r["mine"] == ["AliasModule", "0.19.8"]
    assert r["after"] == r["before"]


def test_modules_scripts_and_libraries_import():
    r = run_py("""
import json, torch, zerotrain.hf
zerotrain.hf.install(quiet=True)
import deepspeed
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger, safe_get_full_fp32_param
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero import partition_parameters as pp
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.runtime.utils import move_to_device
p = torch.nn.Parameter(torch.ones(2))
g = {"params": [p], "weight_decay": 0.1}
print(json.dumps({
  "split_dict": [len(x["params"]) for x in split(g)], "split_tuple": type(split((g, g))).__name__,
  "sched": deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES,
  "engine": DeepSpeedEngine.__module__, "logger": logger.name,
  "dev": get_accelerator().device_name(), "status": ZeroParamStatus.AVAILABLE.name,
  "wrap_is_identity": pp.zero_wrapper_for_fp_tensor_constructor(torch.ones, None) is torch.ones,
  "moved": move_to_device({"a": [torch.ones(1)], "b": 3}, "cpu")["b"],
}))
try:
    from deepspeed.pipe import PipelineModule
    print("no refusal")
except ImportError as e:
    print(json.dumps({"pipe": str(e)}))
""")
    assert r == {"pipe": r["pipe"]}  # the last line: deepspeed.pipe is not answered


def test_module_values(tmp_path):
    from zerotrain.deepspeed.moe.utils import (
        split_params_into_different_moe_groups_for_optimizer as split,
    )
    from zerotrain.deepspeed.runtime import clone_tensors_for_torch_save, move_to_device

    p = torch.nn.Parameter(torch.ones(2))
    g = {"params": [p], "lr": 0.1}
    assert split(g) == [g] and split((g, g)) == [g, g]
    p.allreduce = False  # how DeepSpeed marks an expert parameter
    with pytest.raises(ValueError, match="MoE"):
        split([g])
    big = torch.arange(10.0)
    view = {"w": big[2:4], "n": [big[:1]], "k": "x"}
    c = clone_tensors_for_torch_save(view)
    assert c["k"] == "x" and torch.equal(c["w"], torch.tensor([2.0, 3.0]))
    assert c["w"].untyped_storage().nbytes() == 8  # its own storage, not the 40-byte one
    torch.save(c, tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt")["n"][0].item() == 0.0
    seen = move_to_device((torch.ones(1), [torch.zeros(1)]), "cpu",
                          criterion_func=lambda t: t.sum() > 0)
    assert isinstance(seen, tuple) and seen[0].item() == 1.0


def test_other_majors_are_refused_in_one_line():
    check_versions({"transformers": TESTED["transformers"], "accelerate": "1.99.0",
                    "trl": None})
    with pytest.raises(RuntimeError) as e:
        check_versions({"transformers": "4.57.1", "accelerate": None, "trl": None})
    msg = str(e.value)
    assert "\n" not in msg and "transformers 4.57.1" in msg and "zerotrain[hf]" in msg
    with pytest.raises(RuntimeError, match=r"trl 0\.9\.0"):
        check_versions({"transformers": None, "accelerate": None, "trl": "0.9.0"})


def test_install_refuses_after_a_real_deepspeed_was_imported():
    r = run_py("""
import json, sys, types, zerotrain.hf
sys.modules["deepspeed"] = types.ModuleType("deepspeed")  # as if the real one was imported
try:
    zerotrain.hf.install(quiet=True); print(json.dumps({"err": None}))
except RuntimeError as e:
    print(json.dumps({"err": str(e)}))
""")
    assert "already imported" in r["err"]
