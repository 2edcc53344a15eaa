"""The facts of ZeRO are stated once (config/zero_facts.py) and everything reads them."""

from __future__ import annotations

import pytest

from zerotrain.config import build_config
from zerotrain.config.zero_facts import REQUIRES, STAGE_SHARDS, lowest_stage
from zerotrain.memory import STAGE_SHARDS as MEMORY_STAGE_SHARDS
from zerotrain.zero import STAGES

ON = {"offload_optimizer": {"offload_optimizer": "cpu"},
      "offload_optimizer nvme": {"offload_optimizer": "nvme", "nvme_path": "/tmp"},
      "offload_param": {"offload_param": "cpu"},
      "secondary_partition": {"secondary_partition": 2},
      "param_wire": {"param_wire": "int8"}, "grad_wire": {"grad_wire": "int4"}}


def test_stage_classes_and_memory_read_the_one_table():
    assert MEMORY_STAGE_SHARDS is STAGE_SHARDS
    for n, cls in STAGES.items():
        assert cls.shards == STAGE_SHARDS[n]


@pytest.mark.parametrize("row", REQUIRES, ids=lambda r: r.field)
def test_every_requirement_is_refused_below_its_stage_with_one_sentence(row):
    assert set(ON) == {r.field for r in REQUIRES}  # this test knows every row
    need = lowest_stage(row.shard)
    for stage in range(4):
        zero = {"stage": stage, **ON[row.field]}
        if stage >= need:
            build_config({"zero": zero})
            continue
        with pytest.raises(ValueError) as e:
            build_config({"zero": zero})
        msg = str(e.value)
        assert f"zero.{row.field} needs zero.stage" in msg and f"got stage {stage}" in msg
