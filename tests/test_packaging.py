"""An installed (non-editable) mla-tune must carry its data: spaces, suites, tolerances,
migrations, the shipped winners table and the shipped H200 tuning DB."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_contains_data_files(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path),
                    str(ROOT)], check=True, timeout=300, cwd=tmp_path, capture_output=True)
    wheel = next(tmp_path.glob("mla_tune-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for config in (ROOT / "configs").rglob("*.toml"):
        assert "mla_tune/configs/" + config.relative_to(ROOT / "configs").as_posix() in names
    assert "mla_tune/shipped/winners.json" in names
    assert "mla_tune/shipped/tuning.db" in names and "mla_tune/shipped/__init__.py" in names
    assert "mla_tune/db/migrations/env.py" in names
    assert any(n.startswith("mla_tune/db/migrations/versions/0002") for n in names)
    assert "mla_tune/kernels/triton/mla_decode.py" in names
    assert "mla_tune/kernels/cuda/mla_decode.cu" in names
    # Only mla_tune goes into site-packages, and every sub-package of the tree is in it.
    assert {n.split("/")[0] for n in names if not n.startswith("mla_tune-")} == {"mla_tune"}
    for init in (ROOT / "mla_tune").rglob("__init__.py"):
        if "__pycache__" not in init.parts:
            assert init.relative_to(ROOT).as_posix() in names
