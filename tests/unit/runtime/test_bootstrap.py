"""Which round name the ranks of a torchrun launch key the rendezvous store by (hf_dist.runtime.bootstrap).

The multi-node case was found under examples/slurm/torchrun_multinode.sbatch (tests/distributed/test_slurm_scripts.py):
after a rank was killed, the failed node's workers restarted with TORCHELASTIC_RESTART_COUNT=1 and the other node's
with 0, so a prefix by restart count put the two ranks under different keys and both hung in init_process_group."""

from __future__ import annotations

import logging

from hf_dist.runtime.bootstrap import SHARED_STORE_FIX, init_distributed_for_restarts, round_name, store_round

ONE_NODE = {"TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "2"}


def test_one_agent_reusing_its_store_names_the_round_by_its_restart_count():
    assert store_round(ONE_NODE) == round_name(ONE_NODE) == "attempt_2"


def test_a_store_new_each_round_needs_no_round_name():
    fresh = {**ONE_NODE, "TORCHELASTIC_USE_AGENT_STORE": "False", "GROUP_WORLD_SIZE": "2"}
    assert store_round(fresh) == round_name(fresh) == ""


def test_nodes_sharing_one_store_have_no_round_name_they_agree_on():
    # what the two nodes' workers saw after the kill: the same store, restart counts 1 and 0
    failed = {**ONE_NODE, "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "1"}
    other = {**failed, "TORCHELASTIC_RESTART_COUNT": "0"}
    assert store_round(failed) is None and store_round(other) is None
    assert round_name(failed) != round_name(other)  # why bootstrap warns: its fallback cannot survive a restart


def test_restarts_over_a_shared_store_are_warned_on_rank_0_with_the_fix(monkeypatch, caplog):
    import torch.distributed as dist

    env = {**ONE_NODE, "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "3",
           "WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    stores, groups = [], []
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **kw: stores.append((a, kw)) or dist.HashStore())
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: groups.append(kw))
    with caplog.at_level(logging.WARNING, logger="hf_dist"):
        assert init_distributed_for_restarts("gloo") is True
    assert [r.getMessage() for r in caplog.records] == [
        f"hf_dist: 2 nodes share one rendezvous store across restarts, so a restart would hang in init_process_group; "
        f"{SHARED_STORE_FIX}"
    ]
    assert stores[0][1]["is_master"] is False  # the agent hosts the shared store
    assert isinstance(groups[0]["store"], dist.PrefixStore)
    caplog.clear()
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # what torchrun then does: a store per round
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    with caplog.at_level(logging.WARNING, logger="hf_dist"):
        assert init_distributed_for_restarts("gloo") is True
    assert caplog.records == [] and stores[1][1]["is_master"] is True  # rank 0 hosts this round's own store
    assert not isinstance(groups[1]["store"], dist.PrefixStore)


def test_outside_torchrun_nothing_is_started(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert init_distributed_for_restarts() is False
