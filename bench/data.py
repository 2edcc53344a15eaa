"""Data pipeline at scale: throughput of `prepare`, and memory that does not grow with the corpus.

Run: .venv/bin/python bench/data.py [--sizes-mb 100 400 1200] [--bpe-sizes-mb 30 100]
     [--workdir /tmp/zt-bench-data] [--keep]
Prints a Markdown table and writes bench/results/data.json. Generated data is deleted
at the end (unless --keep).

Corpus: synthetic text written in 8 MB files (Zipf-distributed words from a fixed random
lexicon, lines and paragraphs), so a BPE has merges to learn and nothing is compressible
by accident. For each size, each measurement runs in a fresh process, so peak RSS
(VmHWM) is that phase's own:
- prepare (bytes, in-process; and BPE with a pool of workers): tokens/s and peak RSS of
  the main process and of the largest worker;
- a training rank's sampler: imports torch, opens the shards, draws `--steps` batches of
  16 x 256 tokens from the train split plus the validation batches; peak RSS above the
  RSS after imports. The same with memory-mapped reads instead of pread, to show why the
  reader does not map the shards.
Budgets (stated, checked): every prepare process <= 160 MiB; a sampling rank <= 64 MiB
above its post-import baseline. The largest corpus is >= 10x the prepare budget.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PREPARE_BUDGET_MIB = 160
SAMPLER_BUDGET_MIB = 64
FILE_MB = 8


def vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def vm_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def generate(folder: Path, size_mb: int, seed: int = 0) -> None:
    """Write ~size_mb of text in FILE_MB files, streaming (never the corpus in memory)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz", dtype=np.uint8)
    lexicon = [bytes(rng.choice(letters, rng.integers(2, 10))) for _ in range(20_000)]
    weights = 1.0 / np.arange(1, len(lexicon) + 1)
    weights /= weights.sum()
    for i in range(-(-size_mb // FILE_MB)):
        with open(folder / f"part_{i:04d}.txt", "wb") as f:
            written = 0
            while written < FILE_MB * 1_000_000:
                ids = rng.choice(len(lexicon), 50_000, p=weights)
                words = [lexicon[j] for j in ids]
                for k in range(12, len(words), 12):
                    words[k] = words[k] + (b".\n\n" if k % 120 == 0 else b"\n")
                blob = b" ".join(words)
                f.write(blob)
                written += len(blob)


# ----------------------------------------------------------------------------- children


def child_prepare(src: str, tokenizer: str, out: str, workers: int) -> dict:
    from zerotrain.data.shards import prepare

    t0 = time.perf_counter()
    m = prepare([src], tokenizer, out, workers=workers)
    dt = time.perf_counter() - t0
    worker_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"tokens": m["tokens"], "text_bytes": m["text_bytes"], "seconds": dt,
            "tokens_per_s": m["tokens"] / dt, "mb_per_s": m["text_bytes"] / dt / 1e6,
            "peak_main_mib": vm_hwm_mib(), "peak_worker_mib": worker_mib if workers else 0.0,
            "shards": len(m["shards"])}


def child_sample(folder: str, steps: int, read: str) -> dict:
    import torch  # noqa: F401  (a training rank has torch loaded: measure above that)

    from zerotrain.data.sampler import WindowSampler, eval_batches
    from zerotrain.data.token_shards import TokenShards

    base = vm_rss_mib()
    shards = TokenShards(folder)
    if read == "mmap":  # the alternative the reader avoids: pages stay mapped (and counted)
        maps = [shards.shard(i) for i in range(len(shards.lengths))]
        shards.read = lambda s, a, n: maps[s][a:a + n]  # type: ignore[method-assign]
    train, val = shards.split(0.01)
    sampler = WindowSampler(train, 256, seed=0)
    t0 = time.perf_counter()
    tokens = 0
    for step in range(steps):
        x, _ = sampler.batch(step, 0, 0, 1, 16, 1)
        tokens += x.numel()
    dt = time.perf_counter() - t0
    val_set = eval_batches(val, 256, 0, 1, 16, 8)
    return {"windows": sampler.n_windows, "val_batches": len(val_set), "steps": steps,
            "batches_per_s": steps / dt, "baseline_mib": base, "peak_mib": vm_hwm_mib(),
            "growth_mib": vm_hwm_mib() - base}


def run_child(*args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True,
                         text=True, env=env, check=False)
    if out.returncode:
        raise RuntimeError(f"child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- main


def measure(work: Path, size: int, tokenizer: str, label: str, workers: int, steps: int
            ) -> list[dict]:
    src, out = work / f"corpus_{size}", work / f"shards_{size}_{label}"
    if not src.exists():
        generate(src, size)
    rows = [{"size_mb": size, "phase": f"prepare {label} ({workers or 'no'} workers)",
             **run_child("prepare", str(src), tokenizer, str(out), str(workers))}]
    for read in ("pread", "mmap"):
        how = "pread, as shipped" if read == "pread" else "memmap reads: the rejected design"
        rows.append({"size_mb": size, "phase": f"sample {label} ({how})",
                     **run_child("sample", str(out), str(steps), read)})
    shutil.rmtree(out)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| corpus MB | phase | tokens/s | text MB/s | peak RSS MiB (main / worker) "
             "| sampler: RSS above imports MiB | within budget |",
             "|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if "tokens_per_s" in r:
            ok = max(r["peak_main_mib"], r["peak_worker_mib"]) <= PREPARE_BUDGET_MIB
            lines.append(f"| {r['size_mb']} | {r['phase']} | {r['tokens_per_s'] / 1e6:.2f}M | "
                         f"{r['mb_per_s']:.1f} | {r['peak_main_mib']:.0f} / "
                         f"{r['peak_worker_mib']:.0f} | | {'yes' if ok else 'NO'} |")
        else:
            ok = r["growth_mib"] <= SAMPLER_BUDGET_MIB
            lines.append(f"| {r['size_mb']} | {r['phase']} | | | {r['peak_mib']:.0f} | "
                         f"{r['growth_mib']:.1f} | {'yes' if ok else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 400, 1700])
    ap.add_argument("--bpe-sizes-mb", type=int, nargs="+", default=[30, 100])
    ap.add_argument("--bpe-vocab", type=int, default=8192)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--workdir", default="/tmp/zt-bench-data")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    try:
        from zerotrain.data.sources import iter_texts
        from zerotrain.data.tokenizer import train_bpe

        generate(work / "tok_train", 20, seed=1)
        t0 = time.perf_counter()
        train_bpe(iter_texts([work / "tok_train"]), a.bpe_vocab, work / "tok.json")
        bpe_train_s = time.perf_counter() - t0
        print(f"trained a {a.bpe_vocab}-token BPE on 20 MB in {bpe_train_s:.1f} s", flush=True)
        for size in a.sizes_mb:
            rows += measure(work, size, "bytes", "bytes", 0, a.steps)
            print(table(rows[-3:]).splitlines()[-3:], flush=True)
        for size in a.bpe_sizes_mb:
            rows += measure(work, size, str(work / "tok.json"), "bpe", a.workers, a.steps)
            print(table(rows[-3:]).splitlines()[-3:], flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    text = table(rows)
    print(text)
    res = Path(__file__).parent / "results"
    res.mkdir(exist_ok=True)
    (res / "data.json").write_text(json.dumps({
        "rows": rows, "bpe_train_seconds_20mb": bpe_train_s, "bpe_vocab": a.bpe_vocab,
        "budgets_mib": {"prepare": PREPARE_BUDGET_MIB, "sampler_growth": SAMPLER_BUDGET_MIB},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d %H:%M")}, indent=1))
    (res / "data.md").write_text(text + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        kind, *rest = sys.argv[2:]
        if kind == "prepare":
            res = child_prepare(rest[0], rest[1], rest[2], int(rest[3]))
        else:
            res = child_sample(rest[0], int(rest[1]), rest[2])
        print(json.dumps(res))
    else:
        main()
