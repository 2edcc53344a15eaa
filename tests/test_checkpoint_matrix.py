"""The checkpoint matrix: every checkpoint moves between every stage and world size.

Sources: every (stage 0–3, ± Offload where the config allows it (stages 2–3), ± Muon)
at world 1, 2 and 3 — 36 checkpoints of the harness's tiny GPT, each saved after
`BEFORE` steps by a run that then goes on `AFTER` steps: the uninterrupted run.
Targets: every (stage 0–3, world 1–3), with the source's optimizer (a change of
optimizer is refused; test_muon_checkpoint.py). For each of the 36 × 12 pairs:

1. the state the target holds right after loading — every master weight, every
   optimizer state element, every step count, as the live engine keeps them — equals
   what the source held when it saved, bit for bit (resharding only copies);
2. `AFTER` steps later its weights equal the uninterrupted run's bit for bit where the
   topology (stage, world) is the source's; elsewhere within `TOL` (see there).

And from each source: the safetensors and Hugging Face exports equal the saved master
weights, and every element of every saved tensor is on disk once (stage 0 at N ranks
writes its replicated state once, split across the ranks).

Speed: one spawn of 3 processes does all of it. They share a store (hosted by the test
process) and regroup: all 3 form world 3; then ranks 0–1 form world 2 while rank 2 works
alone as world 1. Each world saves its 12 sources, then — once all 36 exist — builds one
engine per (target stage, optimizer) and loads every matching source into it in turn.
The references (each source's state pieces, its uninterrupted weights) go through
files, so no process needs another's memory.
"""

from __future__ import annotations

import datetime
import functools
import math
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from zerotrain.comm.dist import world
from zerotrain.config import deep_merge
from zerotrain.engine import Engine
from zerotrain.models.gpt import GPT
from zerotrain.zero.state import StrategyState

from multirank import run_ranks
from zero_harness import batches, full_params, local_batch, make_config

BEFORE, AFTER = 2, 1  # steps before the save, steps after it
WORLDS = (1, 2, 3)
STAGES = (0, 1, 2, 3)
SOURCES = [
    (stage, off, muon)
    for stage in STAGES
    for off in ((False, True) if stage >= 2 else (False,))
    for muon in (False, True)
]
MUON = {"optimizer": {"name": "muon", "lr": 0.02}}
# Worst per-tensor ‖resumed − uninterrupted‖ / ‖uninterrupted‖ where the topology
# changes. The loaded state is exact (check 1), so only the order gradients are summed in
# differs (all-reduce vs reduce-scatter, 1 vs N partial sums): fp32 rounding, ~1e-7 of
# the gradient, which Adam's and Muon's normalised updates pass on as ~1e-7 of one
# lr-sized step. Measured worst over the 432 pairs: 1.0e-6 (the test prints it), so TOL
# leaves 10×; the state errors TOL must catch are far above it — zeroed moments give
# 0.34, a reset optimizer 0.5 (measured on the stage-0 sources, Adam and Muon).
TOL = 1e-5


def overrides(stage: int, off: bool, muon: bool) -> dict:
    # Speed: fewer, larger buckets (still 3 units, cut mid-parameter at 2 and 3 ranks)
    # and no lockstep check, which doubles the collectives: a mismatch would show as
    # run_ranks' timeout instead of an error; other tests keep the check.
    o: dict = {"zero": {"stage": stage, "bucket_mb": 0.05}, "comm": {"check_lockstep": False}}
    if off:
        o["zero"]["offload_optimizer"] = "cpu"
    return deep_merge(o, MUON) if muon else o


def src_name(stage: int, off: bool, muon: bool, w: int) -> str:
    return f"z{stage}{'-offload' if off else ''}{'-muon' if muon else ''}-w{w}"


def _engine(over: dict, seed: int) -> Engine:
    _, n = world()
    cfg = make_config(over, n, 10)
    torch.manual_seed(seed)
    return Engine(GPT(cfg.model), cfg, torch.device("cpu"))


