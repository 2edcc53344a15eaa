"""The full combination matrix (issue 29, item 2): every pair of option values in a 3-step
run on 2 ranks, each held against its reference; every refused pair refused at config
time with one line naming both settings.

Run: PYTHONPATH=src .venv/bin/python bench/matrix.py [--quick]
Prints a Markdown table and writes bench/results/matrix.json. The plan (factors, refused
pairs, the covering array) is tests/matrix_plan.py; the runs and their references are
tests/matrix_run.py (the suite's tests/test_matrix.py runs the --quick subset).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import matrix_plan as mp  # noqa: E402
import matrix_run as mr  # noqa: E402

from multirank import run_ranks  # noqa: E402

SHORT = {
    "stage": "st",
    "offload": "off",
    "tier": "tier",
    "fp8": "fp8",
    "wire": "wire",
    "ckpt": "ckpt",
    "tiles": "tile",
    "sp": "sp",
    "docmask": "doc",
    "labels": "lab",
    "optim": "opt",
    "accum": "acc",
    "hpz": "hpZ",
    "gwire": "qgZ",
}


def refusals() -> list[dict]:
    """Each refused pair, tried in a config that holds it and nothing else refused."""
    out = []
    for (a, b), why in mp.REFUSED.items():
        msg = mr.refusal(mp.refusal_row(a, b))
        names = (mp.setting(*a), mp.setting(*b))
        ok = msg is not None and "\n" not in msg and all(n in msg for n in names)
        out.append({"pair": [list(a), list(b)], "why": why, "refusal": msg, "ok": ok})
    return out


def one_process(rows: list[dict], results: list[dict]) -> list[dict]:
    """Each distinct FP8-off reference (stage 0 on 2 ranks) against one process on the
    whole batch: the references themselves are held to the single-process run (FP8
    references are not: each rank scales its own micro-batch's activations)."""
    seen, out = set(), []
    for row, res in zip(rows, results, strict=True):
        ref = mr.reference_row(row)
        key = tuple(ref.values())
        if ref["fp8"] != "off" or key in seen or "error" in res["ref"]:
            continue
        seen.add(key)
        dev = mr.deviation(mr.train_row(ref), res["ref"])
        out.append({"reference": ref, "deviation": dev, "ok": dev <= mr.TOL["reduce"]})
    return out


def _cell(v) -> str:
    return (
        {None: "-", False: "-", True: "on"}.get(v, str(v))
        if not isinstance(v, int) or isinstance(v, bool)
        else str(v)
    )


def table(verdicts: list[dict]) -> str:
    head = "| # | " + " | ".join(SHORT.values()) + " | reference | tol | max dev | twin dev | ok |"
    lines = [head, "|" + "---|" * (len(SHORT) + 6)]
    for i, v in enumerate(verdicts):
        s = v["settings"]
        ref = ", ".join(f"{SHORT[f]} {_cell(x)}" for f, x in v["reference"].items()) or "itself"
        dev = v.get("error") or f"{v['deviation']:.2g}"
        if v.get("audit"):
            dev += " (audit: " + v["audit"] + ")"
        twin = "-"
        if "twin_deviation" in v:
            what = ", ".join(f"{SHORT[f]} {_cell(x)}" for f, x in v["twin"].items())
            twin = f"{v['twin_deviation']:.2g} ({what})"
        cells = " | ".join(_cell(s[f]) for f in SHORT)
        ok = "yes" if v["ok"] else "NO"
        lines.append(f"| {i} | {cells} | {ref} | {v['tolerance']} | {dev} | {twin} | {ok} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the suite's subset (mp.QUICK)")
    args = ap.parse_args()
    required = mp.QUICK if args.quick else mp.FULL
    rows = mp.cover(required)
    need, got = mp.covered(rows, required)
    t0 = time.time()
    results = run_ranks(mr.run_rows, mr.WORLD, rows, timeout=3600)
    verdicts = [mr.judge(r, res) for r, res in zip(rows, results[0], strict=True)]
    refused = refusals() + mr.alias_refusals()
    single = one_process(rows, results[0])
    print(
        f"{len(rows)} runs of {mr.STEPS} steps on {mr.WORLD} ranks cover {got} of {need} "
        f"valid pairs ({time.time() - t0:.0f} s); {len(refused)} refused pairs\n"
    )
    print(table(verdicts) + "\n")
    for r in single:
        ref = {SHORT[f]: _cell(v) for f, v in r["reference"].items() if v != mp.FACTORS[f][0]}
        print(f"- reference {ref or 'plain'} vs one process: {r['deviation']:.2g}")
    for r in refused:
        print(f"- {'ok' if r['ok'] else 'NOT REFUSED CLEANLY'}: {r['pair']}: {r['refusal']}")
    out = HERE / "results" / "matrix.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {"runs": verdicts, "refused": refused, "pairs": [need, got]}, indent=1, default=str
        )
    )
    bad = [v for v in (*verdicts, *refused, *single) if not v["ok"]]
    print(f"\n{len(bad)} failing; written {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
