"""DeepSpeed's batch triple, precision, ZeRO and monitor sections, as zerotrain's."""

from __future__ import annotations

from typing import Any

from zerotrain.deepspeed_config.offload import offload
from zerotrain.deepspeed_config.reader import Reader, leaves

DS_REDUCE_BUCKET = 500_000_000      # DeepSpeed's reduce_bucket_size default (elements)
DS_PERSISTENCE = 100_000            # stage3_param_persistence_threshold default (elements)
DS_PREFETCH_BUCKET = 50_000_000     # stage3_prefetch_bucket_size default (elements)


def batch(r: Reader, world: int, out: dict[str, Any]) -> bool:
    """The batch triple: any two give the third. Returns whether the world size mattered.

    The global batch is micro × accumulation × the data-parallel size: the ranks of one
    sequence-parallel group (`sequence.parallel`) share a batch, as DeepSpeed counts them."""
    names = ("train_batch_size", "train_micro_batch_size_per_gpu",
             "gradient_accumulation_steps")
    sp = r.zt("sequence.parallel")
    if not (isinstance(sp, int) and sp >= 1 and world % sp == 0):
        sp = 1  # build_config names a bad sequence.parallel
    world //= sp  # from here: the data-parallel size
    tb, mb, ga = (None if r.is_auto(n) else r.get(n, None, int) for n in names)
    for n, v in zip(names, (tb, mb, ga)):
        if v is not None and v < 1:
            r.problem(n, "must be >= 1")
            return False
    if r.is_auto(names[1]) and (tb is None or ga is None) and mb is None:
        mb = r.get(names[1], None, int, auto="data.micro_batch_size")
    if r.is_auto(names[2]) and (tb is None or mb is None) and ga is None:
        ga = r.get(names[2], None, int, auto="data.grad_accum_steps")
    if tb is None and mb is None:
        r.problems.append(f"{names[0]} or {names[1]} is needed (DeepSpeed requires one of "
                          "them; the third of the triple is derived)")
        return False
    if tb is not None and (mb is None or ga is None):
        if mb is None and ga is None:
            ga = 1  # DeepSpeed's rule when only the global batch is given
        known = mb if mb is not None else ga
        if tb % (known * world):
            r.problems.append(f"{names[0]}={tb} is not divisible by "
                              f"{names[1] if mb is not None else names[2]}={known} × "
                              f"{_ranks(world, sp)}; give all three consistently")
            return True
        mb, ga = (mb, tb // (mb * world)) if mb is not None else (tb // (ga * world), ga)
    elif tb is not None and tb != mb * ga * world:
        r.problems.append(f"inconsistent batch: {names[0]}={tb} but {names[1]}={mb} × "
                          f"{names[2]}={ga} × {_ranks(world, sp)} = {mb * ga * world}")
        return True
    for n, v in zip(names, (mb * (ga or 1) * world, mb, ga or 1)):
        if r.is_auto(n) and not any(note.startswith(f"{n}: auto") for note in r.notes):
            r.notes.append(f"{n}: auto -> {v} (derived from the other two)")
    out.setdefault("data", {}).update(micro_batch_size=mb, grad_accum_steps=ga or 1)
    return tb is not None


def _ranks(dp: int, sp: int) -> str:
    """How the batch messages name the rank count the triple multiplies by."""
    if sp > 1:
        return f"data-parallel size {dp} (world size / sequence.parallel {sp})"
    return f"world size {dp}"


def _dtype_choice(r: Reader, path: str, model: str) -> str:
    """DeepSpeed's grad-accumulation / communication dtype -> zerotrain's fp32|compute."""
    v = r.get(path, None, str)
    if v is None:
        return "fp32" if model == "fp32" else "compute"  # DeepSpeed's default: the model dtype
    v = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "half": "fp16"}.get(v, v)
    if v == "fp32":
        return "fp32"
    if v != model:
        r.problem(path, f"zerotrain reduces and accumulates in fp32 or in the model's dtype "
                        f"({model}); use fp32 or {model}")
    return "compute"


def _enabled(r: Reader, path: str, dtypes: tuple[str, ...]) -> bool:
    if not r.is_auto(path):
        return r.get(path, False, bool)
    on = r.zt("precision.dtype") in dtypes
    r.notes.append(f"{path}: auto -> {str(on).lower()} (zerotrain's precision.dtype)")
    return on


