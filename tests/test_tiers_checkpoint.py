"""Checkpoints of ZeRO-Infinity runs streamed unit by unit (checkpoint/stream.py,
zero/tiers/lazy.py): the file is the one `safetensors.torch.save_file` writes, a save holds
about one tensor of the states at a time (never all of them, as bringing them resident
did), and a load fills the tier unit by unit, bit-exact with a load without a tier."""

from __future__ import annotations

import hashlib
import json
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

from zerotrain.checkpoint import stream
from zerotrain.zero.states import disk as infinity
from zerotrain.zero.tiers.lazy import LoadMeter

from zero_harness import batches, full_params, local_batch, make_config

STAGE3 = {"zero": {"stage": 3}}
FOUR = {"model": {"n_layer": 4}}  # 4 blocks and the root: 5 units


def _nvme(path) -> dict:
    return {"zero": {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
                     "nvme_path": str(path), "nvme_block_mb": 0.0625}, **FOUR}


def _engine(overrides: dict):
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT

    cfg = make_config(overrides, 1, 6)
    torch.manual_seed(0)
    return Engine(GPT(cfg.model), cfg, torch.device("cpu"))


def _train(eng, start: int, n: int) -> None:
    b = eng.config.data.micro_batch_size
    for i, (X, Y) in enumerate(batches(start + n)):
        if i >= start:
            x, y = local_batch(X, Y, 0, 1, b)
            eng.backward(eng(x, y))
            eng.step()


def _placed(eng) -> list:
    home = eng.strategy.placement
    assert isinstance(home, infinity.NvmeOffload)
    return list(home.masters.values()) + list(home.states.values())


def _unit_bytes(eng) -> dict[int, int]:
    """Bytes of each unit's masters and moments (what one unit's states take)."""
    out: dict[int, int] = {}
    for p in _placed(eng):
        u = int(p.key.split(".")[0].removeprefix("unit"))
        out[u] = out.get(u, 0) + p.t.numel() * p.t.element_size()
    return out


# ----------------------------------------------------------------------------- writer
def test_streamed_file_is_byte_identical_to_save_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    tensors = {
        "b": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "a.10": torch.randn(7, generator=g),
        "a.2": torch.randn(2, 2, 2, generator=g, dtype=torch.float64),
        "B": torch.tensor(3.5),  # a scalar
        "empty": torch.zeros(0),
        "view": base.t(),  # not contiguous
        "half": torch.randn(5, generator=g).half(),
        "i64": torch.arange(9),
        "i32": torch.arange(4, dtype=torch.int32),
        "u8": torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g),
        "i8": torch.tensor([-1, 2], dtype=torch.int8),
        "i16": torch.tensor([-3, 4000], dtype=torch.int16),
        "mask": torch.tensor([True, False, True]),
        "f8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        "f8b": torch.randn(4, generator=g).to(torch.float8_e5m2),
    }
    # (one metadata key: safetensors writes several in its hash map's order, which varies)
    for meta in (None, {"format": "pt"}):
        want, got = tmp_path / "want.st", tmp_path / "got.st"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(want), metadata=meta)
        digest = stream.write(got, tensors, metadata=meta)
        assert got.read_bytes() == want.read_bytes()
        assert digest == hashlib.sha256(want.read_bytes()).hexdigest()
        back = load_file(str(got))
        assert all(torch.equal(back[k].float(), v.float()) for k, v in tensors.items())


def test_lazy_tensors_are_loaded_one_at_a_time(tmp_path):
    """A `Lazy` value is loaded only when its bytes are written, after the previous
    one's are; the file is the same as from the tensors themselves."""
    from zerotrain.zero.tiers.lazy import Lazy

    values = {f"t{i}": torch.full((100 + i,), float(i)) for i in range(5)}
    live, peak = [0], [0]

    def lazy(v):
        def load():
            t = v.clone()
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            weakref.finalize(t, lambda: live.__setitem__(0, live[0] - 1))
            return t
        return Lazy(v.shape, v.dtype, load)
    stream.write(tmp_path / "lazy.st", {k: lazy(v) for k, v in values.items()})
    save_file(values, str(tmp_path / "eager.st"))
    assert (tmp_path / "lazy.st").read_bytes() == (tmp_path / "eager.st").read_bytes()
    assert peak[0] == 1 and live[0] == 0


