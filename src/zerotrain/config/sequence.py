"""sequence: — how one long sequence is cut: into tiles, and over ranks.

`tile_tokens: N` computes the loss (through the output head) and the MLP N tokens at a
time, recomputing each tile in backward (`models/tiling.py`). `parallel: S` is Ulysses
sequence parallelism: the ranks form groups of S consecutive ranks, each group trains on
the same sequences, each rank of a group holds 1/S of every sequence's length, and
attention switches to 1/S of the heads over the whole length for the duration of the
attention kernel (one all-to-all each way, `models/ulysses.py`). The data-parallel
degree is world size / S.
"""

from __future__ import annotations

from pydantic import Field

from zerotrain.config.base import ConfigError, _Section


class SequenceConfig(_Section):
    tile_tokens: int | None = Field(
        None, ge=1, description="compute the loss (through the output head) and the MLP this "
        "many tokens at a time, recomputing each tile in backward: the [tokens x vocabulary] "
        "logits and the [tokens x intermediate] MLP activations never exist in full; null: "
        "untiled")
    parallel: int = Field(
        1, ge=1, description="Ulysses sequence parallelism: ranks per group sharing one "
        "sequence (divides the world size and the attention heads; model.block_size must "
        "be divisible by it). 1: off")


def sequence_parallel_problems(sp: int, world_size: int | None = None,
                               n_head: int | None = None, seq_len: int | None = None, *,
                               heads_field: str = "model.n_head",
                               length_field: str = "model.block_size") -> list[str]:
    """What keeps S = `sp` from splitting this run, one message per problem, each naming
    the field to change. The numbers not known yet are None (the config knows the heads
    and block size, the launcher the world size, library mode the batch's length)."""
    if sp == 1:
        return []
    out = []
    if world_size is not None and world_size % sp:
        out.append(f"sequence.parallel ({sp}) must divide the world size ({world_size}): "
                   f"use a divisor of {world_size} or launch a multiple of {sp} ranks")
    if n_head is not None and n_head % sp:
        out.append(f"sequence.parallel ({sp}) must divide {heads_field}, the attention "
                   f"heads ({n_head}): each rank attends with an equal share of them; use a "
                   f"divisor of {n_head}")
    if seq_len is not None and seq_len % sp:
        out.append(f"sequence.parallel ({sp}) must divide {length_field}, the sequence "
                   f"length ({seq_len}): each rank keeps an equal slice; use a multiple of "
                   f"{sp}")
    return out


def check_sequence_parallel(sp: int, world_size: int | None = None, n_head: int | None = None,
                            seq_len: int | None = None, *, heads_field: str = "model.n_head",
                            length_field: str = "model.block_size") -> None:
    """One ConfigError (every problem of `sequence_parallel_problems`, one per line) when
    S cannot split this run. The config checks what it knows (heads, block size), the
    launcher the world size, the engine the model's heads and library mode's batches —
    all through this one function, so a problem reads the same wherever it is found."""
    problems = sequence_parallel_problems(sp, world_size, n_head, seq_len,
                                          heads_field=heads_field, length_field=length_field)
    if problems:
        raise ConfigError("\n".join(problems))
