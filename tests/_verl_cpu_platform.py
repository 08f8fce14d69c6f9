"""A CPU "accelerator" for verl 0.9.1, so that verl's whole PPO trainer (``main_ppo``: Ray, the v1 trainer,
FSDP2 workers, the agent loop, checkpoints) runs on a machine without GPUs, for tests only.

verl resolves its platform once per process (``verl.plugin.platform.get_platform``): with
``VERL_PLATFORM=agentrl_cpu`` and ``VERL_USE_EXTERNAL_MODULES=_verl_cpu_platform`` (this module on
``PYTHONPATH``) every verl process, Ray workers included, gets :class:`CPUPlatform`: device ``cpu``,
collectives over gloo, and Ray's ``GPU`` resource as the placement unit, so Ray must be started with
fake GPUs (``ray_kwargs.ray_init.num_gpus``); a "GPU" here is one CPU process. Device-module calls that
have no CPU meaning (memory statistics, streams, peer access) answer with neutral values.

Nothing in the product imports this: it exists so that a CPU test can drive verl's real trainer.
"""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

PLATFORM_NAME = "agentrl_cpu"


def _gloo_only(init_process_group: Any) -> Any:
    """verl asks for ``cpu:gloo,<device>:<backend>``, i.e. ``cpu:gloo,cpu:gloo`` here, which torch refuses
    (duplicate device type): ask for plain ``gloo`` instead."""

    def init(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("backend") == "cpu:gloo,cpu:gloo":
            kwargs["backend"] = "gloo"
        return init_process_group(*args, **kwargs)

    return init


if not getattr(torch.distributed.init_process_group, "_agentrl_cpu", False):
    torch.distributed.init_process_group = _gloo_only(torch.distributed.init_process_group)
    torch.distributed.init_process_group._agentrl_cpu = True


class _CPUDeviceModule(ModuleType):
    """``torch.cpu`` plus neutral answers for the ``torch.cuda`` calls verl makes on its device module."""

    def __init__(self) -> None:
        super().__init__("agentrl_cpu_device")

    def __getattr__(self, name: str) -> Any:
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        neutral: dict[str, Any] = {
            "is_available": lambda: True,
            "device_count": lambda: 1,
            "current_device": lambda: "cpu",
            "set_device": lambda *a, **k: None,
            "empty_cache": lambda: None,
            "manual_seed": torch.manual_seed,
            "manual_seed_all": torch.manual_seed,
            "get_rng_state": lambda *a, **k: torch.get_rng_state(),
            "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
            "mem_get_info": lambda *a, **k: (64 << 30, 64 << 30),
            "memory_allocated": lambda *a, **k: 0,
            "memory_reserved": lambda *a, **k: 0,
            "max_memory_allocated": lambda *a, **k: 0,
            "max_memory_reserved": lambda *a, **k: 0,
            "reset_peak_memory_stats": lambda *a, **k: None,
            "get_device_name": lambda *a, **k: "cpu",
            "get_device_capability": lambda *a, **k: (0, 0),
            "is_initialized": lambda: True,
            "ipc_collect": lambda: None,
        }
        if name in neutral:
            return neutral[name]
        raise AttributeError(f"the agentrl CPU test platform has no device call {name!r}")


@PlatformRegistry.register(platform=PLATFORM_NAME)
class CPUPlatform(PlatformBase):
    """verl platform whose "device" is the CPU (see module docstring)."""

    _module = _CPUDeviceModule()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return self._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return True

    def current_device(self) -> str:
        return "cpu"  # verl passes it as the device of tensors and modules

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