def precision(r: Reader, out: dict[str, Any]) -> str:
    fp16 = _enabled(r, "fp16.enabled", ("fp16",))
    bf = "bf16" if "bf16" in r.data or "bfloat16" not in r.data else "bfloat16"  # old name
    bf16 = _enabled(r, f"{bf}.enabled", ("bf16", "bf16-pure"))
    if fp16 and bf16:
        r.problems.append("fp16.enabled and bf16.enabled are both true; enable one")
    dtype = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    prec: dict[str, Any] = {"dtype": dtype}
    prec["grad_accum_dtype"] = _dtype_choice(r, "data_types.grad_accum_dtype", dtype)
    prec["reduce_dtype"] = _dtype_choice(r, "communication_data_type", dtype)
    if fp16:
        static = r.get("fp16.loss_scale", 0.0, float)
        if static < 0:
            r.problem("fp16.loss_scale", "must be 0 (dynamic) or a positive static scale")
        elif static:
            prec["loss_scale"] = {"kind": "static", "init_scale": static}
        else:
            power = r.get("fp16.initial_scale_power", 16, int)
            prec["loss_scale"] = {
                "kind": "dynamic", "init_scale": 2.0**power, "on_min_scale": "error",
                "window": r.get("fp16.loss_scale_window", 1000, int,
                                auto="precision.loss_scale.window"),
                "hysteresis": r.get("fp16.hysteresis", 2, int,
                                    auto="precision.loss_scale.hysteresis"),
                "min_scale": r.get("fp16.min_loss_scale", 1.0, float,
                                   auto="precision.loss_scale.min_scale")}
            for key, zkey, low in (("loss_scale_window", "window", 1), ("hysteresis",
                                   "hysteresis", 1), ("min_loss_scale", "min_scale", 1e-45)):
                if prec["loss_scale"][zkey] < low:  # DeepSpeed refuses these too
                    r.problem(f"fp16.{key}", f"must be {'> 0' if low < 1 else '>= 1'} with "
                                             "dynamic loss scaling")
    elif isinstance(r.data.get("fp16"), dict):  # DeepSpeed reads them only when fp16 is on
        r.used.update(path for path, _ in leaves(r.data["fp16"], "fp16."))
    out["precision"] = prec
    return dtype


