"""Document masking for packed sequences (`data.document_mask`): a packed window gives each
document what it would get alone.

The reference is independent of the mask: each document of a window is run through the
same model on its own (its positions from 0, plain causal attention), with the target
predicted at its ending EOS ignored; per-document logits, the loss (sum over documents
over the count of scored targets) and the parameter gradients of the packed, masked run
must match it (fp32, 1e-5 relative) — for the reference GPT, llama, a Hugging Face Llama
(wrapped by model.hf, and a bare one in library mode), with activation checkpointing,
sequence tiling, and Ulysses sequence parallelism S = 2 (gloo). With the option off
(the default) the engine computes exactly what the model alone does.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from zerotrain.config import ConfigError, DataConfig, build_config, deep_merge
from zerotrain.models import build_model, plan_for
from zerotrain.models.long_sequence import (
    apply_tiling,
    document_masking,
    sequence_backward,
    sequence_forward,
)

from multirank import run_ranks
from zero_harness import built_engine

SEQ, B, VOCAB, EOS = 16, 2, 256, 7
#: EOS positions per row: docs of 5, 5 and 6 tokens; a doc that is one EOS, one of 14
#: tokens, and a window ending on an EOS (its target, the next window's first, ignored).
#: At S = 2 the documents straddle the two ranks' halves.
EOS_AT = ((4, 9), (0, 15))

BASE = {
    "model": {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": SEQ, "bias": False,
              "vocab_size": VOCAB},
    "optimizer": {"lr": 1e-2, "grad_clip": 0.0},
    "schedule": {"kind": "constant", "warmup_steps": 0},
    "data": {"micro_batch_size": B, "document_mask": True, "eos_token_id": EOS},
    "zero": {"bucket_mb": 0.02},
    "comm": {"algorithm": "native"},
    "train": {"steps": 1, "device": "cpu"},
}


def hf_llama_folder(tmp_path) -> str:
    torch.manual_seed(11)
    conf = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=SEQ,
                                    eos_token_id=EOS)
    transformers.LlamaForCausalLM(conf).save_pretrained(tmp_path / "hf")
    return str(tmp_path / "hf")


def config(kind: str, folder: str | None = None, extra: dict | None = None):
    over: dict = {}
    if kind == "llama":
        over = {"model": {"arch": "llama", "n_kv_head": 2}}
    elif kind == "hf":
        over = {"model": {"hf": folder, "n_layer": None, "n_head": None, "n_embd": None,
                          "vocab_size": None, "bias": None}}
    cfg = deep_merge(deep_merge(BASE, over), extra or {})
    cfg["model"] = {k: v for k, v in cfg["model"].items() if v is not None}
    return build_config(cfg)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A packed window (x) and its shifted targets (y); EOS only where EOS_AT says."""
    g = torch.Generator().manual_seed(5)
    xy = torch.randint(0, VOCAB, (B, SEQ + 1), generator=g)
    xy[xy == EOS] = EOS + 1
    for r, at in enumerate(EOS_AT):
        xy[r, list(at)] = EOS
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()


def documents(x: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, stop) of each document: an EOS ends the document it is in."""
    out = []
    for r in range(x.shape[0]):
        a = 0
        for i in range(x.shape[1]):
            if x[r, i] == EOS or i == x.shape[1] - 1:
                out.append((r, a, i + 1))
                a = i + 1
    return out


def reference(model, x, y) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Each document alone: (mean loss over the scored targets, per-document logits);
    the loss is left differentiable for the reference gradients."""
    total, count, logits = torch.zeros(()), 0, []
    for r, a, b in documents(x):
        t = y[r:r + 1, a:b].clone()
        if x[r, b - 1] == EOS:
            t[0, -1] = -100  # the prediction made at the EOS: of another document
        with torch.no_grad():
            logits.append(model(x[r:r + 1, a:b])[0])
        n = int((t != -100).sum())
        if n:
            total = total + model(x[r:r + 1, a:b], t) * n
            count += n
    return total / count, logits


def seeded(cfg):
    torch.manual_seed(0)
    return build_model(cfg.model)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    return float((a - b).norm()) <= rel * float(b.norm()) + 1e-7


def check_against_reference(make, tile: int | None = None) -> None:
    """The packed, masked run of a model `make()` builds (as the engine routes it, with
    the documents re-entered for backward) against each document alone, in another
    model `make()` builds (the same weights: the same seed)."""
    x, y = batch()
    model, ref_model = make(), make()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    docs = document_masking(DataConfig(document_mask=True, eos_token_id=EOS), model)
    if tile is not None:
        apply_tiling(model, plan_for(model).blocks, tile)
    loss = sequence_forward(model, None, docs, (x, y), {})
    with sequence_backward(None, docs):
        loss.backward()
    got = grads(model)
    ref_loss, ref_logits = reference(ref_model, x, y)
    ref_loss.backward()
    want = grads(ref_model)
    loss, ref_loss = loss.item(), ref_loss.item()
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss, (loss, ref_loss)
    assert got.keys() == want.keys()
    for n in want:
        assert close(got[n], want[n]), f"gradient of {n}"
    with torch.no_grad():
        apply_tiling(model, plan_for(model).blocks, None)
        logits = sequence_forward(model, None, docs, (x,), {})
        plain = model(x)  # no documents: attention crosses the EOS
    for (r, a, b), ref in zip(documents(x), ref_logits):
        assert close(logits[r, a:b], ref), f"logits of document {r}:{a}-{b}"
    # the reference tells masking from none: later documents differ without it
    assert not close(plain[0, 5:], logits[0, 5:], 1e-3)