def _train(eng: Engine, data: list) -> None:
    rank, n = world()
    b = eng.config.data.micro_batch_size
    for X, Y in data:
        eng.backward(eng(*local_batch(X, Y, rank, n, b)))
        eng.step()


# ----------------------------------------------------------------------------- state pieces


def _meets(unit: dict, lo: int, hi: int) -> list[tuple[str, int, int, int]]:
    """(parameter, start, stop, offset from lo) for each parameter of the unit that its
    flat range [lo, hi) meets."""
    out = []
    for name, shape, off, _g in unit["params"]:
        x, y = max(lo, off), min(hi, off + math.prod(shape))
        if x < y:
            out.append((name, x - off, y - off, x - lo))
    return out


def state_pieces(eng: Engine) -> list[tuple]:
    """(kind, parameter, start, stop, values): everything this rank's engine holds of
    the model state — its master range and every state of every optimizer tensor (found
    by the tensor, not by any index a checkpoint uses); "step" as a one-element piece."""
    s = eng.strategy
    units = s.layout()["units"]
    out = []
    for u in s.units:
        lo, hi = s.opt_range(u)
        out += [
            ("master", p, a, b, u.master[o : o + b - a].clone())
            for p, a, b, o in _meets(units[u.index], lo, hi)
        ]
    for seg, view in s.opt_segments:
        for kind, v in eng.optimizer.state.get(view, {}).items():
            for p, a, b, o in _meets(units[seg.unit], seg.start, seg.end):
                out.append(
                    ("step", p, 0, 1, torch.tensor([float(v)]))
                    if kind == "step"
                    else (kind, p, a, b, v.reshape(-1)[o : o + b - a].clone())
                )
    return out


def assemble(pieces: list[tuple], sizes: dict[str, int]) -> dict[tuple[str, str], torch.Tensor]:
    """Full per-parameter tensors from every rank's pieces; overlapping pieces (stage 0's
    replicas) must agree and every element must be covered."""
    full: dict[tuple[str, str], torch.Tensor] = {}
    seen: dict[tuple[str, str], torch.Tensor] = {}
    for kind, name, a, b, v in pieces:
        n = 1 if kind == "step" else sizes[name]
        t = full.setdefault((kind, name), torch.zeros(n, dtype=v.dtype))
        m = seen.setdefault((kind, name), torch.zeros(n, dtype=torch.bool))
        both = m[a:b]
        assert torch.equal(t[a:b][both], v[both]), f"replicas of {kind} {name} differ"
        t[a:b] = v
        m[a:b] = True
    for key, m in seen.items():
        assert bool(m.all()), f"{key} is not fully covered"
    return full


# ----------------------------------------------------------------------------- the ranks


def _save_sources(root: Path) -> None:
    """This world's 12 sources: train, save, record the state, go on (uninterrupted)."""
    rank, n = world()
    data = list(batches(BEFORE + AFTER))
    for stage, off, muon in SOURCES:
        name = src_name(stage, off, muon, n)
        eng = _engine(overrides(stage, off, muon), 0)
        _train(eng, data[:BEFORE])
        rng = torch.get_rng_state()  # what the checkpoint records of this rank's stream
        eng.save_checkpoint(root / "ck" / name)
        if stage == 0 and n == 2:  # as zerotrain wrote it before: every rank all it holds
            with mock.patch.object(StrategyState, "write_range", lambda self, u: self.opt_range(u)):
                eng.save_checkpoint(root / "legacy" / name)
        ref = root / "ref" / name
        ref.mkdir(parents=True, exist_ok=True)
        save_file(
            {"|".join(map(str, p[:4])): p[4] for p in state_pieces(eng)} | {"rng": rng},
            str(ref / f"rank{rank}.safetensors"),
        )
        _train(eng, data[BEFORE:])
        params = full_params(eng)
        if rank == 0:
            save_file(params, str(ref / "after.safetensors"), metadata={"world": str(n)})
        eng.close()


