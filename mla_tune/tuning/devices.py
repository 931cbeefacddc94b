"""The worker devices of a sweep: one process per GPU asked for, or the CPU."""

from __future__ import annotations


class DeviceChoiceError(ValueError):
    """A device or GPU count that this machine cannot give."""


def default_device() -> str:
    """cuda when torch sees a GPU, else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def sweep_devices(device: str, gpus: str | None) -> tuple[str, ...]:
    """One entry per worker process: `cuda:i` for each GPU asked for (`gpus`: a count or
    all), else the device itself."""
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise DeviceChoiceError(f"unknown device {device!r}; use cpu, cuda or cuda:N")
    if device == "cpu":
        if gpus is not None:
            raise DeviceChoiceError("--gpus needs --device cuda; a CPU sweep runs one worker "
                                    "process")
        return ("cpu",)
    import torch

    if not torch.cuda.is_available():
        raise DeviceChoiceError("--device cuda was asked for but torch sees no GPU; use "
                                "--device cpu")
    count = torch.cuda.device_count()
    if gpus is None:
        return (device if ":" in device else "cuda:0",)
    if ":" in device:
        raise DeviceChoiceError(f"--gpus takes GPUs 0..N-1; drop --device {device} or --gpus")
    if gpus.strip().lower() == "all":
        return tuple(f"cuda:{i}" for i in range(count))
    if not gpus.strip().isdigit() or not 1 <= int(gpus) <= count:
        raise DeviceChoiceError(f"--gpus must be a number from 1 to {count} (GPUs seen) or "
                                f"all, got {gpus!r}")
    return tuple(f"cuda:{i}" for i in range(int(gpus)))
