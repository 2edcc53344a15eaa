"""DeepSpeed configs mapped onto zerotrain's, field by field: the example configs under
tests/data/ds, the batch triple, "auto", refusals, YAML, and telling configs apart.
(The lr curves are held against DeepSpeed's formulas in test_deepspeed_schedule.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from ds_reference import curve, ds_warmup_decay_lr
from zerotrain.config import Config, ConfigError, build_config
from zerotrain.deepspeed_config import (
    deepspeed_to_yaml,
    from_deepspeed,
    load_any_config,
    load_deepspeed_config,
    looks_like_deepspeed,
    map_deepspeed,
)
from zerotrain.optim.schedule import lr_from_config

DS = Path(__file__).parent / "data" / "ds"
MiB = 2**20


def field(cfg: Config, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return list(obj) if isinstance(obj, tuple) else obj


def expect(cfg: Config, want: dict) -> None:
    """Each dotted zerotrain field equals its expected value (floats to 1e-12 relative)."""
    for dotted, value in want.items():
        got = field(cfg, dotted)
        if isinstance(value, float):
            assert got == pytest.approx(value, rel=1e-12), dotted
        else:
            assert got == value, dotted


# ----------------------------------------------------------------------------- example files


def test_stage0_fp32_warmuplr():
    cfg = load_deepspeed_config(DS / "stage0_fp32_warmuplr.json", world_size=2)
    expect(cfg, {
        "data.micro_batch_size": 8, "data.grad_accum_steps": 2, "zero.stage": 0,
        "zero.overlap": False, "zero.bucket_mb": 5e8 * 4 / MiB,  # fp32: 4-byte elements
        "precision.dtype": "fp32", "precision.reduce_dtype": "fp32",
        "optimizer.name": "adamw",  # DeepSpeed's Adam: adam_w_mode defaults to true
        "optimizer.lr": 6e-4, "optimizer.betas": [0.9, 0.95], "optimizer.eps": 1e-8,
        "optimizer.weight_decay": 0.1, "optimizer.decay_1d": True,
        "optimizer.grad_clip": 1.0,  # DeepSpeed's documented default
        "schedule.kind": "constant", "schedule.warmup_steps": 50,
        "schedule.warmup_type": "log", "schedule.warmup_start_lr": 1e-5,
        "logging.log_every": 25, "logging.backends": ["jsonl"],
    })


def test_stage1_bf16_warmupdecay_world4():
    cfg = load_deepspeed_config(DS / "stage1_bf16_warmupdecay.json", world_size=4)
    expect(cfg, {
        "data.micro_batch_size": 4, "data.grad_accum_steps": 4,  # 64 / (4 × 4)
        "zero.stage": 1, "zero.overlap": True,
        "zero.bucket_mb": 20_000_000 * 2 / MiB,  # bf16 reduction: 2-byte elements
        "precision.dtype": "bf16",
        # DeepSpeed accumulates and communicates in the model dtype unless told otherwise
        "precision.grad_accum_dtype": "compute", "precision.reduce_dtype": "compute",
        "optimizer.name": "adamw", "optimizer.lr": 3e-4,  # warmup_max_lr overrides params.lr
        "optimizer.betas": [0.9, 0.999], "optimizer.eps": 1e-8, "optimizer.weight_decay": 0.05,
        "optimizer.grad_clip": 0.5,
        "schedule.kind": "linear", "schedule.warmup_steps": 40, "schedule.warmup_type": "linear",
        "schedule.min_lr": 0.0, "schedule.decay_steps": 360, "train.steps": 400,
    })
    notes = map_deepspeed(DS / "stage1_bf16_warmupdecay.json", 4).notes
    assert any("allgather_bucket_size: ignored" in n for n in notes)
    assert any("overrides it" in n for n in notes)  # params.lr 1e-3 vs warmup_max_lr


def test_stage2_fp16_dynamic_scale_offload_cosine():
    cfg = load_deepspeed_config(DS / "stage2_fp16_offload_cosine.json", world_size=2)
    expect(cfg, {
        "data.micro_batch_size": 4, "data.grad_accum_steps": 4,  # 32 / (4 × 2)
        "zero.stage": 2, "zero.offload_optimizer": "cpu", "zero.overlap": False,
        "zero.bucket_mb": 50_000_000 * 2 / MiB,
        "precision.dtype": "fp16", "precision.loss_scale.kind": "dynamic",
        "precision.loss_scale.init_scale": 2.0**12, "precision.loss_scale.window": 500,
        "precision.loss_scale.hysteresis": 3, "precision.loss_scale.min_scale": 2.0,
        "optimizer.name": "adam",  # adam_w_mode false: weight decay as L2
        "optimizer.lr": 2e-4, "optimizer.weight_decay": 0.0,
        "schedule.kind": "cosine", "schedule.warmup_steps": 30, "schedule.warmup_type": "log",
        "schedule.warmup_start_lr": 0.1 * 2e-4, "schedule.min_lr": 0.05 * 2e-4,
        "schedule.decay_start": 29, "schedule.decay_steps": 270, "train.steps": 300,
        "logging.backends": ["jsonl", "tensorboard"],
    })


def test_stage3_persistence_prefetch_lion_monitors():
    cfg = load_deepspeed_config(DS / "stage3_bf16_cosine_linear.json", world_size=8)
    expect(cfg, {
        "data.micro_batch_size": 2, "data.grad_accum_steps": 1,
        "zero.stage": 3, "zero.overlap": True,  # DeepSpeed's default at stage 3
        "zero.param_persistence_threshold": 4096,
        "zero.prefetch": False,  # stage3_prefetch_bucket_size 0: no prefetch
        "zero.bucket_mb": 5e8 * 4 / MiB,  # communication_data_type fp32: 4-byte elements
        "precision.dtype": "bf16", "precision.reduce_dtype": "fp32",
        "precision.grad_accum_dtype": "fp32",
        "optimizer.name": "lion", "optimizer.lr": 1e-4, "optimizer.betas": [0.95, 0.98],
        "optimizer.weight_decay": 1.0,
        "schedule.kind": "cosine", "schedule.warmup_type": "linear",
        "schedule.warmup_start_lr": 0.0, "schedule.min_lr": 1e-4 * 1e-4,  # cos_min_ratio
        "logging.backends": ["jsonl", "wandb", "csv"],
        "logging.wandb.project": "migrated", "logging.wandb.group": "ablation",
        "logging.wandb.entity": "lab",
    })


def test_stage3_defaults_follow_deepspeed():
    cfg = load_deepspeed_config({"train_micro_batch_size_per_gpu": 1,
                                 "zero_optimization": {"stage": 3}})
    expect(cfg, {"zero.param_persistence_threshold": 100_000, "zero.prefetch": True,
                 "zero.overlap": True, "schedule.kind": "constant",
                 "schedule.warmup_steps": 0})


def test_fp16_static_scale_sgd_and_clipping_off():
    cfg = load_deepspeed_config(DS / "fp16_static_sgd.json", world_size=4)
    expect(cfg, {
        "data.micro_batch_size": 4, "data.grad_accum_steps": 1,  # only the global batch
        "precision.dtype": "fp16", "precision.loss_scale.kind": "static",
        "precision.loss_scale.init_scale": 128.0,
        "optimizer.name": "sgd", "optimizer.lr": 0.05, "optimizer.momentum": 0.9,
        "optimizer.nesterov": True, "optimizer.grad_clip": 0.0,
    })


def test_muon_maps_to_one_lr_and_the_original_lr_scaling():
    cfg = load_deepspeed_config(DS / "muon_stage0.json")
    expect(cfg, {"optimizer.name": "muon", "optimizer.muon_adjust_lr": "original",
                 "optimizer.lr": 0.02, "optimizer.momentum": 0.9,
                 "optimizer.weight_decay": 0.01, "optimizer.betas": [0.9, 0.95],
                 "optimizer.eps": 1e-10, "zero.stage": 0})
    with pytest.raises(ConfigError, match=r"lr 0\.02 and the AdamW fallback at 0\.0003"):
        from_deepspeed({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Muon"}})


def test_torch_adamw_takes_torch_default_weight_decay():
    ds = {"train_micro_batch_size_per_gpu": 1,
          "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    assert load_deepspeed_config(ds).optimizer.weight_decay == 0.01
    ds["optimizer"]["params"] = {}
    assert load_deepspeed_config(ds).optimizer.weight_decay == 0.0  # FusedAdam's


def test_no_optimizer_section_keeps_zerotrain_optimizer():
    m = map_deepspeed({"train_micro_batch_size_per_gpu": 1})
    cfg = build_config(m.config)
    assert cfg.optimizer.name == "adamw" and cfg.schedule.kind == "constant"
    assert any(n.startswith("optimizer: none") for n in m.notes)


# ----------------------------------------------------------------------------- batch triple


@pytest.mark.parametrize("given,world,micro,accum", [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 2, 4, 8),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 4, 8, 2),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 7, 3, 5),
    ({"train_batch_size": 48}, 3, 16, 1),
    ({"train_micro_batch_size_per_gpu": 6}, 5, 6, 1),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 3}, 4, 2, 3),
])
def test_batch_triple_any_two(given, world, micro, accum):
    cfg = load_deepspeed_config(given, world_size=world)
    assert (cfg.data.micro_batch_size, cfg.data.grad_accum_steps) == (micro, accum)
    global_batch = given.get("train_batch_size")
    if global_batch is not None:
        assert micro * accum * world == global_batch


def test_inconsistent_triple_names_all_three_and_world():
    with pytest.raises(ConfigError) as e:
        from_deepspeed(DS / "inconsistent_triple.json", world_size=2)
    msg = str(e.value)
    for part in ("train_batch_size=64", "train_micro_batch_size_per_gpu=4",
                 "gradient_accumulation_steps=4", "world size 2", "= 32"):
        assert part in msg


def test_world_size_from_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert from_deepspeed({"train_batch_size": 64})["data"]["micro_batch_size"] == 8
    with pytest.raises(ConfigError, match="not divisible"):
        from_deepspeed({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4})


def test_missing_batch_is_refused():
    with pytest.raises(ConfigError, match="train_batch_size or train_micro_batch_size_per_gpu"):
        from_deepspeed({"gradient_accumulation_steps": 2})


# ----------------------------------------------------------------------------- auto, errors


def test_hf_auto_values_take_zerotrain_defaults():
    m = map_deepspeed(DS / "hf_auto.json", world_size=2)
    cfg, d = build_config(m.config), Config()
    expect(cfg, {
        "data.micro_batch_size": d.data.micro_batch_size, "data.grad_accum_steps": 1,
        "precision.dtype": "fp32",  # fp16/bf16 auto: zerotrain's dtype, fp32
        "optimizer.lr": d.optimizer.lr, "optimizer.betas": list(d.optimizer.betas),
        "optimizer.eps": d.optimizer.eps, "optimizer.weight_decay": d.optimizer.weight_decay,
        "optimizer.grad_clip": d.optimizer.grad_clip,
        "zero.stage": 3, "zero.bucket_mb": d.zero.bucket_mb, "zero.prefetch": d.zero.prefetch,
        "zero.param_persistence_threshold": d.zero.param_persistence_threshold,
        "schedule.kind": "linear", "schedule.warmup_steps": d.schedule.warmup_steps,
        "train.steps": d.train.steps, "logging.log_every": 2000,
    })
    autos = [n for n in m.notes if ": auto -> " in n]
    assert len(autos) == 17  # every "auto" in the file is accounted for


def test_auto_values_take_overrides():
    over = {"precision": {"dtype": "bf16"}, "optimizer": {"lr": 5e-5},
            "train": {"steps": 200}, "data": {"micro_batch_size": 2},
            "schedule": {"warmup_steps": 20}}
    cfg = load_deepspeed_config(DS / "hf_auto.json", world_size=2, overrides=over)
    expect(cfg, {"precision.dtype": "bf16", "precision.reduce_dtype": "compute",
                 "optimizer.lr": 5e-5, "train.steps": 200, "data.micro_batch_size": 2,
                 "schedule.warmup_steps": 20, "schedule.decay_steps": 180})
    steps = range(0, 220)
    want = [ds_warmup_decay_lr(s, 0.0, 5e-5, 20, 200, "log") for s in steps]
    assert curve(cfg, steps) == pytest.approx(want, rel=1e-12, abs=1e-18)
    cli = load_deepspeed_config(DS / "hf_auto.json", 2, ["--optimizer.lr", "5e-5"])
    assert cli.optimizer.lr == 5e-5


def test_unresolvable_auto_is_refused_by_name():
    with pytest.raises(ConfigError) as e:
        from_deepspeed({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "auto"},
                        "scheduler": {"type": "WarmupCosineLR", "params": {
                            "total_num_steps": 100, "cos_min_ratio": "auto"}}})
    assert 'optimizer.type="auto"' in str(e.value)
    assert 'scheduler.params.cos_min_ratio="auto"' in str(e.value)


def test_unsupported_keys_are_listed_together():
    with pytest.raises(ConfigError) as e:
        from_deepspeed(DS / "unsupported.json")
    msg = str(e.value)
    assert "\n" not in msg and "6 setting(s)" in msg
    for key in ("optimizer.params.amsgrad=true", "fp16.consecutive_hysteresis=true",
                "zero_optimization.zero_quantized_nontrainable_weights=true",
                "zero_optimisation.stage=2", "did you mean 'zero_optimization'",
                "progressive_layer_drop.enabled=true", 'sparse_attention.mode="fixed"'):
        assert key in msg, key
    assert "flops_profiler" not in msg  # disabled: nothing of it runs
    assert "offload" not in msg  # ZeRO-3 with params on cpu, optimizer on nvme: mapped


@pytest.mark.parametrize("ds,match", [
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage=true: must be an integer"),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
     "offload_optimizer.device=\"cpu\": zerotrain offloads from ZeRO stage 2"),
    ({"optimizer": {"type": "Lamb"}}, 'optimizer.type="Lamb": zerotrain maps Adam'),
    ({"scheduler": {"type": "OneCycle"}}, 'scheduler.type="OneCycle"'),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}},
     "total_num_steps is required"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10,
                                                         "total_num_steps": 10}}},
     "must exceed the warmup"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both true"),
    ({"bf16": {"enabled": True}, "communication_data_type": "fp16"}, "use fp32 or bf16"),
    ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, "gradient_clipping"),
    ({"optimizer": {"type": "Adam", "params": {"momentum": 0.9}}},
     "optimizer.params.momentum=0.9: not a parameter of optimizer type Adam"),
    ({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 9}}},
     "total_num_steps=9: not a parameter of scheduler type WarmupLR"),
    ({"zero_optimization": {"overlap_com": True}}, "did you mean 'zero_optimization.overlap_comm'"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale=0: must be > 0"),
])
def test_refusals_name_the_key(ds, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        from_deepspeed({"train_micro_batch_size_per_gpu": 1, **ds})


def test_stage3_keys_below_stage3_are_noted_not_refused():
    m = map_deepspeed({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 2, "stage3_param_persistence_threshold": 10}})
    assert "param_persistence_threshold" not in m.config["zero"]
    assert any("ignored below stage 3" in n for n in m.notes)


def test_invalid_mapped_config_is_one_zerotrain_error():
    with pytest.raises(ConfigError, match=r"maps to an invalid zerotrain config: .*warmup"):
        load_deepspeed_config({"train_micro_batch_size_per_gpu": 1,
                               "zero_optimization": {"stage": 2}},
                              overrides={"train": {"steps": 2}, "schedule": {"warmup_steps": 5}})
    # Muon under ZeRO-2 is a valid mapping (distributed Muon, zero/muon.py)
    cfg = load_deepspeed_config({"train_micro_batch_size_per_gpu": 1,
                                 "zero_optimization": {"stage": 2},
                                 "optimizer": {"type": "Muon", "params": {"lr": 0.02}}})
    assert (cfg.optimizer.name, cfg.zero.stage) == ("muon", 2)


# ----------------------------------------------------------------------------- offload tiers


def _zero3(**sections) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, **sections}}


def test_zero_infinity_nvme_example():
    """DeepSpeed 0.19.8's keys: offload_{param,optimizer} on nvme and the aio section."""
    m = map_deepspeed(DS / "stage3_infinity_nvme.json", world_size=4)
    cfg = build_config(m.config)
    expect(cfg, {
        "zero.stage": 3, "zero.offload_param": "nvme", "zero.offload_optimizer": "nvme",
        "zero.nvme_path": "/local_nvme",
        "zero.offload_prefetch": 2,  # buffer_count 3 = the unit in use + 2 read ahead
        "zero.nvme_block_mb": 4.0,  # aio.block_size 4194304 bytes
        "zero.nvme_threads": 4,  # aio.intra_op_parallelism
        "zero.prefetch": True, "data.micro_batch_size": 4, "data.grad_accum_steps": 2,
    })
    notes = "\n".join(m.notes)
    for key, verdict in [("offload_param.pin_memory", "honoured"),
                         ("offload_optimizer.pin_memory", "honoured"),
                         ("offload_param.buffer_count", "3 -> zero.offload_prefetch 2"),
                         ("offload_param.buffer_size", "ignored"),
                         ("offload_param.max_in_cpu", "ignored"),
                         ("offload_optimizer.buffer_count", "ignored"),
                         ("offload_optimizer.fast_init", "ignored"),
                         ("aio.queue_depth", "ignored"), ("aio.single_submit", "ignored"),
                         ("aio.overlap_events", "ignored"), ("aio.use_gds", "ignored")]:
        assert re.search(rf"{re.escape(key)}: {re.escape(verdict)}", notes), key
    assert "ratio" not in notes  # at DeepSpeed's default 1.0: nothing to say