@functools.cache
def _reference(root: Path, name: str) -> dict:
    """A source's state when it saved (assembled from its ranks' pieces) and its weights
    after the uninterrupted steps."""
    ref = root / "ref" / name
    with safe_open(str(ref / "after.safetensors"), "pt") as f:
        n = int(f.metadata()["world"])
    params = load_file(str(ref / "after.safetensors"))
    pieces, rng = [], []
    for r in range(n):
        tensors = load_file(str(ref / f"rank{r}.safetensors"))
        rng.append(tensors.pop("rng"))
        for key, v in tensors.items():
            kind, name_, a, b = key.split("|")
            pieces.append((kind, name_, int(a), int(b), v))
    return {
        "state": assemble(pieces, {k: v.numel() for k, v in params.items()}),
        "params": params,
        "rng": rng,
    }


def _load_sources(root: Path) -> list[dict]:
    """Load every source into one engine per (target stage, optimizer) of this world."""
    rank, n = world()
    data = list(batches(BEFORE + AFTER))
    out = []
    for muon in (False, True):
        for stage in STAGES:
            eng = _engine(overrides(stage, False, muon), 99)
            for s_stage, off, s_muon in SOURCES:
                if s_muon != muon:
                    continue
                for w in WORLDS:
                    name = src_name(s_stage, off, muon, w)
                    ref = _reference(root, name)
                    torch.manual_seed(len(out))  # a stream the checkpoint must replace
                    eng.load_checkpoint(root / "ck" / name)
                    # rank r's random stream continues where rank r of the source was
                    rng = w != n or torch.equal(torch.get_rng_state(), ref["rng"][rank])
                    pieces = state_pieces(eng)
                    wrong = sorted(
                        {
                            (k, p)
                            for k, p, a, b, v in pieces
                            if (k, p) not in ref["state"]
                            or not torch.equal(ref["state"][k, p][a:b], v)
                        }
                    )
                    # every state the source had is held by some rank: checked by the
                    # parent over all ranks' `held`
                    held = {(k, p) for k, p, *_ in pieces}
                    _train(eng, data[BEFORE:])
                    got, want = full_params(eng), ref["params"]
                    equal = all(torch.equal(got[k], want[k]) for k in want)
                    rel = max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want)
                    out.append(
                        {
                            "src": name,
                            "tgt": (stage, n),
                            "wrong": wrong[:3],
                            "same": (s_stage, w) == (stage, n),
                            "rng": rng,
                            "held": held,
                            "equal": equal,
                            "rel": rel,
                        }
                    )
            eng.close()
    return out


def _regroup(store, tag: str, rank: int, size: int) -> None:
    if size > 1:
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(tag, store), rank=rank, world_size=size
        )


def _matrix(root: str, port: int) -> list[dict]:
    root_p = Path(root)
    rank = dist.get_rank()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300)
    )

    def all_at(key: str) -> None:  # the three processes wait for one another
        store.add(key, 1)
        while int(store.add(key, 0)) < 3:
            time.sleep(0.01)

    def in_worlds(work) -> list:
        """`work` at world 3; then at world 2 (ranks 0–1) beside world 1 (rank 2)."""
        res = work(root_p)
        dist.destroy_process_group()
        size, sub_rank = (2, rank) if rank < 2 else (1, 0)
        _regroup(store, f"{work.__name__}2", sub_rank, size)
        res2 = work(root_p)
        if size > 1:
            dist.destroy_process_group()
        _regroup(store, f"{work.__name__}3", rank, 3)
        return (res or []) + (res2 or [])

    in_worlds(_save_sources)
    all_at("saved")
    results = in_worlds(_load_sources)
    for r in results:
        r["rank"] = rank
    return results  # the world-3 group stays open for run_ranks' closing barrier


# ----------------------------------------------------------------------------- the test


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> tuple[Path, list[dict], float]:
    root = tmp_path_factory.mktemp("matrix")
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=300),
    )
    t0 = time.perf_counter()
    per_rank = run_ranks(_matrix, 3, str(root), store.port)
    return root, [r for rank in per_rank for r in rank], time.perf_counter() - t0


