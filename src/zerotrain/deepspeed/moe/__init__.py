"""`deepspeed.moe`: zerotrain has no MoE layers (a model holding DeepSpeed's `MoE` is
refused by `initialize`); `deepspeed.moe.utils` answers the helpers scripts import
for their param groups, which without MoE layers pass the groups through."""
