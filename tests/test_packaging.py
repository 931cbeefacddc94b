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


def test_a_checkout_on_the_path_imports_kernels_and_configs_without_an_install(tmp_path):
    """The GPU machine runs the checkout with PYTHONPATH at its root and nothing installed:
    kernels/ and configs/ must still be mla_tune.kernels and mla_tune.configs there."""
    code = (
        "import sys, json; sys.path[:] = json.loads(sys.argv[1]);"
        "import mla_tune.kernels.triton.launch as k, mla_tune.configs as c;"
        "from mla_tune.tuning.space import load_backend_space;"
        "print(k.__file__); print(c.__file__); print(load_backend_space('triton').size())")
    libs = [p for p in sys.path if p and Path(p).is_dir() and Path(p).resolve() != ROOT
            and not (Path(p) / "mla_tune").exists()]
    import json

    r = subprocess.run([sys.executable, "-I", "-S", "-c", code, json.dumps([str(ROOT), *libs])],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    kernel, configs, size = r.stdout.split()
    assert Path(kernel) == ROOT / "kernels" / "triton" / "launch.py"
    assert Path(configs) == ROOT / "configs" / "__init__.py" and int(size) > 0
