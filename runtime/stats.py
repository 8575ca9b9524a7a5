"""The engine's running counters, one object its parts write into and stats() reads."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Counters:
    bytes_to_host: int = 0          # gradient bytes copied into the shared slot (this rank's shard)
    bytes_to_device: int = 0        # weight bytes copied up from the shared slot (0 with cpu_zero_copy)
    bytes_to_device_early: int = 0  # ... of which copied while the update still ran or inside backward
    wait_s: float = 0.0             # waiting for the server's DONE
    grad_slot_wait_s: float = 0.0   # backward's hooks waiting for the update to pass (one DPU slot)
    update_s: float = 0.0           # the server's own time in updates (DONE.update_s)
    overlap_wait_s: float = 0.0     # overlap_update: forward pre-hooks waiting for their weights
    overlap_steps: int = 0          # overlap_update: updates left running into the next forward
    overlap_forward_params: int = 0  # ... parameters made current by a forward pre-hook (not by finish)
    spec_steps: int = 0             # steps that sent SPECULATE (undo_log_bytes > 0)
    spec_kept_steps: int = 0        # ... whose speculated update the server kept (DONE.speculated > 0)
    spec_rollback_steps: int = 0    # ... that the server rolled back (DONE.rolled_back > 0, or a SKIP)
    spec_kept_numel: int = 0        # elements updated during backward and kept
    spec_rolled_back_numel: int = 0  # elements updated during backward, then restored and redone

    def report(self) -> dict:
        """The counters under stats()'s names (update_s is "server_update_s" there)."""
        return {"bytes_to_host": self.bytes_to_host, "bytes_to_device": self.bytes_to_device,
                "bytes_to_device_early": self.bytes_to_device_early, "wait_s": self.wait_s,
                "grad_slot_wait_s": self.grad_slot_wait_s, "server_update_s": self.update_s,
                "overlap_wait_s": self.overlap_wait_s, "overlap_steps": self.overlap_steps,
                "overlap_forward_params": self.overlap_forward_params, "spec_steps": self.spec_steps,
                "spec_kept_steps": self.spec_kept_steps, "spec_rollback_steps": self.spec_rollback_steps,
                "spec_kept_numel": self.spec_kept_numel, "spec_rolled_back_numel": self.spec_rolled_back_numel}
