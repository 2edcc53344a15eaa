"""Stand-in for DeepSpeedExamples training/cifar/cifar10_deepspeed.py: the same DeepSpeed
calls in the same order (init_distributed, get_accelerator().set_device, the MoE
param-group helper, a config dict built in the script, initialize with training_data,
engine forward / backward / step, eval through the engine, save_checkpoint), on a small
CNN and random 3x32x32 "images" (no download)."""

from __future__ import annotations

import argparse
import os

import deepspeed
import torch
from common import record
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.pool = nn.Conv2d(3, 6, 5), nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2, self.fc3 = nn.Linear(400, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def config(stage: int) -> dict:
    return {
        "train_batch_size": 16, "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.999],
                                                 "eps": 1e-8, "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                     "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0, "prescale_gradients": False,
        "bf16": {"enabled": False}, "fp16": {"enabled": False},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": stage, "allgather_partitions": True,
                              "reduce_scatter": True, "allgather_bucket_size": 50000000,
                              "reduce_bucket_size": 50000000, "overlap_comm": True,
                              "contiguous_gradients": True, "cpu_offload": False}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args()
    deepspeed.init_distributed()
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    trainset = torch.utils.data.TensorDataset(torch.randn(400, 3, 32, 32, generator=g),
                                              torch.randint(0, 10, (400,), generator=g))
    net = Net()
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": [q for q in net.parameters() if q.requires_grad], "name": "parameters"})
    engine, _, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=groups, training_data=trainset,
        config=config(args.stage))
    device = get_accelerator().device_name(engine.local_rank)
    criterion = nn.CrossEntropyLoss()
    losses = []
    for i, (inputs, labels) in enumerate(trainloader):
        if i == args.steps:
            break
        loss = criterion(engine(inputs.to(device)), labels.to(device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.eval()
    with torch.no_grad():
        correct = sum(int((engine(x).argmax(1) == y).sum()) for x, y in
                      torch.utils.data.DataLoader(trainset, batch_size=50))
    engine.save_checkpoint(os.path.join(args.out, "ckpt"))
    record(args.out, losses=losses, correct=correct)


if __name__ == "__main__":
    main()