def compact_states(r: Reader, out: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's low-precision masters and optimizer states (the bf16 section) as
    precision.master_dtype / master_update and optimizer.state_dtype (returned: the
    optimizer section's part)."""
    bf = "bf16" if "bf16" in r.data or "bfloat16" not in r.data else "bfloat16"
    masters = r.get(f"{bf}.bf16_master_weights_and_grads", False, bool)
    states = r.get(f"{bf}.bf16_optimizer_states", False, bool)
    prec = out["precision"]
    if (masters or states) and prec["dtype"] != "bf16":
        r.problem(f"{bf}.bf16_master_weights_and_grads" if masters
                  else f"{bf}.bf16_optimizer_states", "needs bf16.enabled true")
        return {}
    if masters:
        prec.update(master_dtype="bf16", master_update="plain")
        explicit = "grad_accum_dtype" in (r.data.get("data_types") or {})
        if not explicit:
            prec["grad_accum_dtype"] = "compute"
        r.notes.append(
            f"{bf}.bf16_master_weights_and_grads: true -> precision.master_dtype bf16, "
            "master_update plain (DeepSpeed rounds bf16 masters to nearest; kahan or "
            "stochastic keep the small updates plain loses)"
            + ("" if explicit else ", grad_accum_dtype compute"))
    if states:
        r.notes.append(f"{bf}.bf16_optimizer_states: true -> optimizer.state_dtype bf16 "
                       "(int8 is zerotrain's further step)")
    return {"state_dtype": "bf16"} if states else {}


def zero(r: Reader, out: dict[str, Any], reduce_bytes: int) -> None:
    z = "zero_optimization"
    stage = r.get(f"{z}.stage", 0, int, auto="zero.stage")
    if stage not in (0, 1, 2, 3):
        r.problem(f"{z}.stage", "must be 0, 1, 2 or 3")
        stage = 0
    zero: dict[str, Any] = {"stage": stage}
    if r.is_auto(f"{z}.reduce_bucket_size"):
        zero["bucket_mb"] = r.get(f"{z}.reduce_bucket_size", 0.0, auto="zero.bucket_mb")
    else:
        elements = r.get(f"{z}.reduce_bucket_size", DS_REDUCE_BUCKET, int)
        if elements < 1:
            r.problem(f"{z}.reduce_bucket_size", "must be >= 1 element")
        # DeepSpeed counts elements of the reduced dtype; zerotrain sizes buckets in MiB of
        # the same dtype (zero.bucket_mb · 2^20 / itemsize), so both hold as many elements
        zero["bucket_mb"] = max(elements, 1) * reduce_bytes / 2**20
    zero["overlap"] = r.get(f"{z}.overlap_comm", stage == 3, bool, auto="zero.overlap")
    if stage == 3:
        zero["param_persistence_threshold"] = r.get(
            f"{z}.stage3_param_persistence_threshold", DS_PERSISTENCE, int,
            auto="zero.param_persistence_threshold")
        if r.is_auto(f"{z}.stage3_prefetch_bucket_size"):
            zero["prefetch"] = r.get(f"{z}.stage3_prefetch_bucket_size", True, auto="zero.prefetch")
        else:  # zerotrain prefetches the next unit or nothing: any bucket > 0 means "on"
            zero["prefetch"] = r.get(f"{z}.stage3_prefetch_bucket_size", DS_PREFETCH_BUCKET,
                                     int) > 0
    else:
        for key in ("stage3_param_persistence_threshold", "stage3_prefetch_bucket_size"):
            if r.raw(f"{z}.{key}", None) is not None:
                r.notes.append(f"{z}.{key}: ignored below stage 3 (as DeepSpeed does)")
    zero_plus_plus(r, stage, zero)
    offload(r, stage, zero)
    if stage == 1 and zero.get("offload_optimizer") == "cpu":
        zero["stage"] = 2
        r.notes.append(f"{z}.stage=1 with offload_optimizer cpu: run as zerotrain's ZeRO-2 + "
                       "Offload (DeepSpeed's ZeRO-1 and -2 are one optimizer; with Offload "
                       "both update this rank's shard on the host from the averaged "
                       "gradients: the same updates)")
    out["zero"] = zero


def zero_plus_plus(r: Reader, stage: int, zero: dict[str, Any]) -> None:
    """ZeRO++'s three keys onto zerotrain's three options (ZeRO-3 only, as DeepSpeed's):
    hpZ's group size, qwZ's int8 weights, qgZ's gradients (int4 across nodes, as the
    ZeRO++ paper quantises them)."""
    z = "zero_optimization"
    hpz = r.get(f"{z}.zero_hpz_partition_size", 1, int)
    qw = r.get(f"{z}.zero_quantized_weights", False, bool)
    qg = r.get(f"{z}.zero_quantized_gradients", False, bool)
    for key, on in (("zero_hpz_partition_size", hpz > 1), ("zero_quantized_weights", qw),
                    ("zero_quantized_gradients", qg)):
        if on and stage != 3:
            r.problem(f"{z}.{key}", "is a ZeRO-3 option (ZeRO++); set zero_optimization.stage 3")
    if stage != 3:
        return
    if hpz > 1:
        zero["secondary_partition"] = hpz
    if qw:
        zero["param_wire"] = "int8"
    if qg:
        zero["grad_wire"] = "int4"


def monitors(r: Reader, out: dict[str, Any]) -> None:
    logging: dict[str, Any] = {}
    backends = ["jsonl"]
    for ds_name, ours in (("tensorboard", "tensorboard"), ("wandb", "wandb"),
                          ("csv_monitor", "csv")):
        if r.get(f"{ds_name}.enabled", False, bool):
            backends.append(ours)
    if len(backends) > 1:
        logging["backends"] = backends
    wandb = {k: r.get(f"wandb.{ds}", None, str) for k, ds in
             (("project", "project"), ("entity", "team"), ("group", "group"))}
    if any(v is not None for v in wandb.values()):
        logging["wandb"] = {k: v for k, v in wandb.items() if v is not None}
    if r.data.get("steps_per_print") == float("inf"):  # Accelerate's "never print"
        r.get("steps_per_print", 10, float)
    elif "steps_per_print" in r.data:
        logging["log_every"] = r.get("steps_per_print", 10, int, auto="logging.log_every")
    if logging:
        out["logging"] = logging
