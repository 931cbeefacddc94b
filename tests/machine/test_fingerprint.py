import re
from types import SimpleNamespace

import pytest
import torch

from mla_tune.machine.fingerprint import (
    CORE_PACKAGES,
    DeviceFingerprint,
    SoftwareFingerprint,
    current_device,
    current_software,
    software_diff,
)


def test_cpu_device_fingerprint_is_stable_and_round_trips():
    fp = current_device("cpu")
    assert fp.vendor == "cpu"
    assert fp.sm_count >= 1 and fp.memory_bytes > 0 and fp.arch and fp.name
    assert re.fullmatch(r"[0-9a-f]{16}", fp.hash)
    assert current_device(torch.device("cpu")).hash == fp.hash
    again = DeviceFingerprint.from_json(fp.to_json())
    assert again == fp and again.hash == fp.hash


def test_device_hash_depends_on_every_field():
    base = DeviceFingerprint("nvidia", "NVIDIA H200", "sm_90", 132, 150 << 30)
    variants = [
        DeviceFingerprint("amd", "NVIDIA H200", "sm_90", 132, 150 << 30),
        DeviceFingerprint("nvidia", "NVIDIA H100", "sm_90", 132, 150 << 30),
        DeviceFingerprint("nvidia", "NVIDIA H200", "sm_100", 132, 150 << 30),
        DeviceFingerprint("nvidia", "NVIDIA H200", "sm_90", 66, 150 << 30),  # MIG slice
        DeviceFingerprint("nvidia", "NVIDIA H200", "sm_90", 132, 75 << 30),
    ]
    assert len({base.hash, *(v.hash for v in variants)}) == 6


def test_unknown_vendor_is_rejected():
    with pytest.raises(ValueError, match="vendor"):
        DeviceFingerprint("intel", "x", "y", 1, 1)


def _fake_gpu(monkeypatch, hip, **props):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(**props))
    monkeypatch.setattr(torch.version, "hip", hip)


def test_nvidia_arch_from_compute_capability(monkeypatch):
    _fake_gpu(monkeypatch, None, name="NVIDIA H200", major=9, minor=0,
              multi_processor_count=132, total_memory=150 << 30)
    assert current_device("cuda:0") == DeviceFingerprint("nvidia", "NVIDIA H200", "sm_90", 132,
                                                         150 << 30)


def test_amd_arch_from_gcn_name_without_features(monkeypatch):
    _fake_gpu(monkeypatch, "6.4", name="AMD Instinct MI355X", major=9, minor=5,
              gcnArchName="gfx950:sramecc+:xnack-", multi_processor_count=256,
              total_memory=288 << 30)
    fp = current_device("cuda")
    assert (fp.vendor, fp.arch, fp.sm_count) == ("amd", "gfx950", 256)


def test_cuda_without_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no GPU"):
        current_device("cuda")


def test_software_fingerprint_is_order_independent():
    a = SoftwareFingerprint((("torch", "2.9"), ("python", "3.11")))
    b = SoftwareFingerprint((("python", "3.11"), ("torch", "2.9")))
    assert a == b and a.hash == b.hash
    assert a.versions == (("python", "3.11"), ("torch", "2.9"))
    assert SoftwareFingerprint.from_json(a.to_json()) == a
    with pytest.raises(ValueError, match="duplicate"):
        SoftwareFingerprint((("torch", "1"), ("torch", "2")))


def test_current_software_records_core_and_extra_versions():
    sw = current_software({"flashinfer": "0.2.5"})
    versions = sw.as_dict()
    assert set(CORE_PACKAGES) <= set(versions)
    assert versions["torch"] == str(torch.__version__)
    assert versions["flashinfer"] == "0.2.5"
    assert current_software().hash != sw.hash


def test_software_diff_names_differing_packages():
    a = SoftwareFingerprint((("python", "3.11"), ("torch", "2.9"), ("aiter", "1")))
    b = SoftwareFingerprint((("python", "3.11"), ("torch", "2.9"), ("aiter", "2"),
                             ("flashinfer", "0.3")))
    assert software_diff(a, a) == {}
    assert software_diff(a, b) == {"aiter": ("1", "2"), "flashinfer": (None, "0.3")}


def test_a_hash_prefix_names_one_known_hash_or_says_which_exist() -> None:
    import pytest

    from mla_tune.machine.fingerprint import resolve_hash_prefix

    known = ["abc123", "abd999", "abc123"]
    assert resolve_hash_prefix("abd", known, "device") == "abd999"
    assert resolve_hash_prefix("abc", known, "device") == "abc123"  # one hash, seen twice
    with pytest.raises(ValueError, match="more than one device with hash 'ab'"):
        resolve_hash_prefix("ab", known, "device")
    with pytest.raises(ValueError, match="no software stack with hash 'ff'; software stacks: "
                                         "abc123, abd999"):
        resolve_hash_prefix("ff", known, "software stack")