def test_offload_defaults_are_deepspeeds():
    """Absent keys take DeepSpeed's defaults: buffer_count 5 (nvme), aio block 1 MiB and
    one thread; cpu parameters follow stage3_prefetch_bucket_size; pin_memory false is
    named as ignored."""
    m = map_deepspeed(_zero3(offload_param={"device": "nvme", "nvme_path": "/d"}))
    z = build_config(m.config).zero
    assert (z.offload_param, z.offload_optimizer, z.offload_prefetch, z.nvme_block_mb,
            z.nvme_threads) == ("nvme", "none", 4, 1.0, 1)
    cpu = map_deepspeed(_zero3(offload_param={"device": "cpu", "pin_memory": False,
                                              "buffer_count": 9},
                               stage3_prefetch_bucket_size=0))
    assert cpu.config["zero"]["offload_param"] == "cpu"
    assert cpu.config["zero"]["offload_prefetch"] == 0 and not cpu.config["zero"]["prefetch"]
    assert any(n.startswith("zero_optimization.offload_param.pin_memory: ignored (zerotrain "
                            "pins") for n in cpu.notes)
    assert any("buffer_count: ignored (DeepSpeed reads it with device nvme only)" in n
               for n in cpu.notes)
    assert "offload_prefetch" not in map_deepspeed(_zero3(offload_param={"device": "cpu"})
                                                   ).config["zero"]  # zerotrain's 1
    for count, ahead in ((1, 0), (0, 0), (20, 8)):
        got = map_deepspeed(_zero3(offload_param={"device": "nvme", "nvme_path": "/d",
                                                  "buffer_count": count}))
        assert got.config["zero"]["offload_prefetch"] == ahead, count


