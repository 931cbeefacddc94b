"""A tuning store on SQLite and on PostgreSQL (when a test server is set), with a device
and a software stack in it."""

import pytest

from mla_tune.db import TuningStore
from mla_tune.machine.fingerprint import DeviceFingerprint, SoftwareFingerprint

GPU = DeviceFingerprint("nvidia", "NVIDIA H200", "sm_90", 132, 150 << 30)
STACK = SoftwareFingerprint((("python", "3.11.7"), ("torch", "2.9.0"), ("triton", "3.5.0")))
SHAPE = {"batch": 4, "kv_lens": 1024, "q_len": 1, "heads": 16, "kv_format": "bf16",
         "page_size": 1}
SHAPE_KEY = "b4-q1-kv1024-h16-bf16-p1"


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path / 'tuning.db'}"


@pytest.fixture(params=["sqlite_url", "pg_url"], ids=["sqlite", "postgresql"])
def url(request):
    return request.getfixturevalue(request.param)


@pytest.fixture
def store(url):
    with TuningStore(url) as s:
        yield s


@pytest.fixture
def ids(store):
    return {"device_id": store.device_id(GPU), "software_id": store.software_id(STACK)}
