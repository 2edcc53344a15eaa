"""Stand-in for DeepSpeedExamples training/DeepSpeed-ZenFlow/finetuning/finetune_llama.py:
the same calls (`from deepspeed import comm as dist`, the config from --deepspeed_config,
initialize with training_data = a Hugging Face datasets.Dataset and
collate_fn=default_data_collator, `model_engine(**batch).loss`, backward, step,
save_checkpoint), on a small random-weight Llama and random token rows (no download).
Its zf_config.json (bf16, ZeRO-2 + offload_optimizer cpu + zenflow) is given as is, or
with the `zenflow` block removed and fp32 for the side-by-side numbers."""

from __future__ import annotations

import argparse
import os

import deepspeed
import torch
from common import record
from datasets import Dataset
from deepspeed import comm as dist
from transformers import LlamaConfig, LlamaForCausalLM, default_data_collator


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args()
    torch.manual_seed(42)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 128, (16,), generator=g).tolist() for _ in range(96)]
    data = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * 16] * 96,
                              "labels": rows})
    model_engine, _, loader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=data,
        collate_fn=default_data_collator)
    model_engine.train()
    losses = []
    for step, batch in enumerate(loader):
        if step == args.steps:
            break
        batch = {k: v.to(model_engine.device) for k, v in batch.items()}
        loss = model_engine(**batch).loss
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
        if dist.get_rank() == 0:
            print(f"Step {step + 1}, Loss: {loss.item():.4f}")
    model_engine.save_checkpoint(os.path.join(args.out, "ckpt"))
    record(args.out, losses=losses)


if __name__ == "__main__":
    main()
