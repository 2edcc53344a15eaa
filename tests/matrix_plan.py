"""The combination matrix (issue 29, item 2): the factors, the pairs a run may not combine,
and a deterministic greedy pairwise covering array over them.

A *row* gives every factor one level. `cover(required)` returns rows such that every
valid pair of levels in `required` (two factors, one level each) appears in some row;
a pair is invalid when `REFUSED` says the config must refuse it, and each such pair is
checked on its own (`refusal_row`): one config that holds it, refused at config time
with one line naming both settings.

No dependency: the greedy construction (fix the first uncovered pair, then give each
other factor the level that covers most new pairs) is small, and its result depends on
nothing but the factor order, so every machine plans the same runs.
"""

from __future__ import annotations

from itertools import combinations

#: factor -> levels; the first level is the plain one (the option off)
FACTORS: dict[str, tuple] = {
    "stage": (0, 1, 2, 3),
    "offload": ("none", "cpu"),
    "tier": ("none", "cpu", "nvme"),
    "fp8": ("off", "tensorwise", "rowwise", "delayed"),
    "wire": ("plain", "fp8", "int8"),
    "ckpt": (False, True, "offload"),
    "tiles": (None, 4),
    "sp": (1, 2),
    "docmask": (False, True),
    "labels": ("all", "masked"),
    "optim": ("adamw", "muon"),
    "accum": (1, 2),
    "hpz": (None, 2),
    "gwire": ("plain", "int8", "int4"),
}

#: the setting each factor stands for: a refusal must name both of its pair's settings
SETTING = {
    "stage": "zero.stage",
    "offload": "zero.offload_optimizer",
    "tier": "zero.offload_param",
    "fp8": "precision.fp8",
    "wire": "",
    "ckpt": "model.activation_checkpointing",
    "tiles": "sequence.tile_tokens",
    "sp": "sequence.parallel",
    "docmask": "data.document_mask",
    "labels": "",
    "optim": "optimizer.name",
    "accum": "data.grad_accum_steps",
    "hpz": "zero.secondary_partition",
    "gwire": "zero.grad_wire",
}
WIRE_SETTING = {"fp8": "precision.fp8.all_gather", "int8": "zero.param_wire"}


def setting(factor: str, level) -> str:
    """The config field a refusal of (factor, level) must name."""
    return WIRE_SETTING.get(level, "") if factor == "wire" else SETTING[factor]


def _not_stage3(factor: str, plain) -> list[tuple]:
    return [(("stage", s), (factor, v)) for s in (0, 1, 2) for v in FACTORS[factor] if v != plain]


#: pairs the config refuses (each with why), in the form ((factor, level), (factor, level))
REFUSED: dict[tuple, str] = {
    **{
        p: "Offload moves the sharded gradients: stage 2 or 3"
        for p in [(("stage", s), ("offload", "cpu")) for s in (0, 1)]
    },
    **{p: "only ZeRO-3 shards parameters" for p in _not_stage3("tier", "none")},
    **{p: "only ZeRO-3 gathers parameters" for p in _not_stage3("wire", "plain")},
    **{p: "hpZ keeps a second partition of ZeRO-3's parameters" for p in _not_stage3("hpz", None)},
    **{p: "qgZ quantises ZeRO-3's gradient reduce-scatter" for p in _not_stage3("gwire", "plain")},
    **{
        p: "hpZ's and qgZ's groups are placed by node over every rank"
        for p in [(("sp", 2), ("hpz", 2))] + [(("sp", 2), ("gwire", g)) for g in ("int8", "int4")]
    },
    (("fp8", "off"), ("wire", "fp8")): "the FP8 wire carries the FP8 linears' weights",
}


def _key(a: tuple, b: tuple) -> tuple:
    order = list(FACTORS)
    return (a, b) if order.index(a[0]) < order.index(b[0]) else (b, a)


def refused(a: tuple, b: tuple) -> str | None:
    """Why the pair (factor, level) × (factor, level) is refused, or None."""
    return REFUSED.get(_key(a, b))


def valid(row: dict) -> bool:
    items = list(row.items())
    return not any(refused(a, b) for a, b in combinations(items, 2))


def all_pairs(factors: list[str]) -> set[tuple]:
    """Every pair of levels of two different factors in `factors`, as sorted keys."""
    out = set()
    for f, g in combinations(factors, 2):
        out |= {_key((f, u), (g, v)) for u in FACTORS[f] for v in FACTORS[g]}
    return out


def pairs_of(row: dict) -> set[tuple]:
    return {_key(a, b) for a, b in combinations(row.items(), 2)}


def _complete(row: dict, todo: set[tuple]) -> dict:
    """Give every factor not in `row` the valid level covering most pairs in `todo`
    (ties: the earlier level, so the plain one)."""
    for f in FACTORS:
        if f in row:
            continue
        best, gain = None, -1  # gain -1: none found (None is a level: tiles off)
        for v in FACTORS[f]:
            trial = {**row, f: v}
            if not valid(trial):
                continue
            g = sum(_key((f, v), (h, w)) in todo for h, w in row.items())
            if g > gain:
                best, gain = v, g
        if gain < 0:
            raise ValueError(f"no valid level of {f} completes {row}")
        row[f] = best
    return {f: row[f] for f in FACTORS}


def cover(required: list[list[str]]) -> list[dict]:
    """Rows covering every valid pair between the factors of each group in `required`
    (a group [a, b, c]: all pairs among a, b and c; [["stage", x] for x ...]: stage
    against each other factor only)."""
    todo: set[tuple] = set()
    for group in required:
        todo |= all_pairs(group)
    todo = {p for p in todo if not refused(*p)}
    rows = []
    while todo:
        (f, u), (g, v) = min(todo, key=_order)
        row = _complete({f: u, g: v}, todo)
        todo -= pairs_of(row)
        rows.append(row)
    return rows


def _order(pair: tuple) -> tuple:
    order = list(FACTORS)
    (f, u), (g, v) = pair
    return (order.index(f), FACTORS[f].index(u), order.index(g), FACTORS[g].index(v))


def refusal_row(a: tuple, b: tuple) -> dict:
    """A config holding the refused pair a, b and otherwise valid (plain levels where
    possible, so the refusal can only come from this pair)."""
    row = {a[0]: a[1], b[0]: b[1]}
    for f in FACTORS:
        if f in row:
            continue
        for v in FACTORS[f]:
            if not any(refused((f, v), o) for o in row.items()):
                row[f] = v
                break
    return {f: row[f] for f in FACTORS}


def covered(rows: list[dict], required: list[list[str]]) -> tuple[int, int]:
    """(valid pairs required, of them covered by `rows`)."""
    todo: set[tuple] = set()
    for group in required:
        todo |= all_pairs(group)
    todo = {p for p in todo if not refused(*p)}
    got = set().union(*(pairs_of(r) for r in rows)) if rows else set()
    return len(todo), len(todo & got)


FULL = [list(FACTORS)]
#: the quick suite: the stage against every other factor, the FP8 recipe against the
#: FP8 wire (the pair that drifted silently, review 3 W-1), and ZeRO++'s three options
#: (the parameter wire, hpZ, qgZ) against each other
QUICK = [["stage", f] for f in FACTORS if f != "stage"] + [
    ["fp8", "wire"],
    ["wire", "hpz", "gwire"],
]
