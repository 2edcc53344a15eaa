"""bench/gpu_check.py's first sections: env (versions, GPUs) and setup (zerotrain's
needs, a venv when they are missing)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from gpu_check_core import ROOT, VERIFY, Ctx, last_line

# ----------------------------------------------------------------------------- env


def section_env(ctx: Ctx) -> None:
    rep = ctx.rep
    smi = shutil.which("nvidia-smi")
    if smi:
        code, text = ctx.run([smi, "-L"], 10)
        rep.add("env", "nvidia-smi -L", "INFO" if code == 0 else "FAIL", last_line(text))
        code, text = ctx.run([smi, "--query-gpu=compute_mode,driver_version",
                              "--format=csv,noheader"], 10)
        mode = last_line(text)
        # init_mem puts 8 processes on the one GPU: Exclusive_Process refuses the second
        rep.add("env", "compute mode, driver", "INFO" if code == 0 and "Default" in mode
                else "FAIL" if code == 0 else "INFO",
                mode + ("" if "Default" in mode or code else
                        ": init_mem needs Default (8 processes share the GPU)"))
    elif not ctx.dry:
        rep.add("env", "nvidia-smi", "FAIL", "not on PATH")
    code, text = ctx.run([ctx.py, "-c", ENV_PROBE], 60)
    info = _json_line(text)
    if info is None:
        rep.add("env", "torch", "FAIL", f"{ctx.py} cannot report torch: {last_line(text)}")
        ctx.blocked = "torch does not import"
        return
    info["python"] = ctx.py
    info["gpus_text"] = (f"{len(info['gpus'])} x {info['gpus'][0]} ({info['gpu_mem_gib'][0]} "
                         f"GiB, sm_{info['capability'][0]}{info['capability'][1]})"
                         if info["gpus"] else "no GPU")
    rep.data["env"] = info
    ctx.gpus = len(info["gpus"])
    rep.add("env", "torch / CUDA / NCCL", "INFO",
            f"python {info['python_version']}, torch {info['torch']}, CUDA {info['cuda']}, "
            f"NCCL {info['nccl']}, {info['gpus_text']}")
    py = tuple(int(x) for x in info["python_version"].split(".")[:2])
    if py < (3, 11):  # pyproject's requires-python; deps.py reads it with tomllib (3.11)
        rep.add("env", "python", "FAIL", f"{ctx.py} is python {info['python_version']}: "
                "zerotrain needs >= 3.11 (set PYTHON=/path/to/python3.11+)")
        ctx.blocked = f"python {info['python_version']} < 3.11"
    code, text = ctx.run(["df", "-T", str(ctx.work)], 10)
    rep.add("env", "scratch disk (the NVMe tier's files)", "INFO",
            f"{ctx.work}: {last_line(text)}" if code == 0 else f"df: {last_line(text)}")
    if ctx.dry:
        rep.add("env", "dry run", "INFO", "CPU: gloo ranks, tiny sizes, stand-ins named "
                "per row; nothing here is a GPU result")
    elif not info["gpus"]:
        rep.add("env", "CUDA", "FAIL", "no CUDA device visible to this torch; every GPU "
                "section is skipped (--dry-run tests the script on CPU)")
        ctx.blocked = "no CUDA device"
    else:
        cap = tuple(info["capability"])
        rep.add("env", "FP8 matmul", "INFO" if cap >= (8, 9) else "SKIP",
                f"sm_{cap[0]}{cap[1]}: " + ("torch._scaled_mm available" if cap >= (8, 9)
                                            else "no FP8 tensor cores (needs sm_89+)"))


ENV_PROBE = """
import json, platform, torch
cuda = torch.cuda.is_available()
n = torch.cuda.device_count() if cuda else 0
props = [torch.cuda.get_device_properties(i) for i in range(n)]
try:
    v = torch.cuda.nccl.version() if cuda else None
    nccl = ".".join(map(str, v)) if isinstance(v, tuple) else v
except Exception as e:
    nccl = f"unknown ({type(e).__name__})"
