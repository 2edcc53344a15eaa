"""Is a run under-fit, well fit or over-fit? The train–validation gap and its trend.

Pure functions of the metric records (`{"type": "train", "step", "loss"}` and
`{"type": "val", "step", "val_loss"}`), so the rule is tested on synthetic curves.

The rule (`diagnose`):

1. **Pairs.** Each evaluation at step s is paired with the mean of the later half
   (rounded up) of the training losses logged since the previous evaluation, in
   (previous, s]: one step's loss is noisy, a mean is not, and the later half keeps the
   lag small while the loss is still falling fast (a whole-window mean would read high
   and make the gap look negative early on). An evaluation with no training record in
   its window (the one at step 0) has no pair.
2. **Trends.** Over the last K pairs (K = 3; fewer: no verdict), least-squares lines
   against the step are fitted to the training loss, the validation loss and the gap
   (validation − training). A loss's *trend* is its fitted change across those
   evaluations relative to its mean there; the gap's *change* is its fitted change in
   nats ("steady" within τ of the validation loss).
3. **Verdict**, with a tolerance τ = 1% (the validation windows are fixed, so a change
   beyond 1% is the model, not sampling noise):
   - over-fit:  validation rising (trend > τ) while training is not (trend ≤ τ);
   - unstable:  both rising: not a question of fit but of the lr or precision;
   - under-fit: validation still falling (trend < −τ): more steps or capacity help;
   - well fit:  validation level (|trend| ≤ τ).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

K = 3
TOLERANCE = 0.01

ADVICE = {
    "under-fit": "validation is still falling; more steps (or a larger model) should help",
    "well fit": "validation has levelled off; more steps of this schedule gain little",
    "over-fit": "validation is rising while training is not; stop earlier, or add data or "
                "regularisation (weight decay)",
    "unstable": "training and validation are both rising; the run is unstable (lower "
                "optimizer.lr)",
}


def pair_evaluations(records: list[dict[str, Any]]
                     ) -> tuple[list[int], list[float], list[float]]:
    """(steps, training loss, validation loss) for every evaluation that has training
    records since the previous one; the training loss is the mean of the later half of
    those records (rule 1 of this module's docstring)."""
    train = sorted((r["step"], r["loss"]) for r in records if r.get("type") == "train")
    val = sorted((r["step"], r["val_loss"]) for r in records if r.get("type") == "val")
    steps, tr, va, prev = [], [], [], None
    for s, v in val:
        window = [loss for t, loss in train if (prev is None or t > prev) and t <= s]
        prev = s
        if window:
            later = window[len(window) // 2:]
            steps.append(s)
            tr.append(sum(later) / len(later))
            va.append(v)
    return steps, tr, va


def _slope(x: list[int], y: list[float]) -> float:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    den = sum((a - mx) ** 2 for a in x)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / den if den else 0.0


@dataclass(frozen=True)
class Fit:
    verdict: str                     # under-fit | well fit | over-fit | unstable | unknown
    evaluations: int                 # pairs the trends are fitted over (0: unknown)
    first_step: int | None = None    # the span of those pairs
    last_step: int | None = None
    gap: float | None = None         # validation − training at the last pair (nats)
    gap_change: float | None = None  # fitted change of the gap across the pairs (nats)
    train_trend: float | None = None  # fitted relative change of the training loss
    val_trend: float | None = None    # ... of the validation loss
    val_loss: float | None = None     # at the last pair

    def record(self) -> dict[str, Any]:
        """The fields the run's summary record gets."""
        return {"fit": self.verdict, "train_val_gap": self.gap,
                "train_val_gap_change": self.gap_change, "fit_train_trend": self.train_trend,
                "fit_val_trend": self.val_trend, "fit_evaluations": self.evaluations}

    def gap_text(self) -> str:
        """'gap val − train 0.041 (widening by 0.012 over steps 350–420)'."""
        if self.gap is None or self.gap_change is None:
            return "gap val − train: needs more evaluations"
        c = self.gap_change
        steady = abs(c) <= TOLERANCE * (self.val_loss or 0.0)  # the losses' own tolerance
        how = ("steady" if steady else
               f"{'widening' if c > 0 else 'narrowing'} by {abs(c):.3f}")
        return (f"gap val − train {self.gap:+.3f} ({how} over steps "
                f"{self.first_step}–{self.last_step})")

    def line(self) -> str:
        """The one line that says how the run fits."""
        if self.verdict == "unknown":
            return (f"[zerotrain] fit: not enough evaluations to judge: it needs {K} after "
                    "training starts (logging.eval_every sets how often they come)")
        return (f"[zerotrain] fit: {self.verdict} — over the last {self.evaluations} "
                f"evaluations validation {self.val_trend:+.1%}, training "
                f"{self.train_trend:+.1%}; {ADVICE[self.verdict]}")


def verdict(train_trend: float, val_trend: float, tol: float = TOLERANCE) -> str:
    """The rule's step 3 on two relative trends."""
    if val_trend > tol:
        return "unstable" if train_trend > tol else "over-fit"
    return "under-fit" if val_trend < -tol else "well fit"


def diagnose(records: list[dict[str, Any]], k: int = K, tol: float = TOLERANCE) -> Fit:
    """The rule of this module's docstring, on a run's metric records."""
    steps, tr, va = pair_evaluations(records)
    if len(steps) < k:
        return Fit("unknown", 0)
    steps, tr, va = steps[-k:], tr[-k:], va[-k:]
    span = steps[-1] - steps[0]
    gap = [v - t for t, v in zip(tr, va)]
    t_trend = _slope(steps, tr) * span / (sum(tr) / k)
    v_trend = _slope(steps, va) * span / (sum(va) / k)
    return Fit(verdict(t_trend, v_trend, tol), k, steps[0], steps[-1], gap[-1],
               _slope(steps, gap) * span, t_trend, v_trend, va[-1])
