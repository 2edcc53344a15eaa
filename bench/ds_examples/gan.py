"""Stand-in for DeepSpeedExamples training/gan/gan_deepspeed_train.py: two engines (a
discriminator and a generator) each from a client torch Adam beside the config's own
`optimizer` block; the discriminator takes two backward passes (real, then fake) before
its step, the generator's loss runs through the raw discriminator module. Small
DCGAN-shaped nets on random 3x16x16 "images"."""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import deepspeed
import torch
from common import record
from torch import nn

NZ = 8


def nets() -> tuple[nn.Module, nn.Module]:
    g = nn.Sequential(nn.ConvTranspose2d(NZ, 16, 4, 1, 0, bias=False), nn.BatchNorm2d(16),
                      nn.ReLU(True), nn.ConvTranspose2d(16, 3, 4, 4, 0, bias=False), nn.Tanh())
    d = nn.Sequential(nn.Conv2d(3, 16, 4, 4, 0, bias=False), nn.LeakyReLU(0.2, True),
                      nn.Conv2d(16, 1, 4, 1, 0, bias=False), nn.Sigmoid(), nn.Flatten(0))
    return d, g


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args()
    if args.deepspeed_config is None:  # the example's gan_deepspeed_config.json
        path = os.path.join(tempfile.mkdtemp(), "gan.json")
        with open(path, "w") as f:
            json.dump({"train_batch_size": 16, "steps_per_print": 10, "optimizer": {
                "type": "Adam", "params": {"lr": 2e-4, "betas": [0.5, 0.999], "eps": 1e-8}}}, f)
        args.deepspeed_config = path
    torch.manual_seed(0)
    netD, netG = nets()
    criterion = nn.BCELoss()
    optD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    engD, optD, _, _ = deepspeed.initialize(args=args, model=netD,
                                            model_parameters=netD.parameters(), optimizer=optD)
    engG, optG, _, _ = deepspeed.initialize(args=args, model=netG,
                                            model_parameters=netG.parameters(), optimizer=optG)
    rank = int(os.environ.get("RANK", "0"))
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own data, as a sampler
    lossD, lossG = [], []
    for _ in range(args.steps):
        netD.zero_grad()
        real = torch.rand(8, 3, 16, 16, generator=g) * 2 - 1
        label = torch.full((8,), 1.0)
        errD_real = criterion(netD(real), label)
        engD.backward(errD_real)
        fake = netG(torch.randn(8, NZ, 1, 1, generator=g))
        label.fill_(0.0)
        errD_fake = criterion(netD(fake.detach()), label)
        engD.backward(errD_fake)
        engD.step()
        netG.zero_grad()
        label.fill_(1.0)
        errG = criterion(netD(fake), label)
        engG.backward(errG)
        engG.step()
        lossD.append((errD_real + errD_fake).item())
        lossG.append(errG.item())
    record(args.out, losses=lossD, lossG=lossG)


if __name__ == "__main__":
    main()
