"""Long sequences: activation checkpointing (true / offload) from the plan for any model,
and sequence tiling of the loss head and the MLP — each equal to the plain computation,
at ZeRO-0 and under ZeRO-3's unshard hooks."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from zerotrain.config import ConfigError, ModelConfig, build_config
from zerotrain.models import plan_for
from zerotrain.models.checkpointing import apply_checkpointing, checkpoint_mode
from zerotrain.models.gpt import GPT
from zerotrain.models.hf import HFCausalLM
from zerotrain.models.llama import Llama
from zerotrain.models.long_sequence import apply_tiling

from multirank import run_ranks
from zero_harness import rel_err, train_tiny

TILE = 5  # does not divide the 16-token sequences: a short last tile


def hf_llama() -> transformers.LlamaForCausalLM:
    conf = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=40,
                                    num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(conf)


FAMILIES = {
    "gpt": (lambda: GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)), 128),
    "llama": (lambda: Llama(ModelConfig(arch="llama", n_layer=2, n_head=2, n_embd=32,
                                        block_size=16)), 128),
    "hf": (hf_llama, 40),
}


def _loss(model, x, y):
    if isinstance(model, transformers.PreTrainedModel):
        return model(input_ids=x, labels=y).loss
    return model(x, y)


def _grads(model, x, y) -> tuple[float, dict]:
    loss = _loss(model, x, y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


class _Widest(TorchDispatchMode):
    """Largest leading size of any tensor an op produces whose last dim is `width`
    (parameter-shaped tensors — weights, their gradients — aside)."""

    def __init__(self, width: int, skip: set):
        super().__init__()
        self.width, self.rows, self.skip = width, 0, skip

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.ndim >= 2 and t.shape[-1] == self.width \
                    and tuple(t.shape) not in self.skip:
                self.rows = max(self.rows, t.numel() // self.width)
        return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("ckpt", [False, True, "offload"])
def test_tiled_and_checkpointed_equal_plain(family, ckpt):
    """Loss and every gradient equal (fp32, 1e-6 relative); `offload`'s bookkeeping
    (input stashed, restored for the recompute) runs on CPU with `force_stash`."""
    make, _ = FAMILIES[family]
    torch.manual_seed(0)
    plain = make().train()
    tiled = copy.deepcopy(plain)
    blocks = plan_for(tiled).blocks
    assert apply_tiling(tiled, blocks, TILE) == 2  # both MLPs tiled
    apply_checkpointing(blocks, ckpt, force_stash=True)
    assert all(checkpoint_mode(b) == bool(ckpt) for b in blocks)
    x, y = torch.randint(0, 256, (2, 3, 16), generator=torch.Generator().manual_seed(1))
    la, ga = _grads(plain, x, y)
    lb, gb = _grads(tiled, x, y)
    assert lb == pytest.approx(la, rel=1e-6)
    assert rel_err(gb, ga) < 1e-6
    # the tiled model still gives logits for generation
    with torch.no_grad():
        out = tiled.eval()(x) if family != "hf" else tiled.eval()(input_ids=x).logits
    assert out.shape == (3, 16, 256)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiles_bound_the_widest_tensors(family):
    """No [tokens × vocabulary] logits and no [tokens × intermediate] MLP activation
    beyond one tile, in forward or backward; untiled, both span all 48 tokens."""
    make, inter = FAMILIES[family]
    torch.manual_seed(0)
    x, y = torch.randint(0, 256, (2, 3, 16), generator=torch.Generator().manual_seed(1))
    for tile, most in ((None, 48), (TILE, TILE)):
        model = make().train()
        apply_tiling(model, plan_for(model).blocks, tile)
        shapes = {s for p in model.parameters()
                  for s in (tuple(p.shape), tuple(p.shape)[::-1])}
        for width in (256, inter):
            with _Widest(width, shapes) as w:
                _loss(model, x, y).backward()
            assert w.rows == most, (tile, width, w.rows)


def test_hf_wrapper_tiles_from_hidden_states():
    """zerotrain's own HF wrapper (model.hf) takes already-shifted targets, tiled too."""
    torch.manual_seed(0)
    inner = hf_llama()
    cfg = ModelConfig(hf="unused", block_size=16)
    plain = HFCausalLM(inner, cfg, {})
    tiled = copy.deepcopy(plain)
    apply_tiling(tiled, plan_for(tiled).blocks, TILE)
    x, y = torch.randint(0, 256, (2, 3, 16), generator=torch.Generator().manual_seed(1))
    la, ga = _grads(plain, x, y)
    lb, gb = _grads(tiled, x, y)
    assert lb == pytest.approx(la, rel=1e-6) and rel_err(gb, ga) < 1e-6