@pytest.mark.parametrize("kind, ckpt, tile", [
    ("gpt", False, None), ("gpt", True, 4), ("llama", False, None), ("llama", True, 4),
    ("hf", False, None), ("hf", False, 4)])
def test_packed_equals_documents_alone(tmp_path, kind, ckpt, tile):
    folder = hf_llama_folder(tmp_path) if kind == "hf" else None
    cfg = config(kind, folder, {"model": {"activation_checkpointing": ckpt}})
    check_against_reference(lambda: seeded(cfg), tile)


def test_hf_checkpointed_through_engine_wiring(tmp_path):
    """A Hugging Face model's blocks checkpointed by the engine's wiring: the recompute in
    backward must see the documents again."""
    from zerotrain.models.long_sequence import apply_long_sequence

    cfg = config("hf", hf_llama_folder(tmp_path))

    def make():
        model = seeded(cfg)
        apply_long_sequence(model, plan_for(model).blocks, True, None, torch.device("cpu"))
        return model

    check_against_reference(make)


def bare_hf_loss(folder: str, sp: int) -> float:
    """A transformers model given to the engine (library mode), called HF's way
    (input_ids, unshifted labels; every rank the whole batch); EOS: its config's."""
    from zerotrain.engine import Engine

    model = transformers.LlamaForCausalLM.from_pretrained(folder)
    cfg = build_config(deep_merge(BASE, {"data": {"eos_token_id": None},
                                         "sequence": {"parallel": sp}}), library=True)
    eng = Engine(model, cfg, torch.device("cpu"))
    x, _ = batch()
    out = eng(input_ids=x, labels=x)
    pad = torch.ones_like(x)
    pad[0, :2] = 0
    with pytest.raises(ValueError, match="padding attention_mask is not supported"):
        eng(input_ids=x, labels=x, attention_mask=pad)
    eng.close()
    return out.loss.item()


def bare_hf_reference(folder: str) -> float:
    """HF alone on each document, its own labels: the mean over every scored label."""
    ref = transformers.LlamaForCausalLM.from_pretrained(folder)
    x, _ = batch()
    total, count = 0.0, 0
    for r, a, b in documents(x):
        n = b - a - 1
        if n:
            with torch.no_grad():
                total += float(ref(input_ids=x[r:r + 1, a:b], labels=x[r:r + 1, a:b]).loss) * n
            count += n
    return total / count


def test_bare_hf_model_library_mode(tmp_path):
    """position_ids restart per document, the first label of each is ignored."""
    folder = hf_llama_folder(tmp_path)
    want = bare_hf_reference(folder)
    assert abs(bare_hf_loss(folder, 1) - want) <= 1e-5 * want


def _sp_run(kind: str, folder: str | None, sp: int, extra: dict) -> dict:
    cfg = config(kind, folder, deep_merge({"sequence": {"parallel": sp},
                                           "zero": {"stage": 3}}, extra))
    eng = built_engine(cfg)
    x, y = batch()  # every rank of the group: the same whole batch
    loss = eng(x, y)
    eng.backward(loss)
    info = eng.step()
    eng.close()
    return {"loss": loss.item(), "norm": info.grad_norm}


SP_CASES = [("gpt", {"model": {"activation_checkpointing": True}}),
            ("llama", {"sequence": {"tile_tokens": 4}}), ("hf", {})]


def _sp_cases(folder: str) -> list[dict]:
    return [_sp_run(k, folder if k == "hf" else None, 2, ex) for k, ex in SP_CASES] + [
        {"bare": bare_hf_loss(folder, 2)}]


def test_sequence_parallel_2(tmp_path):
    """S = 2: each rank holds half of a window whose documents straddle the halves; the
    whole-sequence loss and the gradient norm are those of the documents alone."""
    folder = hf_llama_folder(tmp_path)
    results = run_ranks(_sp_cases, 2, folder)
    x, y = batch()
    bare = bare_hf_reference(folder)  # a bare HF model, its position_ids sliced by SP
    assert all(abs(r[-1]["bare"] - bare) <= 1e-5 * bare for r in results)
    for (kind, extra), one, two in zip(SP_CASES, *results):
        cfg = config(kind, folder if kind == "hf" else None, extra)
        torch.manual_seed(0)
        model = build_model(cfg.model)
        if kind == "hf":
            from zerotrain.models import pretrained_weights

            pretrained_weights(cfg.model, model).load_into(model)
        ref, _ = reference(model, x, y)
        ref.backward()
        ref_loss = ref.item()
        norm = float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
        for res in (one, two):
            assert abs(res["loss"] - ref_loss) <= 1e-5 * ref_loss, kind
            assert abs(res["norm"] - norm) <= 1e-4 * norm, (kind, res["norm"], norm)