def test_every_checkpoint_resumes_at_every_stage_and_world_size(matrix):
    root, results, seconds = matrix
    pairs: dict[tuple, list[dict]] = {}
    for r in results:
        pairs.setdefault((r["src"], r["tgt"]), []).append(r)
    assert len(pairs) == len(SOURCES) * len(WORLDS) * len(STAGES) * len(WORLDS) == 432
    worst = 0.0
    for (src, tgt), ranks in sorted(pairs.items()):
        assert len(ranks) == tgt[1]
        wrong = [w for r in ranks for w in r["wrong"]]
        assert not wrong, f"{src} -> stage {tgt[0]} world {tgt[1]}: loaded state differs: {wrong}"
        assert all(r["rng"] for r in ranks), f"{src} -> {tgt}: the RNG did not carry over"
        ref = _reference(root, src)
        held = set().union(*(r["held"] for r in ranks))
        assert held == set(ref["state"]), f"{src} -> {tgt}: states {set(ref['state']) ^ held}"
        r = ranks[0]
        if r["same"]:
            assert r["equal"], f"{src} -> {tgt}: same topology but not bit-exact ({r['rel']:.1e})"
        else:
            assert r["rel"] < TOL, f"{src} -> {tgt}: {r['rel']:.1e} from the uninterrupted run"
            worst = max(worst, r["rel"])
    print(
        f"\n[matrix] 432 pairs in {seconds:.1f} s; worst relative weight difference "
        f"where the topology changed: {worst:.1e}"
    )


def _ck(root: Path, name: str) -> Path:
    from zerotrain.checkpoint import resolve

    return resolve(root / "ck" / name)


def test_every_checkpoint_exports_its_master_weights(matrix, tmp_path):
    """safetensors and Hugging Face exports (through the CLI) equal the saved masters."""
    from zerotrain.cli.export import main_export
    from zerotrain.models.hf_export import hf_name

    root = matrix[0]
    for stage, off, muon in SOURCES:
        for w in WORLDS:
            name = src_name(stage, off, muon, w)
            ref = _reference(root, name)
            masters = {
                p: ref["state"]["master", p].view(ref["params"][p].shape)
                for (k, p) in ref["state"]
                if k == "master"
            }
            plain, hf = tmp_path / f"{name}.safetensors", tmp_path / f"{name}-hf"
            assert main_export([str(root / "ck" / name), "--out", str(plain)]) == 0
            assert main_export([str(root / "ck" / name), "--out", str(hf), "--format", "hf"]) == 0
            got = load_file(str(plain))
            assert torch.equal(got["head.weight"], masters["wte.weight"])  # tied
            assert all(torch.equal(got[p], v) for p, v in masters.items()), name
            got = load_file(str(hf / "model.safetensors"))
            for p, v in masters.items():
                hf_p, transposed = hf_name("gpt", p)
                assert torch.equal(got[hf_p], v.t() if transposed else v), (name, p)


