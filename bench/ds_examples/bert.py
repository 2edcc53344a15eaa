"""Stand-in for DeepSpeedExamples training/HelloDeepSpeed/train_bert_ds.py: the same
DeepSpeed calls (a config dict with Adam, ZeRO-1 and offload_optimizer cpu; initialize
with model_parameters; log_dist; `sum(p.numel() for p in engine.parameters())`; the
engine's forward returning the loss from **batch; save_checkpoint with a client_state
step; load_checkpoint reading it back to resume), on a tiny masked-LM transformer and
random token batches. fp32 (the example asserts fp16 or bf16, for GPUs)."""

from __future__ import annotations

import argparse
import logging
import os

import deepspeed
import torch
from common import record
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import log_dist
from torch import nn

VOCAB, SEQ = 64, 16


class TinyMLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, src_tokens: torch.Tensor, tgt_tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.enc(self.emb(src_tokens)))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tgt_tokens.reshape(-1),
                                           ignore_index=0)


def batch_at(step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tgt = torch.randint(1, VOCAB, (4, SEQ), generator=g)
    mask = torch.rand(4, SEQ, generator=g) < 0.3
    return {"src_tokens": tgt.masked_fill(mask, 1), "tgt_tokens": tgt.masked_fill(~mask, 0)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--checkpoint_every", type=int, default=4)
    p.add_argument("--load_checkpoint_dir", default=None)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    torch.manual_seed(42)
    model = TinyMLM()
    ds_config = {"train_micro_batch_size_per_gpu": 4,
                 "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                 "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config)
    log_dist("DeepSpeed engine created", ranks=[0], level=logging.INFO)
    start = 1
    if args.load_checkpoint_dir is not None:
        _, client_state = model.load_checkpoint(load_dir=args.load_checkpoint_dir)
        start = client_state["checkpoint_step"] + 1
    numel = sum(p.numel() for p in model.parameters())
    device = torch.device(get_accelerator().device_name())
    rank = int(os.environ.get("RANK", "0"))
    model.train()
    losses = []
    for step in range(start, args.steps + 1):
        batch = {k: v.to(device) for k, v in batch_at(step, rank).items()}
        loss = model(**batch)
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        if step % args.checkpoint_every == 0:
            model.save_checkpoint(save_dir=os.path.join(args.out, "ckpt"),
                                  client_state={"checkpoint_step": step})
    record(args.out, losses=losses, numel=numel, start=start)


if __name__ == "__main__":
    main()