print(json.dumps({"python_version": platform.python_version(), "torch": torch.__version__,
    "cuda": torch.version.cuda, "nccl": nccl, "gpus": [p.name for p in props],
    "gpu_mem_gib": [round(p.total_memory / 2**30, 1) for p in props],
    "capability": list(torch.cuda.get_device_capability(0)) if n else None}))
"""


def _json_line(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


# ----------------------------------------------------------------------------- setup


def section_setup(ctx: Ctx) -> None:
    """zerotrain's needs from the tracked pyproject.toml; what is missing goes into a venv
    that also sees the image's packages (its CUDA torch above all), installed with
    pip -c constraints.txt from --wheels (offline) or the package index, bounded in time:
    no index reachable and no wheels is one clear FAIL, not a hang."""
    rep, a = ctx.rep, ctx.args
    pretend = ["--pretend-missing", *a.pretend_missing] if a.pretend_missing else []
    check = [str(VERIFY / "deps.py"), *pretend]
    code, text = ctx.run([ctx.py, *check], 60)
    info = _json_line(text)
    if info is None:
        rep.add("setup", "dependency check", "FAIL", last_line(text))
        ctx.blocked = "the dependency check failed"
        return
    rep.data["deps"] = info
    if not info["missing"]:
        rep.add("setup", "zerotrain's needs and pytest", "PASS",
                f"all import with {ctx.py}: " + ", ".join(f"{k} {v}" for k, v in
                                                          info["present"].items()))
        return
    missing = info["missing"]
    rep.add("setup", "missing here", "INFO", ", ".join(missing))
    venv = ctx.work / "venv"
    vpy = venv / "bin" / "python"
    if not vpy.exists():
        code, text = ctx.run([ctx.py, "-m", "venv", "--without-pip", str(venv)], 60)
        if code:
            rep.add("setup", "venv", "FAIL", last_line(text))
            ctx.blocked = "missing " + ", ".join(missing)
            return
    # the new venv sees this Python's packages (torch, pip) after its own
    code, text = ctx.run([ctx.py, "-c", "import json, site, sys; print(json.dumps("
                          "[p for p in sys.path if p.endswith(('site-packages', "
                          "'dist-packages'))]))"], 30)
    parents = json.loads(text.strip().splitlines()[-1]) if code == 0 else []
    code, text = ctx.run([str(vpy), "-c", "import site; print(site.getsitepackages()[0])"], 30)
    # addsitedir, not bare paths: the image's own .pth files (namespace packages, editable
    # installs) are processed too
    (Path(text.strip().splitlines()[-1]) / "zz_image_packages.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in parents))
    wheels = a.wheels or os.environ.get("ZEROTRAIN_WHEELS") or (
        str(ROOT / ".whl") if (ROOT / ".whl").is_dir() else None)
    source = (["--no-index", "--find-links", wheels] if wheels else
              ["--timeout", "10", "--retries", "1"])
    pip = [str(vpy), "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
           "--no-cache-dir", "-q", "-c", str(ROOT / "constraints.txt")]
    code, text = ctx.run([*pip, *source, *missing], 150)
    how = f"from {wheels}" if wheels else "from the package index"
    pip_said = "done" if code == 0 else f"exit {code}: {last_line(text)}"
    rep.add("setup", f"pip install {how}", "INFO", pip_said)
    code, text = ctx.run([str(vpy), *check], 60)
    info = _json_line(text) or {"missing": missing}
    if info["missing"]:
        ctx.blocked = "missing " + ", ".join(info["missing"])
        rep.add("setup", "zerotrain's needs and pytest", "FAIL",
                f"still missing: {', '.join(info['missing'])} (pip {how}: {pip_said[:200]})"
                ". Run `bash bench/gpu_check.sh --fetch-wheels` where pip works and "
                "bring .whl/ along (the device tool: carry ['.whl'])")
        return
    code, text = ctx.run([*pip, "--no-deps", "--no-build-isolation", "-e", str(ROOT)], 90)
    rep.add("setup", "the project into the venv (pip install -e ., tracked files)",
            "INFO", "installed" if code == 0 else f"not installed ({last_line(text)[:160]}); "
            "the sections run it from src/ (PYTHONPATH) either way")
    ctx.py = str(vpy)
    rep.add("setup", "zerotrain's needs and pytest", "PASS", f"installed into {venv}")
