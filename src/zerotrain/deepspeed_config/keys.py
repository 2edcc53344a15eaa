"""What zerotrain makes of the DeepSpeed keys it does not map to a field of its own.

Three lists, each with the reason a user will read:
- ONLY_DEFAULT: fine at DeepSpeed's default value; any other value would make DeepSpeed
  compute something zerotrain does not, so it is refused;
- IGNORED: tunes DeepSpeed's own speed, memory or files, never what is computed; accepted
  at any value and named in the mapping's notes (a dotted prefix covers its subtree);
- FEATURES: optional DeepSpeed features, switched by their `enabled` key; a disabled one
  is skipped whole, an enabled one is refused.
Keys in none of them and not read by the mapping are refused as unknown.
"""

from __future__ import annotations

from typing import Any

_Z = "zero_optimization."
_OFF = "zerotrain has no such mode"

ONLY_DEFAULT: dict[str, tuple[Any, str]] = {
    "sparse_gradients": (False, "zerotrain's gradients are dense"),
    "disable_allgather": (False, "ZeRO stages 1-2 all-gather the updated weights"),
    "fp16.auto_cast": (False, "zerotrain casts by precision.dtype, inputs are token ids"),
    "fp16.consecutive_hysteresis": (False, "zerotrain refills hysteresis when the scale "
                                           "changes, not on every clean step"),
    "fp16.fp16_master_weights_and_grads": (False, "master weights are fp32"),
    "bf16.immediate_grad_update": (False, _OFF),
    "bf16.check_grad_overflow": (True, "zerotrain always skips a step with non-finite "
                                       "gradients"),
    _Z + "reduce_scatter": (True, "gradients are always reduce-scattered from stage 1"),
    _Z + "allgather_partitions": (True, _OFF),
    _Z + "load_from_fp32_weights": (True, "checkpoints always restore the fp32 masters"),
    _Z + "ignore_unused_parameters": (True, _OFF),
    _Z + "cpu_offload": (False, "use zero_optimization.offload_optimizer.device cpu"),
    _Z + "cpu_offload_param": (False, "use zero_optimization.offload_param.device cpu"),
    _Z + "offload_optimizer.ratio": (1.0, "zerotrain offloads the whole optimizer (a ratio "
                                          "below 1 keeps a part of it on the device)"),
    _Z + "zero_quantized_nontrainable_weights": (False, _OFF),
    _Z + "mics_shard_size": (-1, "MiCS sub-group sharding: " + _OFF),
    _Z + "mics_hierarchical_params_gather": (False, _OFF),
    _Z + "stage3_module_granularity_threshold": (0, "ZeRO-3 units come from the model's plan"),
    _Z + "stage3_use_all_reduce_for_fetch_params": (False, _OFF),
    "optimizer.params.amsgrad": (False, "zerotrain's Adam has no AMSGrad variant"),
    "optimizer.params.bias_correction": (True, "zerotrain's Adam always corrects bias"),
    "optimizer.params.maximize": (False, _OFF),
    "optimizer.params.centered": (False, "zerotrain's RMSprop is not centered"),
    "optimizer.params.initial_accumulator_value": (0, "zerotrain's AdaGrad starts at 0"),
    "optimizer.params.fp32_optimizer_states": (True, "optimizer states are fp32"),
    "scheduler.params.last_batch_iteration": (-1, "a resumed run takes its step from the "
                                                  "checkpoint (--resume)"),
}

_SAME_MATH = "zerotrain divides by accumulation × world size in the loss, before backward"
_WHERE = "zerotrain writes trackers under logging.run_dir"

