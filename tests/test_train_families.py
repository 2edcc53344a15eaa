"""The whole path from the command line for other model families and data (issue 14):
train a BPE tokenizer, prepare token shards, train llama on them, resume exactly, sample
through the tokenizer, export to Hugging Face format and load it there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from zerotrain.cli import main
from zerotrain.config import build_config
from zerotrain.run.loop import train

pytestmark = pytest.mark.slow

LLAMA = {"arch": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64,
         "block_size": 32}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A BPE tokenizer and token shards of a few source files, made with the CLI."""
    import zerotrain.engine as a
    import zerotrain.run.loop as b
    import zerotrain.run.setup as c

    d = tmp_path_factory.mktemp("data")
    text = d / "text"
    text.mkdir()
    for m in (a, b, c):
        (text / (m.__name__ + ".py")).write_text(Path(m.__file__).read_text() * 2)
    tok = d / "tok.json"
    assert main(["tokenizer", "train", str(text), "--vocab", "400", "--out", str(tok)]) == 0
    out = d / "shards"
    assert main(["prepare", str(text), "--tokenizer", str(tok), "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["vocab_size"] == 400 and manifest["dtype"] == "uint16"
    return tok, out


def _cfg(tmp_path, shards, run: str, steps: int, **extra):
    tok, out = shards
    d = {"model": dict(LLAMA),
         "data": {"path": str(out), "tokenizer": str(tok), "micro_batch_size": 4},
         "schedule": {"kind": "constant", "warmup_steps": 0}, "checkpoint": {"every": 3},
         "logging": {"run_dir": str(tmp_path / run), "log_every": 1, "eval_every": 0,
                     "sample_tokens": 8, "progress": False, "plot": False},
         "train": {"steps": steps, "threads": 1}}
    for k, v in extra.items():
        d.setdefault(k, {}).update(v)
    return build_config(d)


def _losses(run_dir) -> dict[int, float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r["type"] == "train"}


def test_prepare_train_resume_on_shards(tmp_path, shards):
    full = train(_cfg(tmp_path, shards, "full", 6))
    assert full["final_val_bits_per_byte"] > 0
    part = _cfg(tmp_path, shards, "part", 6)
    train(part.model_copy(update={"train": part.train.model_copy(update={"steps": 3})}))
    train(part, resume="latest")
    a, b = _losses(tmp_path / "full"), _losses(tmp_path / "part")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert all(a[s] == b[s] for s in range(4, 7)), (a, b)  # bit for bit after the resume
    cfg = json.loads((tmp_path / "full" / "config.json").read_text())
    assert cfg["model"]["vocab_size"] == 400  # the vocabulary followed the tokenizer
    recs = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    phases = [r for r in recs if r["type"] == "memory_phases"]
    # llama's activations are modelled (memory/activations.py): nothing is left out
    assert phases and phases[0]["activations_modelled"]


def test_sample_and_hf_export_of_a_llama_run(tmp_path, shards, capsys):
    train(_cfg(tmp_path, shards, "run", 3))
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "run"), "--prompt", "def ", "--tokens", "10"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def ") and "\ufffd" not in text[:4]
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "run"), "--format", "hf", "--out", str(out)]) == 0
    from transformers import AutoModelForCausalLM

    from zerotrain.checkpoint import full_state_dict
    from zerotrain.config import ModelConfig
    from zerotrain.models import build_model

    hf = AutoModelForCausalLM.from_pretrained(out)
    sd, meta = full_state_dict(tmp_path / "run")
    ours = build_model(ModelConfig.model_validate(meta["config"]["model"]))
    ours.load_state_dict(sd)
    x = torch.randint(0, 400, (2, 16))
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, ours(x), atol=1e-5)
    assert (out / "tokenizer.json").is_file()