def test_off_is_unchanged():
    """Off (the default): the engine's forward is the model's own, bit for bit; on, a
    batch without an EOS takes the same causal kernel (no mask)."""
    x, y = batch()
    x[x == EOS] = EOS + 1
    assert DataConfig().document_mask is False
    out = {}
    for on in (False, True):
        cfg = config("llama", extra={"data": {"document_mask": on,
                                              "eos_token_id": EOS if on else None}})
        eng = built_engine(cfg)
        assert (eng.docs is None) == (not on)
        with torch.no_grad():
            out[on] = (eng(x, y), eng(x), eng.module(x, y))
        eng.close()
    for on in (False, True):
        assert torch.equal(out[on][0], out[False][2])
        assert torch.equal(out[on][1], out[False][1])


def test_no_eos_known_is_one_config_error():
    """On, with no EOS id anywhere (the reference GPT knows none; the byte tokenizer has
    none): one ConfigError naming the field and the fix."""
    cfg = config("gpt", extra={"data": {"eos_token_id": None}})
    with pytest.raises(ConfigError, match=r"data\.document_mask .*data\.eos_token_id"):
        built_engine(cfg)
    with pytest.raises(ConfigError, match=r"data\.eos_token_id \(999\) is not a token"):
        built_engine(config("gpt", extra={"data": {"eos_token_id": 999}}))
    from zerotrain.data.tokenizer import ByteTokenizer
    from zerotrain.run.setup import _document_eos

    with pytest.raises(ConfigError, match=r"data\.document_mask .*'bytes' has none"):
        _document_eos(DataConfig(document_mask=True), ByteTokenizer())
    assert _document_eos(DataConfig(document_mask=True, eos_token_id=10),
                         ByteTokenizer()).eos_token_id == 10
    with pytest.raises(ConfigError, match=r"data\.eos_token_id"):
        build_config(deep_merge(BASE, {"data": {"eos_token_id": -1}}))
    with pytest.raises(ConfigError, match=r"data\.eos_token_id \(7\) is used by "
                                          r"data\.document_mask only"):
        build_config(deep_merge(BASE, {"data": {"document_mask": False}}))


def test_documents_of_a_batch():
    """Document ids and in-document positions, against the (row, start, stop) list. (For
    RoPE models the restart is invisible under the mask — q·k depends on distances only —
    so the model tests above see it through GPT's learned positions; here it is direct.)"""
    from zerotrain.models.documents import Documents

    x, _ = batch()
    d = Documents.of(x, EOS)
    for n, (r, a, b) in enumerate(documents(x)):
        first = sum(1 for rr, _, _ in documents(x)[:n] if rr == r)
        assert d.ids[r, a:b].tolist() == [first] * (b - a)
        assert d.positions[r, a:b].tolist() == list(range(b - a))
    assert not d.single
    m = d.mask(torch.float32)[0, 0]
    assert m[6, 5] == 0 and m[5, 4] == float("-inf") and m[4, 5] == float("-inf")
    assert Documents.of(x.clamp(min=EOS + 1), EOS).single


def test_estimator_counts_the_mask():
    """memory/activations.py with document_mask: within 5% of the measured peak of a
    forward + backward (CPU SDPA, fp32, one thread) — the mask is T² of it at 2,048."""
    from test_long_sequence import measured_peak
    from zerotrain.config import ModelConfig
    from zerotrain.memory import activation_parts
    from zerotrain.models.documents import DocumentMasking

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = ModelConfig(arch="llama", n_layer=2, n_head=4, n_embd=64, block_size=2048,
                          vocab_size=1024, activation_checkpointing=True)
        torch.manual_seed(0)
        model = build_model(cfg)
        docs = DocumentMasking(3, model)
        for seq in (1024, 2048):
            x, y = torch.randint(8, 1024, (2, 1, seq))
            x[0, ::100] = 3

            def step(x=x, y=y):
                loss = sequence_forward(model, None, docs, (x, y), {})
                with sequence_backward(None, docs):
                    loss.backward()

            step()
            got = measured_peak(step)
            pred = activation_parts(cfg, 1, seq, act_bytes=4, device="cpu",
                                    document_mask=True)
            off = activation_parts(cfg, 1, seq, act_bytes=4, device="cpu")
            assert pred.peak == pytest.approx(got, rel=0.05), (seq, got, pred)
            assert pred.peak - off.peak >= seq * seq * 4
    finally:
        torch.set_num_threads(before)
