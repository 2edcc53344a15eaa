"""An HF Trainer / TRL SFTTrainer script as users write it (no zerotrain in it), for
bench/hf_compat.py: a small random-weight Llama saved to a local folder, loaded with
`from_pretrained` after `TrainingArguments(deepspeed=...)` (ZeRO-3: inside zero.Init),
a local dataset, `trainer.train()`, one save + resume, `save_model`. Writes per-step
losses / lrs and the peak host RSS during from_pretrained as JSON.

    python bench/hf_script.py OUT_DIR --ds ds.json|none --kind trainer|sft [--resume CKPT]
        [--eval-only]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import threading
import time
from pathlib import Path

import torch


def peak_rss_during(fn):
    """Run fn; the peak resident set size (bytes) of this process meanwhile, sampled."""
    import psutil

    proc, peak, done = psutil.Process(), [proc_rss := psutil.Process().memory_info().rss], [False]

    def watch():
        while not done[0]:
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        out = fn()
    finally:
        done[0] = True
        t.join()
    return out, max(peak[0], proc.memory_info().rss) - proc_rss


def make_model_dir(path: Path, vocab: int, hidden: int, layers: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").is_file():
        return
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer(vocab).save_pretrained(path)


def tokenizer(vocab: int):
    """A word-level tokenizer over "t3" .. "t<vocab-1>" (TRL wants a processing class)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def dataset(kind: str, n: int, vocab: int, seq: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (seq,), generator=g).tolist()
        if kind == "sft":  # prompt tokens masked (-100): the loss covers the completion
            p = int(torch.randint(2, seq // 2, (1,), generator=g))
            rows.append({"input_ids": ids, "completion_mask": [0] * p + [1] * (seq - p)})
        else:
            rows.append({"input_ids": ids, "labels": ids})
    return Dataset.from_list(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--ds", required=True)
    ap.add_argument("--kind", default="trainer", choices=["trainer", "sft"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-steps", type=int, default=15)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--gas", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument(
        "--eval-only",
        action="store_true",
        help="trainer.evaluate() without train() (ZeRO inference)",
    )
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    out = Path(a.out)
    vocab, seq = 256, 32
    model_dir = Path(a.model or out / "init")
    make_model_dir(model_dir, vocab, a.hidden, a.layers) if "RANK" not in os.environ else None
    common = dict(
        output_dir=str(out / "run"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=a.gas,
        learning_rate=1e-3,
        max_steps=a.steps,
        warmup_steps=5,
        lr_scheduler_type="cosine",
        weight_decay=0.01,
        max_grad_norm=1.0,
        logging_steps=1,
        save_steps=a.save_steps,
        save_strategy="steps",
        report_to=[],
        seed=0,
        deepspeed=None if a.ds == "none" else a.ds,
        dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
        save_only_model=False,
        disable_tqdm=True,
        bf16=False,
        fp16=False,
    )
    if a.kind == "sft":
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(
            **common,
            max_length=seq,
            completion_only_loss=True,
            dataset_num_proc=None,
            packing=False,
        )
    else:
        args = TrainingArguments(**common)
    model, rss = peak_rss_during(
        lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    )

    log: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                log.append(
                    {
                        "step": state.global_step,
                        "loss": logs["loss"],
                        "lr": logs.get("learning_rate"),
                        "grad_norm": logs.get("grad_norm"),
                    }
                )

    data = dataset(a.kind, 400, vocab, seq)
    if a.kind == "sft":
        from transformers import AutoTokenizer

        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=data,
            callbacks=[Record()],
            processing_class=AutoTokenizer.from_pretrained(model_dir),
        )
    else:
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Record()])
    first = trainer.evaluate(eval_dataset=data.select(range(32))) if a.eval_only else {}
    if not a.eval_only:  # (train() after evaluate() in one Trainer fails under DeepSpeed too)
        trainer.train(resume_from_checkpoint=a.resume)
    trainer.save_model(str(out / "final"))
    rank = int(os.environ.get("RANK", "0"))
    (out / f"result_rank{rank}.json").write_text(
        json.dumps(
            {
                "log": log,
                "eval_loss": first.get("eval_loss"),
                "from_pretrained_rss": rss,
                "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            }
        )
    )


if __name__ == "__main__":
    main()
