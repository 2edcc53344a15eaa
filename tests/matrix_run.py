"""Run the combination matrix's rows (tests/matrix_plan.py) and hold each against its
reference.

Each row trains a tiny GPT for 3 steps on 2 ranks. Its reference is the same run with
every *placement* option reset — stage 0, no Offload, no parameter tier, the plain wire,
no activation checkpointing, untiled, SP 1, one micro-step — and the options that
define the computation kept (FP8 recipe, document masking, masked labels, Muon). The
data makes every layout see the same global batch with the same number of scored
tokens per row (end-of-document tokens at fixed positions, the prompt masked over the
same columns), so the reference's numbers are what every placement must reproduce.

Tolerances, per option present (the largest applies; `TOL`):
- exact (0): the FP8 wire (bit-identical to plain FP8 by contract), the parameter
  tier, activation checkpointing — the same operations on the same values;
- reduce (1e-5 loss, 1e-4 params, relative): ZeRO stages, Offload, SP, tiles and
  accumulation — the same sums in another order (2 ranks, fp32);
- int8 wires (5e-3, on the loss only): ZeRO++ qwZ quantises every gathered parameter,
  qgZ int8 the gradient sums between nodes — a stated loss (measured after 3 steps:
  ≤ 1.6e-3 for qwZ, ≤ 1.7e-3 for qgZ int8);
- qgZ int4 (3e-2, on the loss only): 15 levels per 256-element block, so each summed
  gradient moves by up to 1/14 of its block's largest (measured: ≤ 1.3e-2);
hpZ (`zero.secondary_partition`) and qgZ (`zero.grad_wire`) run with 2 emulated nodes
(`comm.node_size`): 1 node of 2 for hpZ alone (its group: both ranks), 2 nodes of 1
whenever qgZ is on (it quantises only between nodes; hpZ's group is then one rank);
and each row also equals its *twin* exactly (`twin_row`: the FP8 wire, the tier,
checkpointing and hpZ reset), which pins the bit-identical options beside the others — except
the FP8 wire under the rowwise and delayed recipes, within 1e-6 (`twin_tolerance`).
With FP8 on, tiles, SP and accumulation change which values share an FP8 scale (the
amax of a tile, a slice, a micro-batch), so those runs' reference keeps them and only
the placement proper is reset.
"""

from __future__ import annotations

import tempfile

import torch

from zerotrain.config import ConfigError, build_config, deep_merge
from zerotrain.data.sampler import local_rows

WORLD, GLOBAL, SEQ, VOCAB, EOS, STEPS = 2, 8, 16, 256, 0, 3
EOS_AT = (4, 9)  # every row: the same documents, so every layout scores as many tokens
PROMPT = 3 * SEQ // 4  # masked labels: -100 over the first three quarters

BASE = {
    "model": {
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 32,
        "block_size": SEQ,
        "bias": False,
        "vocab_size": VOCAB,
    },
    "optimizer": {"lr": 1e-2, "grad_clip": 0.3},
    "schedule": {"kind": "constant", "warmup_steps": 0},
    "zero": {"bucket_mb": 0.02},
    "comm": {"algorithm": "native", "check_lockstep": True},
    "train": {"steps": STEPS, "device": "cpu"},
}

#: reset for the reference; with FP8 on, the second group stays (it sets FP8's scales)
PLACEMENT = {
    "stage": 0,
    "offload": "none",
    "tier": "none",
    "wire": "plain",
    "ckpt": False,
    "hpz": None,
    "gwire": "plain",
}
LAYOUT = {"tiles": None, "sp": 1, "accum": 1}
EXACT = ("wire", "tier", "ckpt", "hpz")
TOL = {"exact": 0.0, "reduce": 1e-4, "int8": 5e-3, "int4": 3e-2, "fp8_wire": 1e-6}


def overrides(row: dict, nvme_dir: str | None = None, world: int = WORLD) -> dict:
    """The config sections a row sets (on `world` ranks: the same global batch)."""
    sp, accum = row["sp"], row["accum"]
    data = {
        "micro_batch_size": GLOBAL // (world // sp) // accum,
        "grad_accum_steps": accum,
        "document_mask": row["docmask"],
    }
    if row["docmask"]:
        data["eos_token_id"] = EOS
    zero = {
        "stage": row["stage"],
        "offload_optimizer": row["offload"],
        "offload_param": row["tier"],
    }
    if row["tier"] == "nvme":
        zero["nvme_path"] = nvme_dir or tempfile.mkdtemp(prefix="zt-matrix-")
    fp8 = {"enabled": row["fp8"] != "off", "all_gather": row["wire"] == "fp8"}
    if row["fp8"] != "off":
        fp8["recipe"] = row["fp8"]
    if row["wire"] == "int8":
        zero["param_wire"] = "int8"
    comm = {}
    if row["hpz"] or row["gwire"] != "plain":
        # qgZ quantises only between nodes: with it on, 2 nodes of 1 rank (and hpZ's
        # group is then 1 rank); hpZ alone: 1 node of 2, the group over both ranks
        comm["node_size"] = 1 if row["gwire"] != "plain" else 2
        zero["grad_wire"] = row["gwire"]
        if row["hpz"]:
            zero["secondary_partition"] = comm["node_size"]
    return {
        "comm": comm,
        "data": data,
        "zero": zero,
        "precision": {"fp8": fp8},
        "model": {"activation_checkpointing": row["ckpt"]},
        "sequence": {"tile_tokens": row["tiles"], "parallel": sp},
        "optimizer": {"name": row["optim"]},
    }


