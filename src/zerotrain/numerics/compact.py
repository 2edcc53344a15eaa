"""What a compact-state setting is: the optimizer's state dtype and how bf16 masters
take their updates — a value the precision policy carries and the optimizer runs by
(`zerotrain.optim.compact`)."""

from __future__ import annotations

from dataclasses import dataclass

STATE_DTYPES = ("fp32", "bf16", "int8")
MASTER_UPDATES = ("none", "plain", "kahan", "stochastic")


@dataclass(frozen=True)
class Compact:
    """How an optimizer stores its states and updates bf16 weights."""

    state_dtype: str = "fp32"
    master_update: str = "none"  # none: the weights it updates are fp32

    def __post_init__(self) -> None:
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(
                f"optimizer.state_dtype must be one of {', '.join(STATE_DTYPES)}, "
                f"got {self.state_dtype!r}"
            )
        if self.master_update not in MASTER_UPDATES:
            raise ValueError(
                f"precision.master_update must be one of kahan, stochastic, "
                f"plain, got {self.master_update!r}"
            )

    @property
    def active(self) -> bool:
        """Whether the update goes through `run` (else: the plain fp32 rules)."""
        return self.state_dtype != "fp32" or self.master_update in ("kahan", "stochastic")


FP32 = Compact()