def test_aio_without_nvme_is_noted_not_mapped():
    m = map_deepspeed({"train_micro_batch_size_per_gpu": 1,
                       "zero_optimization": {"stage": 2, "offload_optimizer": {
                           "device": "cpu", "nvme_path": "/d"}},
                       "aio": {"block_size": 2**30, "thread_count": 3, "queue_depth": 4}})
    z = m.config["zero"]
    assert z["offload_optimizer"] == "cpu"
    assert not {"nvme_path", "nvme_block_mb", "nvme_threads"} & set(z)
    for key in ("aio.block_size: ignored (no nvme tier", "aio.thread_count: ignored (no nvme",
                "offload_optimizer.nvme_path: ignored (offload_optimizer.device is cpu",
                "aio.queue_depth: ignored"):
        assert any(key in n for n in m.notes), key
    old = map_deepspeed(_zero3(offload_optimizer={"device": "nvme", "nvme_path": "/d"}),
                        overrides=None)
    assert old.config["zero"]["nvme_threads"] == 1
    named = map_deepspeed({**_zero3(offload_optimizer={"device": "nvme", "nvme_path": "/d"}),
                           "aio": {"thread_count": 6}})
    assert named.config["zero"]["nvme_threads"] == 6  # the older releases' name


@pytest.mark.parametrize("zero,match", [
    ({"stage": 2, "offload_param": {"device": "cpu"}},
     'offload_param.device="cpu": parameters are offloaded at ZeRO stage 3 only'),
    ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/d"}},
     'offload_optimizer.device="nvme": zerotrain keeps optimizer states on NVMe at ZeRO '
     "stage 3 only"),
    ({"stage": 3, "offload_param": {"device": "gpu"}},
     'offload_param.device="gpu": must be none, cpu or nvme'),
    ({"stage": 3, "offload_param": {"device": "nvme"}},
     'offload_param.device="nvme": device nvme needs zero_optimization.offload_param.nvme_path'),
    ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/a"},
      "offload_optimizer": {"device": "nvme", "nvme_path": "/b"}},
     'offload_optimizer.nvme_path="/b" and zero_optimization.offload_param.nvme_path="/a": '
     "zerotrain keeps both nvme tiers under one directory"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
     "offload_optimizer.ratio=0.5: zerotrain supports only DeepSpeed's default 1.0"),
    ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/d", "buffer_count": -1}},
     "offload_param.buffer_count=-1: must be >= 0"),
])
def test_offload_refusals_name_the_key(zero, match):
    with pytest.raises(ConfigError) as e:
        from_deepspeed({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero})
    assert match in str(e.value) and "1 setting(s)" in str(e.value)


