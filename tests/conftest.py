"""Test-wide guards and fixtures."""

import os
import uuid

import pytest
from sqlalchemy import create_engine, make_url, text

PG_ENV = "MLA_TUNE_TEST_PG_URL"


@pytest.fixture(autouse=True)
def _compiled_triton(monkeypatch):
    """Tests see the machine as it is: the Triton interpreter is opted into only by the
    tests that run it in a child process, so backend availability never depends on the
    caller's environment or on test order."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def pg_url():
    """A fresh schema in the test PostgreSQL ($MLA_TUNE_TEST_PG_URL, which `.ci/run` sets),
    dropped afterwards, so runs never collide; skips when no server is set."""
    base = os.environ.get(PG_ENV)
    if not base:
        pytest.skip(f"set {PG_ENV} to run against PostgreSQL")
    schema = f"mt_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    yield (make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
           .render_as_string(hide_password=False))
    with admin.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()