# ----------------------------------------------------------------------------- engines
def test_tier_checkpoint_is_save_files_and_equals_no_tier(tmp_path):
    """The rank file of an NVMe run is what save_file writes for its tensors, its
    manifest checksum is the file's, and it is byte for byte the file of the same
    training without a tier (bit-exact on CPU fp32); a no-tier run's file likewise."""
    files = {}
    for name, over in (("plain", {**STAGE3, **FOUR}), ("nvme", _nvme(tmp_path / "swap"))):
        eng = _engine(over)
        _train(eng, 0, 2)
        ckpt = eng.save_checkpoint(tmp_path / name)
        eng.close()
        st = ckpt / "rank00000.safetensors"
        redo = tmp_path / f"{name}.resaved"
        save_file(load_file(str(st)), str(redo))
        assert st.read_bytes() == redo.read_bytes(), name
        sums = json.loads((ckpt / "meta.json").read_text())["checksums"]
        assert sums[st.name] == hashlib.sha256(st.read_bytes()).hexdigest()
        files[name] = st.read_bytes()
    assert files["nvme"] == files["plain"]


def test_save_holds_about_one_unit_of_states(tmp_path):
    """During a save (with the finite-weights check before it) of an NVMe run, the
    states read from the tier and alive at once never exceed one unit's — far under
    half of them all; every state is read, and all are back in the tier after."""
    eng = _engine(_nvme(tmp_path / "swap"))
    _train(eng, 0, 2)
    per_unit = _unit_bytes(eng)
    total = sum(per_unit.values())
    assert len(per_unit) >= 4
    with LoadMeter() as seen:
        assert eng.strategy.weights_finite()
        eng.save_checkpoint(tmp_path / "ckpt")
    assert not any(p.resident for p in _placed(eng))  # nothing left in memory
    eng.close()
    # what resident() would have held: every master and moment at once
    assert seen.total >= total
    assert seen.peak <= max(per_unit.values()) < total / 2
    print(f"states {total} B in {len(per_unit)} units; save peak {seen.peak} B")


@pytest.mark.parametrize("source", ["same", "other_stage"])
def test_streamed_load_fills_the_tier_unit_by_unit(tmp_path, monkeypatch, source):
    """A load into an NVMe run (same layout: read per key; another stage: resliced per
    unit) holds at most one unit's states at a unit's end, leaves all of them in the
    tier, and trains on exactly like the same load into a run without a tier."""
    saver = _engine(_nvme(tmp_path / "s0") if source == "same" else
                    {"zero": {"stage": 1}, **FOUR})
    _train(saver, 0, 2)
    saver.save_checkpoint(tmp_path / "ckpt")
    saver.close()
    ref = _engine({**STAGE3, **FOUR})
    ref.load_checkpoint(tmp_path / "ckpt")
    _train(ref, 2, 2)
    want = full_params(ref)
    ref.close()

    eng = _engine(_nvme(tmp_path / "s1"))
    held: list[int] = []
    real = infinity.NvmeOffload.settle

    def settle(self, u):  # each unit's end: the bytes of states in memory
        held.append(sum(p.t.untyped_storage().nbytes() for p in _placed(eng)))
        real(self, u)
    monkeypatch.setattr(infinity.NvmeOffload, "settle", settle)
    eng.load_checkpoint(tmp_path / "ckpt")
    monkeypatch.setattr(infinity.NvmeOffload, "settle", real)
    assert not any(p.resident for p in _placed(eng))
    per_unit = _unit_bytes(eng)
    assert held and max(held) <= max(per_unit.values()) < sum(per_unit.values()) / 2
    _train(eng, 2, 2)
    got = full_params(eng)
    eng.close()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