def test_bad_settings_are_one_config_error():
    with pytest.raises(ConfigError, match=r"sequence\.tile_tokens"):
        build_config({"sequence": {"tile_tokens": 0}})
    with pytest.raises(ConfigError, match=r"model\.activation_checkpointing"):
        build_config({"model": {"activation_checkpointing": "sometimes"}})
    assert build_config({"model": {"activation_checkpointing": "offload"}}).model \
        .activation_checkpointing == "offload"
    # a model with no output head to tile
    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError, match=r"sequence\.tile_tokens"):
        apply_tiling(net, (), 8)
    # an HF family that transforms its logits after the head
    m = hf_llama()
    m.config.final_logit_softcapping = 30.0
    with pytest.raises(ConfigError, match="final_logit_softcapping"):
        apply_tiling(m, (), 8)


# ----------------------------------------------------------------------------- engine

def _cases(family: str) -> list[dict]:
    """Plain, tiled + checkpointed, tiled + offloaded (forced stash on CPU); tiled alone
    is the unit test's (test_tiled_and_checkpointed_equal_plain)."""
    arch = {"model": {"arch": "llama"}} if family == "llama" else {}
    ck = {"model": {**arch.get("model", {}), "activation_checkpointing": True},
          "sequence": {"tile_tokens": TILE}}
    return [arch, ck, {**ck, "force_stash": True}]


def _train(stage: int, families: list[str], steps: int = 3, short: bool = False) -> dict:
    """`short`: plain and tiled + offloaded only (the most moving parts; spawned ranks are
    slow)."""
    out = {}
    for f in families:
        runs = []
        for case in _cases(f)[::2] if short else _cases(f):
            case = {**copy.deepcopy(case), "zero": {"stage": stage}}
            force = case.pop("force_stash", False)

            def probe(eng, force=force):
                if force:  # the offload path's stash on CPU (CUDA streams aside)
                    apply_checkpointing(eng.plan.blocks, "offload", force_stash=True)

            res = train_tiny(case, steps, model_fn=hf_llama if f == "hf" else None,
                             probe=probe)
            runs.append({k: res[k] for k in ("losses", "norms", "params")})
        out[f] = runs
    return out


def _check(runs: list[dict]) -> None:
    ref = runs[0]
    for r in runs[1:]:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-6)
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert rel_err(r["params"], ref["params"]) < 1e-5


def test_engine_zero0_tiled_and_checkpointed_equal_plain():
    for runs in _train(0, sorted(FAMILIES)).values():
        _check(runs)


def test_engine_zero3_tiled_and_checkpointed_equal_plain():
    """Two ranks at ZeRO-3: the recompute re-gathers the unit, the tiled head reads the
    gathered root unit; every variant trains like the plain run of the same stage."""
    res = run_ranks(_train, 2, 3, sorted(FAMILIES), 3, True)
    for runs in res[0].values():
        _check(runs)


def test_library_mode_checkpoints_any_module():
    """`zerotrain.initialize` checkpoints the default plan's blocks of a model it does not
    know (a raw HF GPT-2) when the config asks, and says once that offload is checkpointing
    on a CPU."""
    import zerotrain

    conf = transformers.GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(conf)
    eng = zerotrain.initialize(model, {"model": {"activation_checkpointing": "offload"},
                                       "train": {"device": "cpu"}})
    assert all(checkpoint_mode(b) for b in eng.plan.blocks) and len(eng.plan.blocks) == 2
    x = torch.randint(0, 64, (2, 8))
    eng.backward(eng(input_ids=x, labels=x).loss)
    assert eng.step() is not None
    eng.close()


# ----------------------------------------------------------------------------- estimator


