"""Device groups: parsing `--devices` / `--tp`, splitting into groups, and the checks
that refuse a layout this host or this checkpoint cannot run, with what to do instead."""

from __future__ import annotations

import sys

import pytest
import torch

from workers.engine.topology import (
    DeviceKind,
    TopologyError,
    build_topology,
    check_backend,
    check_model,
    check_model_dir,
    parse_device_kind,
    parse_devices,
)


def test_parse_devices_lists_and_ranges():
    assert parse_devices("0,1,2,3") == [0, 1, 2, 3]
    assert parse_devices("0-3") == [0, 1, 2, 3]
    assert parse_devices(" 4, 0-1 ,7") == [4, 0, 1, 7]


@pytest.mark.parametrize("text, message", [
    ("", "at least one device"),
    ("0,x", "'x' is not a device index"),
    ("3-1", "runs backwards"),
    ("0,1,1", r"\[1\] listed twice"),
    ("0-2,2", r"\[2\] listed twice"),
])
def test_parse_devices_refuses(text, message):
    with pytest.raises(TopologyError, match=message):
        parse_devices(text)


def test_four_devices_tp2_make_two_groups_of_two():
    topology = build_topology("cuda", [0, 1, 2, 3], 2)
    assert topology.kind is DeviceKind.CUDA and topology.tp_size == 2
    assert [g.devices for g in topology.groups] == [[0, 1], [2, 3]]
    assert topology.groups[1].device_names == ["cuda:2", "cuda:3"]
    assert topology.groups[1].index == 1 and topology.groups[1].tp_size == 2
    assert DeviceKind.CUDA.dist_backend == "nccl"
    assert DeviceKind.NPU.dist_backend == "hccl" and DeviceKind.CPU.dist_backend == "gloo"


def test_cpu_devices_are_logical_ranks():
    topology = build_topology("cpu", [0, 1], 2)
    assert len(topology.groups) == 1
    assert topology.groups[0].device_names == ["cpu", "cpu"]
    check_backend(topology)  # any number of CPU ranks runs
    assert [g.devices for g in build_topology("cpu", [0, 1], 1).groups] == [[0], [1]]


def test_defaults_without_devices():
    assert build_topology("cpu", None, 1).groups[0].devices == [0]
    assert build_topology("npu", None, 2).groups[0].device_names == ["npu:0", "npu:1"]
    assert build_topology("cuda:3", None, 1).groups[0].device_names == ["cuda:3"]
    assert parse_device_kind("NPU:1") == (DeviceKind.NPU, 1)


@pytest.mark.parametrize("device, devices, tp, message", [
    ("cuda", [0, 1, 2], 2, r"3 device\(s\) \[0, 1, 2\] do not split into groups of --tp 2"),
    ("cuda", [0, 1], 0, "must be >= 1"),
    ("tpu", None, 1, "kind must be one of cpu, cuda, npu"),
    ("cuda:x", None, 1, "must be a number"),
    ("cuda:1", None, 2, "names one device but --tp 2 needs 2"),
    ("cuda:1", [0, 1], 2, "pass --device cuda --devices 0,1"),
])
def test_bad_layouts_say_what_to_change(device, devices, tp, message):
    with pytest.raises(TopologyError, match=message):
        build_topology(device, devices, tp)


HF_CONFIG = {"num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 96,
             "vocab_size": 512}


def test_tp_must_divide_heads_and_kv_heads():
    check_model(HF_CONFIG, 4)
    check_model(HF_CONFIG, 2)
    with pytest.raises(TopologyError, match=r"--tp 3 does not divide the model's 4 KV heads"
                                            r".*use a TP size in \[1, 2, 4\]"):
        check_model(HF_CONFIG, 3)
    with pytest.raises(TopologyError, match="does not divide the model's 12 attention heads"):
        check_model({**HF_CONFIG, "num_key_value_heads": 8}, 8)


def test_checkpoint_config_is_checked(tiny_qwen3_dir, tmp_path):
    check_model_dir(str(tiny_qwen3_dir), 2)  # tiny: 4 heads, 2 KV heads
    with pytest.raises(TopologyError, match="--tp 4 does not divide the model's 2 KV heads"):
        check_model_dir(str(tiny_qwen3_dir), 4)
    with pytest.raises(TopologyError, match="cannot read the model config"):
        check_model_dir(str(tmp_path), 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a host "
                    "without CUDA")  # this machine has no accelerator: runs here
def test_cuda_without_cuda_says_what_to_install():
    with pytest.raises(TopologyError, match="sees no CUDA device; install a CUDA build of torch"):
        check_backend(build_topology("cuda", [0, 1], 2))


def test_npu_without_torch_npu_says_pip_install_llmq_npu(monkeypatch):
    # NOTE: this machine has no torch_npu; None in sys.modules makes the import fail on
    # an Ascend host too, so the message is checked everywhere
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(TopologyError, match=r'pip install "llmq\[npu\]"'):
        check_backend(build_topology("npu", None, 1))


def test_worker_refuses_a_bad_topology_before_starting(tiny_qwen3_dir, capsys,
                                                      monkeypatch):
    from workers.main import main

    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert main(["--model-name", "tiny", "--model-dir", str(tiny_qwen3_dir), "--device",
                 "npu"]) == 2
    assert 'pip install "llmq[npu]"' in capsys.readouterr().err

    base = ["--model-name", "tiny", "--model-dir", str(tiny_qwen3_dir)]
    assert main([*base, "--devices", "0,1,2", "--tp", "2"]) == 2
    assert "do not split into groups of --tp 2" in capsys.readouterr().err
    assert main([*base, "--devices", "0-3", "--tp", "4"]) == 2
    assert "--tp 4 does not divide the model's 2 KV heads" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main([*base, "--device", "cuda", "--tp", "2"]) == 2
        assert "install a CUDA build of torch" in capsys.readouterr().err
    assert main([*base, "--devices", "0,1", "--group-index", "2"]) == 2
    assert "--group-index 2: the topology has 2 group(s)" in capsys.readouterr().err
