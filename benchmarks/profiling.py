"""Where a benchmark's time goes, shared by the benchmarks: the operators with the most self time in one call (device
time on CUDA, where the kernels are listed by name) and the number of device kernels the call launched."""

from __future__ import annotations

from collections.abc import Callable


def profile_call(call: Callable[[], object], is_cuda: bool, top: int = 20) -> tuple[list[dict], int | None]:
    """``(top operators, device kernels)`` of one ``call()``: each operator's name, self milliseconds and calls;
    the kernel count is None off CUDA."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if is_cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        call()
    key = "self_device_time_total" if is_cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)[:top]
    operators = [{"name": e.key[:100], "self_ms": round(getattr(e, key, 0) / 1000, 2), "calls": e.count}
                 for e in events]
    kernels = sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA) if is_cuda else None
    return operators, kernels
