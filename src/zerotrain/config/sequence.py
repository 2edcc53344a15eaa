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


def check_sequence_parallel(sp: int, world_size: int, n_head: int | None = None,
                            seq_len: int | None = None) -> None:
    """One ConfigError naming sequence.parallel when S cannot split this run.

    Checked where the numbers are known: the world size at engine start, the heads from
    the model, the length from model.block_size (or the batch in library mode)."""
    if sp == 1:
        return
    if world_size % sp:
        raise ConfigError(f"sequence.parallel ({sp}) must divide the world size ({world_size}); "
                          f"use a divisor of {world_size} or launch a multiple of {sp} ranks")
    if n_head is not None and n_head % sp:
        raise ConfigError(f"sequence.parallel ({sp}) must divide the number of attention heads "
                          f"({n_head}): each rank attends with heads/{sp} of them")
    if seq_len is not None and seq_len % sp:
        raise ConfigError(f"sequence.parallel ({sp}) must divide the sequence length "
                          f"(model.block_size {seq_len}): each rank keeps an equal slice")