def _elements(ck: Path, prefix: str) -> int:
    """Elements of every elementwise tensor named `prefix`… over all rank files (the
    optimizer's one-number `step`s aside: one per optimizer tensor, by design)."""
    total = 0
    for f in sorted(ck.glob("rank*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in list(h.keys()):  # a safetensors handle, not a dict
                if k.startswith(prefix) and not k.endswith(".step"):
                    total += int(torch.Size(h.get_slice(k).get_shape()).numel())
    return total


def test_every_element_is_written_once(matrix):
    """On disk, the master weights are each unit's padded length once and the optimizer
    state is the same number of elements at every world size: stage 0 at N ranks writes
    its replicated state once, each rank its slice."""
    from zerotrain.checkpoint.io import read_meta

    root = matrix[0]
    for stage, off, muon in SOURCES:
        one = _elements(_ck(root, src_name(stage, off, muon, 1)), "optim.")
        for w in WORLDS:
            ck = _ck(root, src_name(stage, off, muon, w))
            padded = sum(u["padded_numel"] for u in read_meta(ck)["layout"]["units"])
            assert _elements(ck, "strategy.master.") == padded, (stage, off, muon, w)
            assert _elements(ck, "optim.") == one, (stage, off, muon, w)
    sizes = {
        w: sum(f.stat().st_size for f in _ck(root, src_name(0, False, False, w)).iterdir())
        for w in WORLDS
    }
    print(f"\n[matrix] stage-0 checkpoint bytes by world size: {sizes}")


def test_duplicated_stage0_checkpoints_still_load(matrix, tmp_path):
    """Stage 0 at N ranks used to write its whole replicated state on every rank. Such
    checkpoints still export and reshard: the copies are compared and read once; copies
    that differ are one clear error."""
    import hashlib
    import json
    import shutil

    from zerotrain.checkpoint import CheckpointError, consolidate, resolve
    from zerotrain.checkpoint.io import read_meta

    root = matrix[0]
    for muon in (False, True):
        name = src_name(0, False, muon, 2)
        ck = resolve(root / "legacy" / name)
        ref = _reference(root, name)
        padded = sum(u["padded_numel"] for u in read_meta(ck)["layout"]["units"])
        assert _elements(ck, "strategy.master.") == 2 * padded  # really duplicated
        weights, _ = consolidate(ck)
        assert all(
            torch.equal(weights[p].reshape(-1), ref["state"]["master", p])
            for (k, p) in ref["state"]
            if k == "master"
        )
        for stage in (0, 3):  # replicated again, and sharded (here on one rank)
            eng = _engine(overrides(stage, False, muon), 99)
            eng.load_checkpoint(ck)
            pieces = state_pieces(eng)
            assert {(k, p) for k, p, *_ in pieces} == set(ref["state"])
            assert all(torch.equal(ref["state"][k, p][a:b], v) for k, p, a, b, v in pieces)
    # rank 1's copy of one master weight changed (checksums made to match): refused
    bad = tmp_path / "bad"
    shutil.copytree(resolve(root / "legacy" / src_name(0, False, False, 2)), bad)
    f = bad / "rank00001.safetensors"
    tensors = load_file(str(f))
    tensors["strategy.master.0"][3] += 1.0
    save_file(tensors, str(f))
    digest = hashlib.sha256(f.read_bytes()).hexdigest()
    js = bad / "rank00001.json"
    js.write_text(json.dumps(dict(json.loads(js.read_text()), sha256=digest)))
    meta = json.loads((bad / "meta.json").read_text())
    meta["checksums"].update({f.name: digest, js.name: hashlib.sha256(js.read_bytes()).hexdigest()})
    (bad / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(
        CheckpointError,
        match=r"saved different copies of .* it is "
        r"inconsistent: use another checkpoint \(an earlier step_\* folder\)",
    ):
        consolidate(bad)


def test_saved_shards_read_any_range(matrix):
    """The reader under resharding (from the retired test_reshard_across_stages_and_world_
    sizes): a 2-rank ZeRO-2 checkpoint consolidates to its masters; each parameter's
    states are named; a state read in two halves that cross the ranks' cut equals the
    whole and the source's state (at 2 ranks the units are cut mid-parameter)."""
    from zerotrain.checkpoint import consolidate, resolve
    from zerotrain.checkpoint.io import read_meta
    from zerotrain.checkpoint.reshard import SavedShards

    root = matrix[0]
    name = src_name(2, False, False, 2)
    ck = resolve(root / "ck" / name)
    ref = _reference(root, name)
    weights, meta = consolidate(ck)
    assert meta["layout"]["world_size"] == 2
    saved = SavedShards(ck, read_meta(ck))
    for k, v in ref["params"].items():
        assert torch.equal(weights[k].reshape(-1), ref["state"]["master", k]), k
        assert saved.state_names([k]) == ["exp_avg", "exp_avg_sq", "step"]
        assert float(saved.scalars[("step", k)]) == BEFORE
        n = v.numel()
        whole = saved.read("exp_avg", k, 0, n)
        assert torch.equal(whole, ref["state"]["exp_avg", k])
        for cut in (n // 3, n // 2):
            assert torch.equal(
                torch.cat([saved.read("exp_avg", k, 0, cut), saved.read("exp_avg", k, cut, n)]),
                whole,
            )
