"""bf16 training keeps a model's floating buffers in their own dtype, as DeepSpeed does
(it casts parameters only): HF Llama's rotary `inv_freq` stays fp32, so the rotary
angles — and the loss — are HF's own bf16 model's, not those of a bf16-rounded table."""

from __future__ import annotations

import pytest
import torch
import transformers

from zerotrain.config import build_config
from zerotrain.engine import Engine


def _llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(3)
    conf = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
    )
    return transformers.LlamaForCausalLM(conf)


@pytest.mark.parametrize("stage", [0, 3])
def test_bf16_keeps_fp32_buffers(stage):
    model = _llama()
    want = {n: b.clone() for n, b in model.named_buffers()}
    assert any(b.dtype == torch.float32 for b in want.values())  # inv_freq
    # HF's own bf16 model as DeepSpeed sets it up: parameters bf16, buffers as loaded
    ref = _llama()
    for p in ref.parameters():
        p.data = p.data.bfloat16()
    x = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref_loss = ref(input_ids=x, labels=x).loss.item()
    cfg = build_config(
        {
            "precision": {"dtype": "bf16-pure"},
            "zero": {"stage": stage},
            "train": {"device": "cpu"},
            "optimizer": {"lr": 1e-3},
        },
        library=True,
    )
    eng = Engine(model, cfg, torch.device("cpu"))
    for n, b in eng.module.named_buffers():
        if n in want:
            assert b.dtype == want[n].dtype, n
            assert torch.equal(b, want[n]), n
    with torch.no_grad():
        loss = eng(input_ids=x, labels=x).loss.item()
    eng.close()
    assert loss == ref_loss
