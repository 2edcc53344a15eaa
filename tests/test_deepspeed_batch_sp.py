"""DeepSpeed's batch triple under sequence parallelism: the ranks of one SP group share a
batch, so the global batch is micro × accumulation × world / sequence.parallel."""

from __future__ import annotations

import pytest

from zerotrain.config import ConfigError
from zerotrain.deepspeed_config import load_deepspeed_config

SP2 = {"sequence": {"parallel": 2}}


def test_sp_ranks_are_not_data_parallel():
    ds = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1}
    cfg = load_deepspeed_config(ds, world_size=2, overrides=SP2)
    assert (cfg.data.micro_batch_size, cfg.data.grad_accum_steps) == (1, 1)
    cfg = load_deepspeed_config(
        {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1}, world_size=4, overrides=SP2
    )
    assert cfg.data.grad_accum_steps == 2  # 4 = 1 × 2 × (4 / 2)
    cfg = load_deepspeed_config(
        {"train_batch_size": 6, "gradient_accumulation_steps": 3}, world_size=2, overrides=SP2
    )
    assert cfg.data.micro_batch_size == 2
    # without SP the same triple counts both ranks
    with pytest.raises(ConfigError, match="world size 2"):
        load_deepspeed_config(ds, world_size=2)


def test_sp_inconsistent_triple_names_the_data_parallel_size():
    ds = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
    }
    with pytest.raises(
        ConfigError,
        match=r"data-parallel size 2 \(world size / "
        r"sequence.parallel 2\) = 2",
    ):
        load_deepspeed_config(ds, world_size=4, overrides=SP2)


def test_yaml_head_says_what_the_batch_counts(tmp_path):
    import json

    from zerotrain.deepspeed_config import deepspeed_to_yaml

    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1}))
    head = deepspeed_to_yaml(p, world_size=4, overrides=SP2).splitlines()[1]
    assert head.endswith("accumulation × world size / sequence.parallel 2)"), head