def measured_peak(step) -> int:
    """Peak bytes the CPU allocator held above the start while `step()` ran, from the
    profiler's allocation and free events (tensor accounting, not the resident set)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live = top = 0
    for e in events:
        live += e.nbytes()
        top = max(top, live)
    return top


V_EST = 1024
SEQS = (512, 1024, 2048)
HF_EST = {"model_type": "llama", "vocab_size": V_EST, "hidden_size": 64,
          "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 4, "max_position_embeddings": 2048}


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("family", ["gpt", "llama", "hf"])
@pytest.mark.parametrize("ckpt,tile", [(False, None), (True, None), (False, 64), (True, 64)])
def test_activation_prediction_matches_measured_peaks(family, ckpt, tile, one_thread):
    """The estimator's activation peak (memory/activations.py) within 10% of the measured
    peak of a forward + backward at three lengths (fp32, parameters' gradients already
    allocated, as from the second step on). One thread, as the model assumes: the CPU
    attention kernel's scratch grows with the thread count, and an in-process training
    run earlier in the session may have raised it (run/setup.py sets train.threads)."""
    from zerotrain.memory import activation_parts

    torch.manual_seed(0)
    cfg = ModelConfig(arch="gpt" if family == "gpt" else "llama", n_layer=2, n_head=4,
                      n_embd=64, block_size=2048, vocab_size=V_EST,
                      activation_checkpointing=ckpt)
    if family == "hf":
        conf = {k: v for k, v in HF_EST.items() if k != "model_type"}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**conf))
    else:
        model = GPT(cfg) if family == "gpt" else Llama(cfg)
    blocks = plan_for(model).blocks
    apply_checkpointing(blocks, ckpt)
    apply_tiling(model, blocks, tile)
    for seq in SEQS:
        x, y = torch.randint(0, V_EST, (2, 1, seq))
        _loss(model, x, y).backward()
        got = measured_peak(lambda x=x, y=y: _loss(model, x, y).backward())
        pred = activation_parts(cfg, 1, seq, act_bytes=4, tile_tokens=tile, device="cpu",
                                hf_config=HF_EST if family == "hf" else None).peak
        assert pred == pytest.approx(got, rel=0.10), (seq, got, pred)


def test_estimate_max_seq_is_the_inverse(tmp_path, capsys):
    """--max-seq: the answer's predicted peak per rank (the one the table prints: states,
    activations, transients) fits and one token more does not; tiling and checkpointing
    each lengthen it; offload (on CUDA) lengthens it further and says what the host holds."""
    import json

    from zerotrain.cli.estimate import main_estimate
    from zerotrain.cli.estimate_peaks import peak_at, predict_peaks
    from zerotrain.config import load_config

    path = tmp_path / "run.yaml"
    path.write_text("model: {arch: llama, n_layer: 8, n_head: 2, n_embd: 128, "
                    "vocab_size: 32000, block_size: 4096}\n"
                    "data: {micro_batch_size: 1}\nprecision: {dtype: fp32}\n")
    cfg = load_config(str(path))

    def longest(*flags: str) -> dict:
        assert main_estimate(["--model", str(path), "--gpus", "2", "--stage", "3",
                              "--gpu-mem", "1GiB", "--device", "cuda", "--max-seq",
                              "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    rep = longest()
    row = rep["rows"][0]
    n = row["max_seq"]
    peak = peak_at(cfg, 2, 3, device="cuda", micro_batch=1)
    assert peak(n) <= 2**30 < peak(n + 1) and row["max_seq_peak_bytes"] == peak(n)
    at_n = predict_peaks(cfg, 2, 3, device="cuda", micro_batch=1, seq=n)
    assert max(at_n["init"], at_n["steady"]) == peak(n)
    tiled = longest("--tile-tokens", "512")["rows"][0]["max_seq"]
    both = longest("--tile-tokens", "512", "--activation-checkpointing")["rows"][0]["max_seq"]
    off = longest("--tile-tokens", "512", "--activation-checkpointing", "offload")["rows"][0]
    assert n < tiled < both < off["max_seq"] and off["max_seq_activation_host_bytes"] > 0
    # sequence.parallel 2: each rank takes T/2 tokens, so the answer is a multiple of 2 —
    # it fits and the next multiple does not — and it is longer than without SP
    path.write_text(path.read_text() + "sequence: {parallel: 2}\n")
    sp_peak = peak_at(load_config(str(path)), 2, 3, device="cuda", micro_batch=1)
    m = longest()["rows"][0]["max_seq"]
    assert m % 2 == 0 and m > n
    assert sp_peak(m) <= 2**30 < sp_peak(m + 2)


class _Recording:
    """Stands in for CUDA's streams and events in `HostStash` (models/checkpointing.py),
    logging the order of its calls; copies are plain CPU copies."""

    def __init__(self):
        from zerotrain.models.checkpointing import HostCopies

        self.log: list[tuple] = []
        self.copies, self.n = HostCopies(), 0
        rec = self

        class Stream:
            def __init__(self, name):
                self.name = name

            def wait_stream(self, other):
                rec.log.append(("wait_stream", self.name, other.name))

            def wait_event(self, ev):
                rec.log.append(("wait_event", self.name, ev.id))

        class Event:
            def __init__(self):
                rec.n += 1
                self.id = rec.n

            def record(self, stream):
                rec.log.append(("record", stream.name, self.id))

        self.Stream, self.Event = Stream, Event

    def side(self, device):
        return self.Stream("side")

    def current(self, device):
        return self.Stream("current")

    def on(self, stream):
        import contextlib

        self.log.append(("on", stream.name))
        return contextlib.nullcontext()

    def event(self):
        return self.Event()

    def host_like(self, x):
        self.log.append(("host_like",))
        return self.copies.host_like(x)

    def device_like(self, t, device):
        self.log.append(("device_like",))
        return self.copies.device_like(t, device)

    def keep(self, t, stream):
        self.log.append(("keep", stream.name))

    def recycle(self, host):
        pass


def test_offload_orders_its_copies(monkeypatch):
    """The offload path's stream discipline, with CUDA's calls stood in for: each input
    goes to the host on the side stream after it waited for the current one, and is
    kept until that copy ends; in backward each comes back after its copy to the host
    completed, the current stream waits for it before the recompute reads it, and the
    previous block's input starts coming back before that block needs it."""
    from zerotrain.models import checkpointing

    rec = _Recording()
    monkeypatch.setattr(checkpointing, "HOST_COPIES", rec)
    get = checkpointing.HostStash.get

    def logged_get(self):
        rec.log.append(("get",))
        return get(self)

    monkeypatch.setattr(checkpointing.HostStash, "get", logged_get)
    torch.manual_seed(0)
    model = Llama(ModelConfig(arch="llama", n_layer=3, n_head=2, n_embd=32, block_size=16))
    plain = copy.deepcopy(model)
    apply_checkpointing(model.blocks, "offload", force_stash=True)
    x, y = torch.randint(0, 256, (2, 2, 16))
    _, ga = _grads(plain, x, y)
    n_fwd = len(rec.log)
    _, gb = _grads(model, x, y)
    assert rel_err(gb, ga) < 1e-6
    log = rec.log[n_fwd:]
    # forward, per block: side waits for current, the copy on side, x kept, event recorded
    fwd = [e for e in log if e[0] in ("wait_stream", "host_like", "on", "keep")][:12]
    assert fwd == [("wait_stream", "side", "current"), ("host_like",), ("on", "side"),
                   ("keep", "side")] * 3
    d2h = [e[2] for e in log if e[0] == "record"][:3]  # each block's copy-to-host event
    rest = log[log.index(("record", "side", d2h[-1])) + 1:]
    # backward: block 2 fetched on demand, then 1 and 0 prefetched by their successor
    waits_side = [e[2] for e in rest if e[:2] == ("wait_event", "side")]
    assert waits_side == d2h[::-1]  # each copy back waits for its own copy to the host
    h2d = [e[2] for e in rest if e[0] == "record"]
    consumed = [e[2] for e in rest if e[:2] == ("wait_event", "current")]
    assert consumed == h2d  # the recompute waits for exactly the copy that brought it
    # block i-1's copy back is queued as soon as block i has its input (before block
    # i-1 asks for its own): its wait on side comes right after block i's current wait;
    # the side stream first waits for the compute stream, whose pool gave the block
    for i in range(2):
        at = rest.index(("wait_event", "current", consumed[i]))
        assert rest[at + 1:at + 5] == [("device_like",), ("wait_stream", "side", "current"),
                                       ("on", "side"), ("wait_event", "side", d2h[1 - i])]


def test_train_run_with_tiles_and_checkpointing_equals_plain(tmp_path):
    """`zerotrain train` with sequence.tile_tokens and model.activation_checkpointing:
    the same losses as the plain run, and the per-phase line models the activations."""
    import json

    from zerotrain.run.loop import train

    from zero_harness import run_config, train_losses

    plain = run_config(tmp_path, "plain", 3, model={"arch": "llama"})
    long = run_config(tmp_path, "long", 3, model={"arch": "llama",
                                                 "activation_checkpointing": True},
                      sequence={"tile_tokens": 24})
    train(plain)
    train(long)
    a, b = train_losses(tmp_path / "plain"), train_losses(tmp_path / "long")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert all(b[s] == pytest.approx(a[s], rel=1e-5) for s in a), (a, b)
    recs = [json.loads(x) for x in (tmp_path / "long" / "metrics.jsonl").read_text()
            .splitlines()]
    assert any(r["type"] == "memory_phases" and r["activations_modelled"] for r in recs)
