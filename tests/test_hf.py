"""Hugging Face interoperability: export -> from_pretrained -> same logits; model.hf folders
(single and sharded safetensors, tied heads); slice reads that count their bytes; plain
exports that rebuild their model from the file alone."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from zerotrain.config import ConfigError, ModelConfig
from zerotrain.models import (
    WeightError,
    build_model,
    export_metadata,
    load_export,
    plan_for,
    pretrained_weights,
)
from zerotrain.models.gpt import GPT
from zerotrain.models.hf import HFCausalLM
from zerotrain.models.hf_export import save_hf
from zerotrain.models.llama import Llama
from zerotrain.models.plan import Group
from zerotrain.models.weights import SafetensorsIndex, bind

IDX = torch.randint(0, 80, (2, 24), generator=torch.Generator().manual_seed(0))


def gpt_cfg(**kw) -> ModelConfig:
    return ModelConfig(**{"n_layer": 2, "n_head": 4, "n_embd": 32, "vocab_size": 80,
                          "block_size": 24, **kw})


def llama_cfg(**kw) -> ModelConfig:
    return ModelConfig(**{"arch": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2,
                          "n_embd": 32, "vocab_size": 80, "block_size": 24, **kw})


def randomise(model: torch.nn.Module) -> torch.nn.Module:
    """Non-trivial norms and biases, so a wrong mapping of any tensor shows."""
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.mark.parametrize("kw", [{}, {"bias": False}, {"tie_weights": False}])
def test_gpt_export_loads_as_gpt2(tmp_path, kw):
    model = randomise(GPT(gpt_cfg(**kw)))
    save_hf(tmp_path / "hf", model.cfg, model.state_dict())
    twin = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ref = twin(input_ids=IDX).logits
    assert (model(IDX) - ref).abs().max().item() <= 1e-5
    # and back: the HF folder initialises a zerotrain GPT (Conv1D weights read transposed)
    back = build_model(gpt_cfg(**kw, init_from=str(tmp_path / "hf")))
    pretrained_weights(back.cfg, back).load_into(back)
    assert (back.eval()(IDX) - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kw", [{}, {"tie_weights": True}])
def test_llama_export_loads_as_llama(tmp_path, kw):
    model = randomise(Llama(llama_cfg(**kw)))
    save_hf(tmp_path / "hf", model.cfg, model.state_dict(), dtype=torch.float32)
    twin = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(twin).__name__ == "LlamaForCausalLM"
    assert (model(IDX) - twin(input_ids=IDX).logits).abs().max().item() <= 1e-5
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_key_value_heads"] == 2


def hf_folder(tmp_path, kind: str, shard: bool = False):
    """A tiny HF model saved the way transformers saves models; returns (folder, model)."""
    torch.manual_seed(5)
    if kind == "gpt2":
        conf = transformers.GPT2Config(vocab_size=80, n_positions=24, n_embd=32, n_layer=2,
                                       n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(conf)
    else:
        conf = transformers.LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=48,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=24,
                                        tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(conf)
    folder = tmp_path / kind
    model.save_pretrained(folder, max_shard_size="20KB" if shard else "5GB")
    return folder, model.eval()


@pytest.mark.parametrize("kind,shard", [("gpt2", False), ("llama", True)])
def test_model_hf_builds_and_loads_weights(tmp_path, kind, shard):
    folder, ref = hf_folder(tmp_path, kind, shard)
    assert (folder / "model.safetensors.index.json").exists() == shard
    cfg = ModelConfig(hf=str(folder), block_size=24)
    model = build_model(cfg)
    assert isinstance(model, HFCausalLM)
    weights = pretrained_weights(cfg, model)
    weights.load_into(model)
    assert torch.equal(model.eval()(IDX), ref(input_ids=IDX).logits)
    # the loss is the mean cross-entropy of already shifted targets, in FP32
    tgt = torch.roll(IDX, -1, 1)
    want = torch.nn.functional.cross_entropy(ref(input_ids=IDX).logits.reshape(-1, 80),
                                             tgt.reshape(-1))
    assert abs(model(IDX, tgt).item() - want.item()) < 1e-6
    p = plan_for(model)
    assert len(p.blocks) == 2
    head = [n for n in p.groups if "lm_head" in n or "wte" in n or "embed_tokens" in n]
    assert head and all(p.group_of(n) == Group.EMBEDDING for n in head)


def test_tied_hf_head_absent_from_file_is_bound_to_the_embedding(tmp_path):
    folder, _ = hf_folder(tmp_path, "llama", shard=True)
    index = SafetensorsIndex(folder)
    assert "lm_head.weight" not in index and "model.embed_tokens.weight" in index
    model = build_model(ModelConfig(hf=str(folder), block_size=24), device="meta")
    binding = pretrained_weights(model.cfg, model).binding
    assert binding["hf.model.embed_tokens.weight"] == ("model.embed_tokens.weight", False)
    assert "hf.lm_head.weight" not in binding  # the same parameter: read once


def test_read_slice_reads_only_covering_rows(tmp_path):
    w = torch.randn(10, 7)
    v = torch.randn(13)
    save_file({"w": w, "v": v, "h": torch.randn(3, 5).to(torch.bfloat16)}, str(tmp_path / "f"))
    index = SafetensorsIndex(tmp_path / "f")
    for a, b in [(0, 70), (3, 4), (6, 15), (20, 21), (14, 28), (69, 70)]:
        before = index.bytes_read
        got = index.read_slice("w", a, b)
        assert torch.equal(got, w.reshape(-1)[a:b])
        rows = -(-b // 7) - a // 7
        assert index.bytes_read - before == rows * 7 * 4
    before = index.bytes_read
    assert torch.equal(index.read_slice("v", 4, 9), v[4:9])
    assert index.bytes_read - before == 5 * 4
    # transposed: the rows of w.T are columns of the stored w
    before = index.bytes_read
    assert torch.equal(index.read_slice("w", 12, 25, transposed=True), w.t().reshape(-1)[12:25])
    assert index.bytes_read - before == 2 * 10 * 4  # columns 1 and 2 of its 10 rows
    assert index.read_slice("h", 2, 9).dtype == torch.bfloat16


def test_two_ranks_read_disjoint_halves_of_a_sharded_folder(tmp_path):
    """What ZeRO does: each rank reads its flat range of every tensor, never the whole."""
    folder, ref = hf_folder(tmp_path, "llama", shard=True)
    model = build_model(ModelConfig(hf=str(folder), block_size=24), device="meta")
    full = {n: p.detach().reshape(-1) for n, p in ref.named_parameters()}
    total = sum(t.numel() * 4 for t in full.values())
    read = []
    for rank in range(2):
        w = pretrained_weights(model.cfg, model)
        for name, p in model.named_parameters():
            half = p.numel() // 2
            a, b = (0, half) if rank == 0 else (half, p.numel())
            got = w.read_slice(name, a, b)
            assert torch.equal(got, full[name.removeprefix("hf.")][a:b])
        read.append(w.bytes_read)
    assert all(r < 0.6 * total for r in read)  # each rank: its half plus partial rows


def test_missing_and_misshapen_tensors_are_one_error(tmp_path):
    model = GPT(gpt_cfg())
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd.pop("blocks.1.mlp.fc.weight")
    sd["ln_f.weight"] = torch.ones(31)
    save_file(sd, str(tmp_path / "bad.safetensors"))
    with pytest.raises(WeightError, match=r"no tensor for blocks\.1\.mlp\.fc\.weight.*"
                       r"'ln_f\.weight' is \[31\], the model's 'ln_f\.weight' is \[32\]"):
        bind(model, SafetensorsIndex(tmp_path / "bad.safetensors"))
    with pytest.raises(WeightError, match="do not exist"):
        SafetensorsIndex(tmp_path / "nope")
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        build_model(ModelConfig(hf=str(tmp_path)))


@pytest.mark.parametrize("cfg", [gpt_cfg(), llama_cfg(), None], ids=["gpt", "llama", "hf"])
def test_plain_export_is_self_describing(tmp_path, cfg):
    if cfg is None:
        folder, _ = hf_folder(tmp_path, "gpt2")
        cfg = ModelConfig(hf=str(folder), block_size=24)
    model = randomise(build_model(cfg))
    meta = export_metadata(model.cfg, getattr(model, "hf_config", None), step=7)
    sd = {k: v.clone() for k, v in model.state_dict().items()}  # tied names included
    save_file(sd, str(tmp_path / "x.safetensors"), metadata=meta)
    if model.cfg.hf:  # the export must not need the original folder
        for f in folder.iterdir():
            f.unlink()
    again, got_meta = load_export(tmp_path / "x.safetensors")
    assert got_meta["step"] == "7" and type(again) is type(model)
    assert torch.equal(again.eval()(IDX), model(IDX))
    assert load_file(str(tmp_path / "x.safetensors")).keys() == sd.keys()
