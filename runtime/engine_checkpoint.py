"""The engine's checkpoint and master-weights API: OffloadEngine inherits it.

It reads the engine's parts (cycle, client, flat, checkpoints, scaler, optimizer,
coll, tracer) and its counters, and writes only the counters a load restores.
The files themselves: runtime.checkpoint (the engine's) and optimizer_server.checkpoint
(the format)."""
from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch

from zero_offload.server import checkpoint as ckpt_format
from zero_offload.server.errors import OptimizerServerDeadError, OptimizerServerError

from . import host_memory
from .step_state import StepPhase, next_phase

log = logging.getLogger("zero_offload")

MID_STEP = ("{what} in the middle of a step would lose its gradients (backward() has run, step() has not): "
            "call it after engine.step()")


class CheckpointAPI:
    """save_checkpoint / load_checkpoint / wait_checkpoint / master_state_dict of OffloadEngine."""

    def _check_between_steps(self, what: str) -> None:
        """The staging window lies over gradient slot 0 and LOAD rewrites weights16:
        between backward() and step() either would destroy the step's gradients."""
        self._check_open()
        if (self.phase is StepPhase.GRADS_READY or self._step_grads is not None
                or self._micro % self.cfg.grad_accumulation_steps):
            raise RuntimeError(MID_STEP.format(what=what))
        self._finish_overlap()
        self.cycle.land(copy=False)
        # on CUDA the copies in either direction may still read the slots
        self.grads.quiesce()
        self.cycle.quiesce()

    def master_state_dict(self, rank0_only: bool = False) -> "OrderedDict[str, torch.Tensor]":
        """The fp32 master weights (all shards) as CPU tensors, keyed like model.state_dict().

        The values are views into one host tensor of the flat space (4 B/param, no
        copy per parameter).  Across ranks the shards are gathered window by window
        (runtime.distributed: never a full fp32 model on a device); rank0_only=True
        assembles them on rank 0 alone, and the other ranks return an empty dict
        (FSDP's full state dict convention), so a node holds one fp32 model, not one
        per rank.  Every rank must call it (a collective).  On FSDP2 (runtime.engine_fsdp2)
        the same, keyed by the FSDP2 model's names (rank0_only: FSDP2's first rank)."""
        if self.fsdp2 is not None:
            return self.fsdp2.gather_master(list(self._master_state_dict(False).values()), rank0_only)
        return self._master_state_dict(rank0_only)

    def _master_state_dict(self, rank0_only: bool) -> "OrderedDict[str, torch.Tensor]":
        self._check_between_steps("master_state_dict()")
        # its fp32 copy here, and with several ranks the gathered model on those that keep it
        gathered = self.world_size > 1 and (self.rank == 0 or not rank0_only)
        need = 4 * (self.flat.shard_numel + (self.flat.padded_numel if gathered else 0))
        ok = host_memory.has_room(need)
        if self.world_size > 1:
            ok = self.coll.all_ok(ok)
        if not ok:
            raise host_memory.room_error(need, "master_state_dict() (the fp32 master: 4 B/param)",
                                         host_memory.MASTER_INSTEAD)
        shard = torch.from_numpy(self.client.get_master())
        full = shard if self.world_size == 1 else self.coll.gather_master(shard, rank0_only)
        out = OrderedDict()
        if full is None:
            return out
        for row in self._param_rows():
            view = full[row["offset"]:row["offset"] + row["numel"]].view(row["shape"])
            for name in row["names"]:  # a tied weight under each of its names
                out[name] = view
        return out

    def _param_rows(self) -> list[dict]:
        """Each trainable parameter in model order: offset in the flat space, numel,
        shape and state_dict names (a tied weight has several; the first is its
        named_parameters() name, `param{i}` for a parameter the engine got no name for)."""
        rows = []
        for i, p in enumerate(self.flat.params):
            s = self.flat.by_param[id(p)]
            rows.append({"offset": s.offset, "numel": s.numel, "shape": list(p.shape),
                         "names": self._names.get(id(p), [f"param{i}"])})
        return rows

    def _param_table(self) -> list[dict]:
        """Each parameter's place in the flat space, shape and state_dict names (a tied
        weight has several), in the flat space's order: the checkpoint's "params"
        (docs/checkpoint.md), so a checkpoint exports without the model
        (zero_offload.export)."""
        rows = [{k: r[k] for k in ("offset", "shape", "names")} for r in self._param_rows()]
        return sorted(rows, key=lambda r: r["offset"])

    def save_checkpoint(self, directory: str, keep: int = 2, background: bool = False) -> str:
        """Write a checkpoint under directory/step-NNNNNNNN and point directory/latest at it
        (runtime.checkpoint; docs/checkpoint.md).  Server: this shard's master and
        optimizer state (fsync'd).  Engine: counters, loss scale and the device weights
        as they are (they may be one update behind, DPU).  directory must be one
        filesystem for every rank and the server.  The newest `keep` are kept.

        background=True returns as soon as the server has started writing (the engine's
        own files are snapshotted and written on a thread of its own) and training goes on; the
        files hold exactly this step's state.  The save is published (renamed, `latest`
        pointed at it) at the first step() that finds it done, or by wait_checkpoint();
        until then the previous checkpoint stays `latest`.  Returns the step directory
        (not there yet with background=True).  On FSDP2 (runtime.engine_fsdp2) a collective
        of every rank, in the layout every topology and both paths load."""
        if self.fsdp2 is not None:
            return self.fsdp2.save(self, directory, keep, background)
        return self.save_own_checkpoint(directory, keep, background)

    def save_own_checkpoint(self, directory: str, keep: int = 2, background: bool = False) -> str:
        """save_checkpoint in the engine's own layout: on FSDP2 this rank's local shards
        alone, as a one-rank checkpoint (what a rank's opt.state_dict() holds); else the
        same as save_checkpoint."""
        self._check_between_steps("save_checkpoint()")
        dev, pending, meta = self._checkpoint_parts()
        if self.rank == 0:  # once per checkpoint: what zero_offload.export needs to name the master's pieces
            meta["params"] = self._param_table()
        return self.checkpoints.save(directory, self.iteration, keep, client=self.client, device16=dev,
                                     pending16=pending, meta=meta, background=background)

    def _checkpoint_parts(self) -> tuple[np.ndarray, np.ndarray | None, dict]:
        """What a save writes beside the server's file (between steps): this rank's device
        weights as they are (int16 words), the update's weights still to go up (or None)
        and the engine file's fields."""
        dev = self.flat16[self.shard_lo:self.shard_hi].detach().to("cpu", self.dtype).contiguous()
        dev = dev.view(torch.int16).numpy()
        pending = self.cycle.incoming_words() if self.cycle.landed else None
        meta = {"dtype": self.cfg.dtype, "optimizer": self.cfg.optimizer, "iteration": self.iteration,
                "updates": self.updates, "skipped_steps": self.skipped_steps, "micro": self._micro,
                "scaler": self.scaler.state_dict(), "optimizer_proxy": self.optimizer.state_dict_small(),
                "param_updates": self.param_updates.tolist(), "param_align": self.param_align}
        return dev, pending, meta

    def checkpoint_in_flight(self) -> bool:
        """True while a background save_checkpoint is not yet published."""
        return self.checkpoints.in_flight is not None

    def wait_checkpoint(self) -> str | None:
        """Wait for the background save in flight and publish it: its step directory
        (None if there is none).  Every rank must call it.  Raises naming the cause if
        the save failed; the previous checkpoint then stays `latest`."""
        self._check_open()
        if self.checkpoints.in_flight is None:
            return self.checkpoints.finish(self.client)  # None, once a prune in progress is done
        self._finish_overlap()
        self.cycle.land(copy=False)  # STATS answers only with no STEP in flight
        return self.checkpoints.finish(self.client)

    @staticmethod
    def has_checkpoint(directory: str) -> bool:
        """True once save_checkpoint(directory) has completed (its `latest` pointer exists)."""
        return ckpt_format.has_checkpoint(directory)

    @staticmethod
    def resolve_checkpoint(directory: str):
        """directory/latest's target, or the directory itself if it holds the files."""
        return ckpt_format.resolve(directory)

    def load_checkpoint(self, directory: str) -> None:
        """Restore a checkpoint saved with this world size or another: each rank
        reads its shard's range of every saved shard (optimizer_server.reshard),
        so a job can resume on fewer or more ranks.  Every file read is checked
        against its checksum first.  On FSDP2 any checkpoint of this model's optimizer, of
        either path and any world size (runtime.fsdp2_checkpoint), a collective."""
        if self.fsdp2 is not None:
            self.fsdp2.load(self, directory)
            return
        self.load_own_checkpoint(directory)

    def load_own_checkpoint(self, directory: str) -> None:
        """load_checkpoint of a checkpoint in the engine's own layout (save_own_checkpoint's)."""
        self._check_between_steps("load_checkpoint()")
        self.wait_checkpoint()  # a background save of ours is published (or fails) first
        d, src, meta, metas = self.checkpoints.read_meta(
            directory, {"param_align": self.param_align, "numel": self.flat.numel, "dtype": self.cfg.dtype,
                        "optimizer": self.cfg.optimizer})
        # the engine file's values, checked before the server's LOAD replaces its state
        self.optimizer.check_state_dict_small(meta.get("optimizer_proxy"), where=f"checkpoint {d}")
        counts = meta.get("param_updates", [meta["updates"]] * len(self.param_updates))  # older: all, every step
        if len(counts) != len(self.param_updates):
            raise ValueError(f"checkpoint {d} counts steps for {len(counts)} parameters, this model has "
                             f"{len(self.param_updates)} trainable ones: load it into the model it was saved from")
        with self.tracer.span("load_checkpoint", world_size_saved=src):
            raw = self.checkpoints.read_shard(d, "device16", src, metas)
            pending = None
            if meta["stale"]:  # verified before the server's state is touched
                pending = self.checkpoints.read_shard(d, "pending16", src, metas,
                                                      out=np.empty(self.flat.shard_numel, np.int16))
            self._restore(meta, counts, raw, pending, lambda slot: self.client.load(str(d), weights_slot=slot))
        if self.fsdp2 is not None:
            self.fsdp2.copy_back()  # the loaded device weights into the local shards

    def _restore(self, meta: dict, counts, raw: np.ndarray, pending: np.ndarray | None, server_load) -> None:
        """A load's second half, every file verified and this rank's words read: the
        server's LOAD (server_load(weights_slot)), then the device weights, the counters,
        the update still to go up (pending, under DPU), the loss scale and the
        optimizer's small state."""
        # the exact master: LOAD writes the weights of the newest update into the
        # slot that will hold its high halves (the incoming one when they are still
        # to go up, else the model's), and the engine writes no slot the server owns
        exact, stale = self.cfg.exact_master, meta["stale"]
        weights_slot = (self.cycle.incoming_slot if stale else self.cycle.model_slot) if exact else 0
        server_load(weights_slot)
        if not (exact and self._zero_copy and not stale):
            self.flat16[self.shard_lo:self.shard_hi].copy_(torch.from_numpy(raw).view(self.dtype))
        if self.world_size > 1:
            self.coll.all_gather_weights(self.flat16, self.tracer)
        self.iteration = meta["iteration"]
        self.updates = meta["updates"]
        self.skipped_steps = meta["skipped_steps"]
        self._micro = meta["micro"]
        self.phase = next_phase(self.phase, "restore", self._micro % self.cfg.grad_accumulation_steps == 0)
        self.param_updates[:] = counts
        self.cycle.reset()
        if meta["stale"]:
            # nothing is in flight: the server does not touch the slot until the next STEP
            if not self.cfg.exact_master:  # (with it, LOAD has written these weights there)
                self.cycle.incoming_words().view(np.int16)[:] = pending
            self.cycle.restore(self.updates)
        self.scaler.load_state_dict(meta["scaler"])
        self.optimizer.load_state_dict_small(meta["optimizer_proxy"])

    def _poll_checkpoint(self) -> None:
        """A background save that the server has finished is published here, between steps;
        a failed one is logged (wait_checkpoint raises it)."""
        try:
            self.checkpoints.poll(self.client)
        except OptimizerServerDeadError:
            raise
        except OptimizerServerError as e:
            log.warning("%s", e)
