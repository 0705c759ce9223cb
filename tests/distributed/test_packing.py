"""Packed rows train the same under every layout, and the same as the sequences padded.

Eight variable-length sequences (scripts/strategies_train.py ``--data packed``) are packed by ``hf_dist.data.pack``
into exactly one global batch of four 32-token rows and batched by ``PackedCollator``; every optimizer step sees all
of them, so each layout's loss at each of the 6 steps must equal one process's (micro-batch 2 x accumulation 2).
The same sequences padded per micro-batch in one process (``--data padded``, 4 x accumulation 2) give the loss per
label token the packed runs give: no conversation attends to another, and the loss is normalised by the real label
tokens across accumulation (``num_items_in_batch``). The runs share the strategies' launches (conftest.CASES).

Tolerance as test_strategies.py's (1e-5): measured max relative difference 0.0 across layouts, 1.2e-7 packed vs
padded (the row and the padded batch sum in other orders), while a conversation seeing its neighbour moves the loss
by more than 1e-2 (tests/unit/test_packing.py's controls).
"""

from __future__ import annotations

import pytest

from tests.distributed.conftest import PACKED_STRATEGIES, TRAIN_STEPS
from tests.distributed.test_strategies import LOSS_RTOL, max_rel_diff

pytestmark = pytest.mark.distributed

WRAPPED = {"ddp": "DistributedDataParallel", "fsdp_full_shard": "FSDPLlamaForCausalLM"}


def test_packed_loss_equals_padded_loss_of_the_same_sequences(strategy_runs):
    packed, padded = strategy_runs.get("packed_baseline"), strategy_runs.get("padded_baseline")
    assert (packed["data"], padded["data"]) == ("packed", "padded")
    assert packed["world_size"] == padded["world_size"] == 1
    assert len(packed["losses"]) == TRAIN_STEPS
    assert packed["losses"][-1] < packed["losses"][0] - 0.5  # it learns: the comparison carries information
    assert max_rel_diff(packed["losses"], padded["losses"]) <= LOSS_RTOL


@pytest.mark.parametrize("name", PACKED_STRATEGIES)
def test_packed_rows_train_the_same_under_every_layout(strategy_runs, name):
    baseline, report = strategy_runs.get("packed_baseline"), strategy_runs.get(f"packed_{name}")
    assert report["data"] == "packed" and report["world_size"] == 2
    assert report["global_batch"] == baseline["global_batch"] == 4
    assert report["model_wrapped"] == WRAPPED.get(name, "DeepSpeedEngine")
    if name.startswith("zero"):
        assert report["zero_stage"] == int(name[-1])
    diff = max_rel_diff(report["losses"], baseline["losses"])
    assert diff <= LOSS_RTOL, f"{name}: {report['losses']} vs one process {baseline['losses']} (max rel {diff:.1e})"
