"""Pod-slice host logic on real gloo process groups (no XLA multi-process: it cannot run on the CPU)."""

from __future__ import annotations

import pytest
import torch
from host_group import run_hosts

pytestmark = pytest.mark.slow


def test_one_host_stopping_stops_every_host_at_the_same_step_and_all_save(tmp_path):
    results = run_hosts("stops", 3, tmp_path, stop_on=2, at_step=4)
    assert [r["stopped_at"] for r in results] == [4, 4, 4]
    assert all(r["saved"] and r["reason"] == "SIGTERM" for r in results)


def test_a_host_copy_gathers_every_hosts_shards_and_refuses_a_region_left_unset(tmp_path):
    assert [r["equal"] for r in run_hosts("host_copy", 2, tmp_path / "all")] == [True, True]
    missing = run_hosts("host_copy", 2, tmp_path / "missing", drop_on=1)
    assert all("got 24 of its 48 elements" in r["incomplete"] for r in missing)


def test_only_host_0_speaks_and_a_directory_hosts_do_not_share_is_refused_on_every_host(tmp_path):
    shared = run_hosts("shared", 2, tmp_path / "a", same_dir=True)
    assert [r["refused"] for r in shared] == [None, None]
    assert "hello from host 0" in shared[0]["stdout"] and shared[1]["stdout"] == ""
    apart = run_hosts("shared", 2, tmp_path / "b", same_dir=False)
    assert all("is not one directory every host sees" in r["refused"] for r in apart)


def test_hosts_build_the_same_rows_host_0_caches_them_and_differing_data_is_refused(tmp_path):
    same = run_hosts("data", 2, tmp_path / "same")
    assert [r["refused"] for r in same] == [None, None]
    assert same[0]["digest"] == same[1]["digest"]
    assert [r["cached"] for r in same] == [False, True]  # host 1 read what host 0 wrote
    differ = run_hosts("data", 2, tmp_path / "differ", different_on=1)
    assert all("the training rows differs between hosts: host(s) [1]" in r["refused"] for r in differ)


def test_several_hosts_write_one_sharded_checkpoint_that_reads_back_whole(tmp_path):
    from lowmem_tpu.train import checkpoint as ckpt

    results = run_hosts("dcp", 2, tmp_path)
    assert results[0]["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file per host
    state = ckpt.read_whole(tmp_path / "ckpt")
    assert torch.equal(state["trainable/w"], torch.arange(48, dtype=torch.bfloat16).reshape(8, 6))
    assert state["optimizer/0/step"].item() == 3.0