def test_aio_thread_names_must_agree():
    with pytest.raises(ConfigError, match="1 setting.*intra_op_parallelism and "
                                          r"aio.thread_count \(its older name\) differ"):
        from_deepspeed({**_zero3(offload_param={"device": "nvme", "nvme_path": "/d"}),
                        "aio": {"intra_op_parallelism": 2, "thread_count": 4}})


# ----------------------------------------------------------------------------- YAML, loading


@pytest.mark.parametrize("name", [*sorted(p.name for p in DS.glob("stage*.json")),
                                  "fp16_static_sgd.json", "hf_auto.json", "muon_stage0.json"])
def test_yaml_reloads_to_the_same_config(name):
    text = deepspeed_to_yaml(DS / name, world_size=4)
    assert text.startswith(f"# zerotrain config mapped from DeepSpeed config '{DS / name}'")
    assert build_config(yaml.safe_load(text)) == load_deepspeed_config(DS / name, 4)


def test_load_any_config_tells_the_kinds_apart(tmp_path):
    ours = tmp_path / "config.json"  # what `zerotrain train` writes into a run folder
    ours.write_text(json.dumps(Config().to_dict()))
    assert load_any_config(ours) == Config()
    assert load_any_config(DS / "muon_stage0.json").optimizer.name == "muon"
    assert load_any_config({"train_batch_size": 8}, world_size=2).data.micro_batch_size == 4
    assert not looks_like_deepspeed({"optimizer": {"name": "lion"}, "checkpoint": {"every": 5}})
    assert looks_like_deepspeed({"optimizer": {"type": "Adam"}})
    cfg = Config()
    assert load_any_config(cfg) is cfg


def test_library_mode_trains_at_constant_lr():
    lib, cli = load_any_config(None), build_config({})
    assert [lr_from_config(s, lib.schedule, lib.optimizer.lr, lib.train.steps)
            for s in (0, 1, 500, 999)] == [lib.optimizer.lr] * 4
    assert cli.schedule.kind == "cosine" and cli.schedule.warmup_steps == 100
    assert lr_from_config(0, cli.schedule, cli.optimizer.lr, cli.train.steps) == 0.0
    # what the user configures still wins, field by field
    lib = load_any_config({"optimizer": {"lr": 1e-5}, "schedule": {"kind": "cosine"}})
    assert lib.schedule.kind == "cosine" and lib.schedule.warmup_steps == 0
    assert lib.schedule.min_lr == 0.0  # below any peak, unlike the CLI default 1e-4
    assert build_config({}, library=True) == load_any_config({})