def config(row: dict, nvme_dir: str | None = None, world: int = WORLD):
    return build_config(deep_merge(BASE, overrides(row, nvme_dir, world)))


def reference_row(row: dict) -> dict:
    ref = {**row, **PLACEMENT}
    return ref if row["fp8"] != "off" else {**ref, **LAYOUT}


def tolerance(row: dict) -> tuple[str, float]:
    """The tolerance class of `row` against its reference."""
    ref = reference_row(row)
    changed = [f for f in row if row[f] != ref[f]]
    if row["gwire"] == "int4":
        return "int4", TOL["int4"]
    if "int8" in (row["wire"], row["gwire"]):
        return "int8", TOL["int8"]
    if any(f not in EXACT for f in changed):
        return "reduce", TOL["reduce"]
    return "exact", TOL["exact"]


def global_batch(step: int, row: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step % 2)
    xy = torch.randint(1, VOCAB, (GLOBAL, SEQ + 1), generator=g)
    xy[:, list(EOS_AT)] = EOS
    x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
    if row["labels"] == "masked":
        y[:, :PROMPT] = -100
    return x, y


def train_row(row: dict, nvme_dir: str | None = None) -> dict:
    """3 steps of `row` on this process group; the losses, grad norms, final parameters
    (in full) and the memory audit's verdict."""
    from zerotrain.comm.dist import world
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT

    rank, n = world()
    cfg = config(row, nvme_dir, n)
    torch.manual_seed(0)
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    sp, accum, b = row["sp"], row["accum"], cfg.data.micro_batch_size
    losses, norms = [], []
    try:
        for step in range(STEPS):
            X, Y = global_batch(step, row)
            total = 0.0
            for m in range(accum):
                rows = local_rows(m, rank // sp, n // sp, b)
                loss = eng(X[rows], Y[rows])
                eng.backward(loss)
                info = eng.step()
                total += loss.item()
            mean = eng.comm.all_reduce_scalars([total / accum])[0] / n
            losses.append(float(mean))
            norms.append(float(info.grad_norm))
        with eng.full_parameters():
            params = {k: p.detach().float().clone() for k, p in eng.module.named_parameters()}
        audit = memory_audit(eng, cfg, n, b)
    finally:
        eng.close()
    return {"losses": losses, "norms": norms, "params": params, "audit": audit}


def memory_audit(eng, cfg, world: int, micro: int) -> str | None:
    """None when the engine's own memory prediction (`Engine.memory_phases`) and
    `zerotrain estimate`'s (`predict_peaks`) agree phase by phase for this run, else
    what differs."""
    from zerotrain.cli.estimate import predict_peaks
    from zerotrain.memory import config_activations

    act = config_activations(cfg, micro, SEQ, device="cpu").peak
    got = eng.memory_phases(activations=act)["predicted"]
    want = predict_peaks(
        cfg,
        world,
        cfg.zero.stage,
        cfg.zero.offload_optimizer,
        device="cpu",
        micro_batch=micro,
        seq=SEQ,
        offload_param=cfg.zero.offload_param,
    )
    bad = {k: (v, want["phases"].get(k)) for k, v in got.items() if want["phases"].get(k) != v}
    if want["buffer_numels"] != eng.strategy.buffer_numels():
        bad["buffer_numels"] = (eng.strategy.buffer_numels(), want["buffer_numels"])
    return None if not bad else f"engine vs estimate: {bad}"


def twin_row(row: dict) -> dict:
    """`row` with the options that must not change a bit reset (the FP8 wire, the
    parameter tier, activation checkpointing): its numbers must equal the row's exactly."""
    return {
        **row,
        "tier": "none",
        "ckpt": False,
        "hpz": None,
        "wire": "plain" if row["wire"] == "fp8" else row["wire"],
    }


def twin_tolerance(row: dict) -> float:
    """0 (bit-identical), except the FP8 wire under the rowwise and delayed recipes.
    The wire sends each weight with one current scale; the layer re-quantises that copy.
    Under tensorwise it picks the wire's own power-of-two scale and loses nothing. Under
    rowwise it picks a scale per row from the copy's row amax, and under delayed it
    records the copy's amax in its history — each a rounded amax, which can cross a
    power of two where the original's does not, and move E4M3/E5M2 underflow by an ulp
    (measured: ≤ 5e-8 relative after 3 steps, in the embeddings' gradients)."""
    return TOL["fp8_wire"] if row["wire"] == "fp8" and row["fp8"] != "tensorwise" else 0.0


def _train_or_error(row: dict, nvme: str) -> dict:
    try:
        return train_row(row, nvme)
    except Exception as e:  # the matrix reports it; the caller fails the row
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"}


def run_rows(rows: list[dict], twins: bool | str = True) -> list[dict]:
    """Every row, each distinct reference and (twins True, or "fp8": only for rows with
    the FP8 wire) each row's exact twin, on this process group (one set of ranks:
    spawning is the slow part). A row whose engine raises reports the error's line."""
    done: dict[tuple, dict] = {}
    nvme = tempfile.mkdtemp(prefix="zt-matrix-")  # one per rank: its own files

    def get(r: dict) -> dict:
        key = tuple(r.values())
        if key not in done:
            done[key] = _train_or_error(r, nvme)
        return done[key]

    out = []
    for row in rows:
        res = {"ref": get(reference_row(row)), "run": get(row)}
        twin = twin_row(row)
        if twin != row and (twins is True or (twins == "fp8" and row["wire"] == "fp8")):
            res["twin"] = get(twin)
        out.append(res)
    return out


def deviation(res: dict, ref: dict, losses_only: bool = False) -> float:
    """Worst relative difference: per-step loss and grad norm, per-tensor parameters
    (`losses_only`: the loss alone — after a lossy wire, Adam's first steps, ±lr per
    element whatever the gradient's size, turn small gradient noise into large
    parameter differences)."""
    devs = [abs(a - b) / abs(b) for a, b in zip(res["losses"], ref["losses"], strict=True)]
    if losses_only:
        return max(devs)
    devs += [
        abs(a - b) / max(abs(b), 1e-30) for a, b in zip(res["norms"], ref["norms"], strict=True)
    ]
    devs += [float((res["params"][k] - v).norm() / v.norm()) for k, v in ref["params"].items()]
    return max(devs) if all(d == d for d in devs) else float("inf")


def refusal(row: dict) -> str | None:
    """The config's one-line refusal of `row`, or None when it builds."""
    try:
        config(row, "/tmp")
    except ConfigError as e:
        return str(e).strip()
    return None


def judge(row: dict, result: dict) -> dict:
    """One row's verdict: settings, reference, tolerance, deviation, twin, audit, ok."""
    ref = reference_row(row)
    kind, tol = tolerance(row)
    out = {
        "settings": row,
        "reference": {f: v for f, v in ref.items() if v != row[f]},
        "tolerance": kind,
        "tol": tol,
    }
    run, base = result["run"], result["ref"]
    err = run.get("error") or base.get("error") or result.get("twin", {}).get("error")
    if err:
        return {**out, "error": err, "ok": False}
    dev = deviation(run, base, losses_only=kind in ("int8", "int4"))
    finite = all(n == n and abs(n) != float("inf") for n in run["norms"])
    ok = finite and dev <= tol and run["audit"] is None
    if "twin" in result:
        out["twin"] = {f: v for f, v in twin_row(row).items() if v != row[f]}
        out["twin_deviation"] = deviation(run, result["twin"])
        out["twin_tol"] = twin_tolerance(row)
        ok = ok and out["twin_deviation"] <= out["twin_tol"]
    return {**out, "deviation": dev, "audit": run["audit"], "ok": ok}


#: refusals outside the factor grid: the wire's two spellings (zero.param_wire fp8 is
#: precision.fp8.all_gather's alias), each with the settings its line must name
ALIAS_REFUSALS = [
    (
        {
            "zero": {"stage": 3, "param_wire": "int8"},
            "precision": {"fp8": {"enabled": True, "all_gather": True}},
        },
        ("precision.fp8.all_gather", "zero.param_wire"),
    ),
    ({"zero": {"stage": 3, "param_wire": "fp8"}}, ("zero.param_wire", "precision.fp8")),
    (
        {"zero": {"stage": 2, "param_wire": "fp8"}, "precision": {"fp8": {"enabled": True}}},
        ("zero.param_wire", "zero.stage"),
    ),
]


def alias_refusals() -> list[dict]:
    """Each ALIAS_REFUSALS config: refused at config time in one line naming both."""
    out = []
    for over, names in ALIAS_REFUSALS:
        try:
            build_config(deep_merge(BASE, over))
            msg = None
        except ConfigError as e:
            msg = str(e).strip()
        ok = msg is not None and "\n" not in msg and all(n in msg for n in names)
        out.append({"pair": list(names), "config": over, "refusal": msg, "ok": ok})
    return out