IGNORED: dict[str, str] = {
    "wall_clock_breakdown": "zerotrain logs step time and tokens/s every log_every steps",
    "memory_breakdown": "zerotrain logs model-state memory per category at start",
    "dump_state": "a debugging print",
    "zero_allow_untested_optimizer": "each zerotrain optimizer runs at every stage it allows",
    "zero_force_ds_cpu_optimizer": "selects DeepSpeed's CPU kernels",
    "prescale_gradients": _SAME_MATH,
    "gradient_predivide_factor": _SAME_MATH,
    "dataloader_drop_last": "zerotrain's sampler draws whole windows",
    "activation_checkpointing": "configures deepspeed.checkpointing, which a model calls "
                                "itself; zerotrain checkpoints any model's blocks with "
                                "model.activation_checkpointing (true or offload)",
    "checkpoint": "DeepSpeed's checkpoint I/O options; zerotrain writes its own atomic format",
    "aio.queue_depth": "libaio's queue depth; zerotrain's NVMe tier issues blocking "
                       "reads and writes of zero.nvme_block_mb from zero.nvme_threads threads",
    "aio.single_submit": "a libaio submission mode; zerotrain does not use libaio",
    "aio.overlap_events": "a libaio event mode; zerotrain's I/O threads run beside the "
                          "compute, zero.offload_prefetch units ahead",
    "aio.use_gds": "GPUDirect Storage; zerotrain reads and writes through host memory",
    "comms_logger": "zerotrain logs bytes sent per step (bytes_sent) always",
    "flops_profiler": "no flops profiler in zerotrain",
    "tensorboard.output_path": _WHERE,
    "tensorboard.job_name": _WHERE,
    "csv_monitor.output_path": _WHERE,
    "csv_monitor.job_name": _WHERE,
    _Z + "stage3_gather_16bit_weights_on_model_save": "read by zerotrain.deepspeed's engine "
    "(save_model of the HF Trainer gathers the whole weights); checkpoints stay sharded",
    _Z + "stage3_gather_fp16_weights_on_model_save": "the old name of "
    "stage3_gather_16bit_weights_on_model_save",
    _Z + "contiguous_gradients": "zerotrain's gradients always live in flat buffers",
    _Z + "allgather_bucket_size": "zerotrain sizes all its collectives by zero.bucket_mb "
                                  "(from reduce_bucket_size)",
    _Z + "use_multi_rank_bucket_allreduce": "a DeepSpeed kernel choice",
    _Z + "round_robin_gradients": "a DeepSpeed offload ordering",
    _Z + "sub_group_size": "the optimizer steps each rank's shard at once",
    _Z + "stage3_max_live_parameters": "ZeRO-3 frees each unit right after use",
    _Z + "stage3_max_reuse_distance": "ZeRO-3 frees each unit right after use",
    _Z + "elastic_checkpoint": "zerotrain checkpoints load at any world size",
    _Z + "memory_efficient_linear": "a DeepSpeed kernel choice",
    _Z + "cpu_offload_use_pin_memory": "deprecated; DeepSpeed itself no longer applies it",
    _Z + "offload_optimizer.buffer_count": "DeepSpeed's pool of NVMe swap buffers for the "
                                           "optimizer tensors; zerotrain streams a unit's "
                                           "masters and moments through "
                                           "zero.offload_prefetch + 1 buffers",
    _Z + "offload_optimizer.fast_init": "speeds up DeepSpeed's NVMe optimizer "
                                        "initialisation; zerotrain writes the first states "
                                        "unit by unit",
    _Z + "offload_optimizer.pipeline_read": "zerotrain reads the next unit's optimizer "
                                            "states during the update, by "
                                            "zero.offload_prefetch",
    _Z + "offload_optimizer.pipeline_write": "zerotrain writes a unit's optimizer states "
                                             "back while the next one is updated",
    _Z + "offload_optimizer.super_offload": "DeepSpeed's Superchip CPU-Adam schedule; the "
                                            "update is the same",
    _Z + "offload_optimizer.cpuadam_cores_perc": "cores for DeepSpeed's CPU Adam; zerotrain's "
                                                 "host update uses train.threads",
    _Z + "offload_param.buffer_size": "DeepSpeed's NVMe read buffer size (elements); "
                                      "zerotrain sizes each buffer to the largest unit's "
                                      "shard",
    _Z + "offload_param.max_in_cpu": "with device nvme DeepSpeed keeps up to this many "
                                     "parameter elements in host memory; zerotrain keeps "
                                     "every offloaded shard on disk (placement only)",
    "optimizer.params.torch_adam": "picks torch.optim's Adam kernel: zerotrain.deepspeed "
                                   "then updates with torch's arithmetic, a converted "
                                   "config with zerotrain's AdamW (its default "
                                   "weight_decay is honoured)",
    "optimizer.params.set_grad_none": "zerotrain's gradients are flat buffers",
    "optimizer.params.ns_method": "zerotrain runs the quintic Newton-Schulz iteration",
}

