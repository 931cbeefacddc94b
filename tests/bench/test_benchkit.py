"""bench/benchkit.py is what the bench scripts share: the task's inputs laid out as the Triton
launcher takes them, the sweep's gate, the variant notation, another kernel source loaded
beside the checkout's (kernel_probe --baseline), the device's read ceiling from the tuning
DB, and a refusal to run against a copy of mla_tune other than the checkout's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

import benchkit  # noqa: E402
from mla_tune.db import TuningStore  # noqa: E402
from mla_tune.kernels.triton import mla_decode  # noqa: E402
from mla_tune.kernels.triton.precompile import jit_compile  # noqa: E402
from mla_tune.machine.fingerprint import current_device  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

_LAUNCH_EVERY_FORMAT = r"""
import sys
sys.path.insert(0, "bench")
import benchkit
from mla_tune.kernels.triton import mla_decode
for fmt in ("bf16", "fp8", "mxfp4"):
    shape, cfg = benchkit.parse_variant(f"{fmt}:2x64:block_n=32,num_stages=2,num_splits=2")
    data = benchkit.task_input(shape, "cpu", seed=3)
    launcher = benchkit.prepared_launcher(mla_decode, cfg, shape, data, device="cpu")
    out = launcher(*benchkit.launcher_args(data, fmt))
    print(fmt, benchkit.check(out, benchkit.reference(data, fmt), fmt).ok)
"""


def test_inputs_reach_the_launcher_in_its_argument_order_for_every_format() -> None:
    """Each format's cache and scales land where the launcher reads them: a scale in the
    wrong slot, or MXFP4 bytes read as another format, fails the gate."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _LAUNCH_EVERY_FORMAT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["bf16", "True", "fp8", "True", "mxfp4", "True"]


def test_variant_notation_gives_the_shape_and_typed_knobs() -> None:
    shape, cfg = benchkit.parse_variant("fp8:256x8192:compute=fp8,block_n=64,fast_mode=1",
                                        heads=32)
    assert (shape.batch, shape.kv_lens[0], shape.heads, shape.kv_format.value) == \
        (256, 8192, 32, "fp8")
    assert (cfg.kv_format, cfg.compute, cfg.block_n, cfg.fast_mode) == ("fp8", "fp8", 64, True)


@pytest.mark.parametrize("text, says", [
    ("bf16:4x1024:blocks=32", "unknown knob 'blocks'"),
    ("bf16:4x1024:block_n=big", "block_n takes"),
    ("bf17:4x1024", "unknown kv format"),
    ("4x1024", "expected FORMAT:BATCHxKV"),
])
def test_a_bad_variant_is_refused_saying_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(SystemExit, match=says):
        benchkit.parse_variant(text)


def test_baseline_kernel_loads_as_its_own_module_and_compiles(tmp_path: Path) -> None:
    base = tmp_path / "base_kernel.py"
    base.write_text((ROOT / "kernels" / "triton" / "mla_decode.py").read_text())
    md = benchkit.load_kernel(base)
    assert md is not mla_decode
    assert md.mla_decode_kernel is not mla_decode.mla_decode_kernel
    cfg = benchkit.config_in(md, mla_decode.KernelConfig(kv_format="bf16", block_n=32,
                                                         num_stages=2))
    fn, args, kwargs = md.kernel_launches(cfg, heads=16, paged=False, merge=False,
                                          target="cuda:90")[0]
    assert jit_compile(fn, "cuda:90", args, kwargs).asm["ptx"].count("mma") > 0


def test_a_baseline_that_is_not_python_is_refused(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a kernel")
    with pytest.raises(SystemExit, match="not a Python file"):
        benchkit.load_kernel(notes)


def test_read_ceiling_is_the_one_the_db_stores_for_the_device(tmp_path: Path) -> None:
    db = str(tmp_path / "tuning.db")
    with TuningStore(db) as store:
        store.set_read_bandwidth(store.device_id(current_device("cpu")), 1234.5)
    assert benchkit.read_ceiling_gbps("cpu", db) == 1234.5


def test_without_a_stored_ceiling_a_cpu_is_refused(tmp_path: Path) -> None:
    db = str(tmp_path / "empty.db")
    TuningStore(db).close()
    with pytest.raises(SystemExit, match="not a GPU"):
        benchkit.read_ceiling_gbps("cpu", db)


def test_refuses_to_run_against_another_copy_of_the_package(tmp_path: Path) -> None:
    for name in ("mla_tune", "kernels"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "benchkit.py")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"mla_tune would be imported from {tmp_path.resolve()}" in proc.stderr
    env["PYTHONPATH"] = str(ROOT)
    ok = subprocess.run([sys.executable, str(ROOT / "bench" / "benchkit.py")], cwd=tmp_path,
                        env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
