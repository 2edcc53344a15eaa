"""A DeepSpeed training script in the shape of DeepSpeed's getting-started guide, run by
bench/ds_compat.py twice: under real DeepSpeed and with one line changed,
`import zerotrain.deepspeed as deepspeed` (DS_IMPL=zerotrain). Everything else is the
same code.

    torchrun --nproc-per-node 2 bench/ds_script.py --deepspeed --deepspeed_config ds.json \
        --case config --out result.json
"""

import argparse
import json
import os

import torch
from torch import nn

if os.environ.get("DS_IMPL") == "zerotrain":
    import zerotrain.deepspeed as deepspeed
else:
    import deepspeed


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def dataset(n=64):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 16, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


EDIT = [2.0, -2.0, 1.0, -1.0]  # `gathered`: rank 0 writes this into head.bias after initialize


def bias_seen(module):
    """head.bias whole, as every rank sees it (one list per rank)."""
    with deepspeed.zero.GatheredParameters([module.head.bias]):
        mine = module.head.bias.detach().cpu().tolist()
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, mine)
    return out


def edit_after_initialize(module):
    """`gathered`: rank 0 edits head.bias inside GatheredParameters(modifier_rank=0)."""
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
        if torch.distributed.get_rank() == 0:
            with torch.no_grad():
                module.head.bias.copy_(torch.tensor(EDIT))
    return bias_seen(module)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="config")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--save", help="save a checkpoint here after --save-at steps")
    parser.add_argument("--save-at", type=int, default=6)
    parser.add_argument("--load", help="resume from this checkpoint, skipping the batches "
                        "its run has used")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")

    torch.manual_seed(0)
    if args.case == "init":  # built under zero.Init; rank 0 loads the weights into it
        reference = Net().state_dict()
        with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config):
            net = Net()
        with deepspeed.zero.GatheredParameters(list(net.parameters()), modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                with torch.no_grad():
                    for name, p in net.named_parameters():
                        p.copy_(reference[name])
    else:
        net = Net()
    # under DeepSpeed's zero.Init a parameter is a flat partition: its shape is ds_shape
    dims = {n: len(getattr(p, "ds_shape", p.shape)) for n, p in net.named_parameters()}
    decay = [p for n, p in net.named_parameters() if dims[n] >= 2]
    no_decay = [p for n, p in net.named_parameters() if dims[n] < 2]
    groups = [{"params": decay, "weight_decay": 0.1},
              {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {}
    if args.case == "client":
        kwargs["optimizer"] = torch.optim.AdamW(groups, lr=2e-3, betas=(0.9, 0.95))
        kwargs["lr_scheduler"] = torch.optim.lr_scheduler.LambdaLR(
            kwargs["optimizer"], lambda s: 1.0 / (1 + 0.3 * s))
    elif args.case == "clientcfg":  # the config has an `optimizer` block too (lr 2e-3)
        kwargs["optimizer"] = torch.optim.AdamW(groups, lr=7e-4, betas=(0.8, 0.95))
    elif args.case == "sgd":
        groups[1]["lr"] = 5e-3
        kwargs["optimizer"] = torch.optim.SGD(groups, lr=1e-2, momentum=0.9, nesterov=True)
    else:
        kwargs["model_parameters"] = groups
    engine, optimizer, loader, _ = deepspeed.initialize(
        args=args, model=net, training_data=dataset(), **kwargs)
    probe = {}
    if args.case == "gathered":
        probe["after_edit"] = edit_after_initialize(engine.module)
    step = skip = 0
    if args.load:
        engine.load_checkpoint(args.load)
        step = skip = engine.global_steps
    criterion = nn.CrossEntropyLoss()
    losses, lrs = [], []
    while step < args.steps:
        for x, y in loader:
            if skip:
                skip -= 1
                continue
            lrs.append([g["lr"] for g in optimizer.param_groups])  # the lr this step applies
            out = engine(x.to(engine.device))
            loss = criterion(out, y.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            step += 1
            if args.case == "gathered" and step == 1:
                probe["after_step1"] = bias_seen(engine.module)
            if args.save and step == args.save_at:
                engine.save_checkpoint(args.save)
            if step == args.steps:
                break
    if args.case == "gathered":
        probe["end"] = bias_seen(engine.module)
    if engine.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "lrs": lrs, "get_lr": engine.get_lr(),
                       "stage": engine.zero_optimization_stage(), "probe": probe}, f)


if __name__ == "__main__":
    main()