#: DeepSpeed settings (sections) that exist in DeepSpeed 0.19.8 but not in zerotrain
UNIMPLEMENTED: dict[str, str] = {
    "zero_optimization.zenflow": "ZenFlow (stall-free offloaded updates of the important "
                                 "gradient columns) has no zerotrain equivalent; remove "
                                 "'zenflow' (zerotrain's ZeRO-Offload updates every step)",
}

FEATURES: dict[str, str] = {
    "amp": "Apex AMP: use fp16 or bf16 instead",
    "elasticity": "DeepSpeed elastic batch sizing has no zerotrain equivalent",
    "autotuning": "DeepSpeed autotuning has no zerotrain equivalent",
    "eigenvalue": "eigenvalue-based scheduling has no zerotrain equivalent",
    "progressive_layer_drop": "progressive layer drop has no zerotrain equivalent",
    "curriculum_learning": "curriculum learning has no zerotrain equivalent",
    "data_efficiency": "DeepSpeed data efficiency has no zerotrain equivalent",
    "quantize_training": "quantized training has no zerotrain equivalent",
    "compression_training": "compression training has no zerotrain equivalent",
    "nebula": "Nebula checkpointing has no zerotrain equivalent",
    "hybrid_engine": "the RLHF hybrid engine has no zerotrain equivalent",
    "torch_autocast": "zerotrain casts by precision.dtype",
    "comms_logger": "",
    "flops_profiler": "",
}

_P, _S = "optimizer.params.", "scheduler.params."
#: Every key the mapping reads (for "did you mean" and for telling configs apart).
MAPPED: tuple[str, ...] = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "gradient_clipping", "steps_per_print", "communication_data_type",
    "data_types.grad_accum_dtype", "fp16.enabled", "fp16.loss_scale",
    "fp16.initial_scale_power", "fp16.loss_scale_window", "fp16.hysteresis",
    "fp16.min_loss_scale", "bf16.enabled", "bfloat16.enabled", _Z + "stage",
    _Z + "offload_optimizer.device", _Z + "offload_optimizer.nvme_path",
    _Z + "offload_optimizer.pin_memory", _Z + "offload_param.device",
    _Z + "offload_param.nvme_path", _Z + "offload_param.pin_memory",
    _Z + "offload_param.buffer_count", "aio.block_size", "aio.intra_op_parallelism",
    "aio.thread_count", _Z + "reduce_bucket_size", _Z + "overlap_comm",
    _Z + "stage3_param_persistence_threshold", _Z + "stage3_prefetch_bucket_size",
    "optimizer.type", *(_P + k for k in (
        "lr", "betas", "eps", "weight_decay", "adam_w_mode", "momentum", "dampening",
        "nesterov", "alpha", "lr_decay", "muon_lr", "adam_lr")),
    "scheduler.type", *(_S + k for k in (
        "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
        "total_num_steps", "warmup_min_ratio", "cos_min_ratio")),
    "tensorboard.enabled", "wandb.enabled", "wandb.project", "wandb.team", "wandb.group",
    "csv_monitor.enabled",
)
KNOWN_TOP = frozenset(k.split(".")[0] for k in (*MAPPED, *ONLY_DEFAULT, *IGNORED, *FEATURES))
