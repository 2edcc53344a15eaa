"""What the operating system and the allocator say a process holds, and peaks by phase."""

from __future__ import annotations

import torch

# ----------------------------------------------------------------------------- measured


def measured_process_memory(device: torch.device | None = None) -> dict[str, int]:
    """What the operating system / allocator says this process holds right now.

    CPU: resident set size (current and peak, from /proc). CUDA: allocator peak. These
    include activations, buffers, the framework itself — the model-state audit
    (`Strategy.memory_breakdown`) is the part the formulas predict.
    """
    out: dict[str, int] = {}
    status = proc_status()
    if status:
        out["rss_bytes"], out["peak_rss_bytes"] = status["VmRSS"], status["VmHWM"]
    else:
        import resource

        out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if device is not None and device.type == "cuda":
        out["cuda_allocated_bytes"] = torch.cuda.memory_allocated(device)
        out["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """The byte-valued fields of /proc/<pid>/status (VmRSS, VmHWM, ...); {} off Linux."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key] = int(parts[0]) * 1024
    except OSError:
        return {}
    return out


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM (Linux ≥ 4.0: write 5 to clear_refs), so the next
    reading is the peak of a phase; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PhasePeaks:
    """Peak memory of each phase of a run (init, forward, backward, step, save), measured.

    Before a phase the peak is reset (CPU: /proc/self/clear_refs resets VmHWM; CUDA: the
    allocator's peak statistics); after it the peak is read. The largest value seen for a
    phase is kept, so the first steps — when optimizer states appear — are represented.
    """

    def __init__(self, device: torch.device | None = None):
        self.device = device
        self.peaks: dict[str, int] = {}
        self.baseline = self._now()  # the process before the engine existed

    def _now(self) -> int:
        if self.device is not None and self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return proc_status().get("VmRSS", 0)

    def _reset(self) -> bool:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return True
        return reset_peak_rss()

    def _peak(self) -> int:
        if self.device is not None and self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return proc_status().get("VmHWM", 0)

    def begin(self) -> bool:
        return self._reset()

    def end(self, phase: str) -> None:
        self.peaks[phase] = max(self.peaks.get(phase, 0), self._peak())

    def report(self) -> dict[str, int]:
        return {"baseline": self.baseline, **self.peaks}
