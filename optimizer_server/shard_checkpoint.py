"""The shard's checkpoints (Shard inherits it): save in the background, the save
guard, and load at any world size.

A save (``start_save``) is a ckpt_io.SaveJob: its writer threads write the state as
it was when the save started, and every method below that overwrites state
elements first calls ``_guard(lo, hi)`` (SaveJob.ensure), so a STEP may run while
the save is still being written (a background save) and the file still holds the
saved step's bytes.  INIT and LOAD replace the whole state: they wait for the save.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from . import checkpoint as C
from . import protocol as P
from .shard_phase import ShardPhase
from .atomic import atomic_write_bytes, fsync_dir
from .ckpt_io import DIRECT_ALIGN, IO_THREADS, SAVE_CHUNK, SaveJob, chunk_buffer, combine_pieces, parallel_copy
from .piece_map import PieceMap
from .state import ShardStateArrays


class ShardCheckpoint:
    """start_save / save / save_status / load and the save guard of Shard."""

    def _guard(self, lo: int, hi: int) -> None:
        """Before elements [lo, hi) of the state are overwritten: a save in flight has
        written them (SaveJob.ensure)."""
        job = self.save_job
        if job is not None and not job.done:
            job.ensure(lo, hi)

    @property
    def saving(self) -> bool:
        """A save of this shard is still being written."""
        return self.save_job is not None and not self.save_job.done

    def _await_save(self) -> None:
        """Before the whole state is replaced (INIT, LOAD): the save in flight completes
        (its own error stays with it, for STATS and the engine)."""
        if self.saving:
            try:
                self.save_job.wait()
            except Exception:  # noqa: BLE001
                pass

    def _paths(self, d: Path) -> tuple[Path, Path]:
        return (C.rank_file(d, C.SHARD, self.rank, self.world_size, ".bin"),
                C.rank_file(d, C.SHARD, self.rank, self.world_size, ".json"))

    def manifest(self) -> dict:
        return {"format": C.SHARD_FORMAT, "protocol_version": P.PROTOCOL_VERSION,
                "rank": self.rank, "world_size": self.world_size, "numel": self.numel,
                "dtype": self.dtype, "optimizer": self.optimizer, "hparams": self.hparams,
                "updates": self.updates, "skipped": self.skipped, "groups": self.last_groups,
                "arrays": self.arrays.names, "array_dtypes": self.arrays.dtypes}

    def snapshot_bytes(self) -> int:
        """Host RAM a save may take beyond the state: a snapshot of the whole file, at
        most, and each writer thread's copy of one chunk (ckpt_io.SaveJob)."""
        per_elem = self.arrays.saved_bytes() / max(1, self.numel)
        chunks = -(-self.numel // SAVE_CHUNK) + IO_THREADS
        pad = chunks * 2 * len(self.arrays.names) * DIRECT_ALIGN  # each piece aligned for O_DIRECT in its buffer
        return int(self.arrays.saved_bytes() + IO_THREADS * per_elem * min(self.numel, SAVE_CHUNK) + pad)

    def start_save(self, directory: str, *, snapshot: bool = True, on_done=None, pieces: PieceMap | None = None,
                   background: bool = False, pool_room=None) -> SaveJob:
        """Update thread: start writing master + state as they are now (ckpt_io.SaveJob):
        the data file (random temp name, fsync'd once, renamed), then the manifest with
        the file's checksum, then the directory's fsync.  Later updates may run while
        it writes (``_guard``: with `snapshot`, they copy what they are about to
        overwrite and go on; without, they write it first); SaveJob.wait() gives what
        ``save`` returns.  on_done: called once the job has ended, however.
        background: training goes on while it writes (its threads take only idle CPU).
        pool_room: the server's room for a snapshot (SaveJob: the pool topped up after it).

        pieces: this shard's elements go into directory's shared one-rank file (the
        layout of pieces.flat_numel elements, which every rank's server writes: the first
        makes it), where the map puts them (piece_map); no manifest (the workers' rank 0
        writes it from every writer's CRC): the result's "crc" is this shard's masked
        CRC (ckpt_io.combine_disjoint)."""
        if self.saving:
            raise ValueError("a save of this shard is still being written: wait for it (engine.wait_checkpoint) "
                             "before the next one")
        d = Path(directory)
        man = self.manifest()
        if pieces is None:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            bin_path, man_path = self._paths(d)
            nbytes = self.arrays.saved_bytes()
            parts = self.arrays.save_parts(self.weights16_slots)
            file_size = 0

            def finish(crc: int) -> dict:  # on a writer thread, after the data file is in place
                atomic_write_bytes(man_path, json.dumps(dict(man, checksum=C.checksum_str(crc)), indent=1).encode())
                fsync_dir(d)
                return {"path": str(bin_path), "bytes": nbytes, "updates": man["updates"]}
        else:
            self._check_pieces(pieces)
            bin_path = C.rank_file(d, C.SHARD, 0, 1, ".bin")
            file_size = ShardStateArrays.file_bytes(self.arrays.names, self.arrays.dtypes, pieces.flat_numel)
            nbytes = pieces.covered * (self.arrays.saved_bytes() // max(1, self.numel))
            parts = self.arrays.save_parts(self.weights16_slots, layout_numel=pieces.flat_numel)

            def finish(crc: int) -> dict:
                return {"path": str(bin_path), "bytes": nbytes, "updates": man["updates"], "crc": crc}
        if self.save_job is not None:
            self._io_done += self.save_job.bytes_done
        self.save_job = SaveJob(bin_path, parts, self.numel, nbytes, finish,
                                max_bytes_per_s=self.save_max_bytes_per_s, snapshot=snapshot, on_done=on_done,
                                pieces=pieces, file_size=file_size, pool=self.save_pool, background=background,
                                pool_room=pool_room)
        self.save_seq += 1
        return self.save_job

    def _check_pieces(self, pieces: PieceMap) -> None:
        if pieces.numel != self.numel:
            raise ValueError(f"a piece map of a {pieces.numel}-element shard for this {self.numel}-element one")
        if self.arrays.state_dtype == "int8":
            raise ValueError("int8 state cannot be placed into a shared layout: its scale per 256 elements does "
                             "not follow the pieces (use state_dtype 'bf16' or 'fp32')")

    def save(self, directory: str, pieces: PieceMap | None = None) -> dict:
        """A blocking save: start_save, then wait for it (the same bytes as a background one;
        nothing updates meanwhile, so no snapshot is taken)."""
        return self.start_save(directory, snapshot=False, pieces=pieces).wait()

    def save_status(self) -> dict:
        """The newest save's state ("idle" if none): STATS_OK's save_* fields."""
        if self.save_job is None:
            return {"state": "idle", "bytes_done": 0, "bytes_total": 0, "error": "", "seconds": 0.0, "waited_s": 0.0,
                    "snapshot": False, "snapshot_peak": 0, "ensure_writes": 0, "crc": -1}
        st = self.save_job.status()
        return dict(st, crc=(self.save_job.result or {}).get("crc", -1) if st["state"] == "done" else -1)

    def verified_read_bytes(self) -> int:
        """Host RAM a one-pass LOAD takes beside the running state: a second state (and
        the exact master's high halves, staged)."""
        return self.arrays.verified_read_bytes()

    def load(self, directory: str, weights_slot: int = 0, room: int = 0, pieces: PieceMap | None = None,
             verified: bool = False) -> dict:
        """Read this shard's range of a checkpoint, saved with this world size or
        another (optimizer_server.reshard): every rank's manifest must agree, and
        every file read must match its checksum, before any state is touched.

        room: host bytes the server admits beside the running state.  Where the shard's
        own file of the same world size is read whole and a second state fits in room,
        one pass reads it into a new state, checksumming as it reads, and the new state
        replaces the running one only once the file has verified (``_load_one_pass``).
        Otherwise every file is verified first, then read (two passes over the disk).

        pieces: this shard's elements lie where the map puts them in the checkpoint's
        flat space (an FSDP2 rank's rows, piece_map), not in one range; verified: the
        caller has checked every file's checksum already (the FSDP2 ranks check the shared
        files together, each 1/world of them), so only the read is left."""
        d = Path(directory)
        src = C.pick_world_size(d, C.SHARD, self.world_size)
        man_paths = [C.rank_file(d, C.SHARD, k, src, ".json") for k in range(src)]
        mans = []
        for path in man_paths:
            if not path.exists():
                raise ValueError(f"checkpoint {d} is incomplete: {path.name} is missing; load another "
                                 f"checkpoint (an earlier step-N beside it)")
            try:
                man = json.loads(path.read_text())
            except ValueError as e:
                raise C.CheckpointError(f"checkpoint manifest {path} is not JSON ({e}); load another checkpoint")
            C.check_shard_manifest(path, man)
            if man["world_size"] != src or man["rank"] != len(mans):
                raise C.CheckpointError(f"checkpoint manifest {path} says rank {man['rank']} of "
                                        f"{man['world_size']}, its name rank {len(mans)} of {src}")
            mans.append(man)
        mine = self.manifest()
        keys = ("dtype", "optimizer", "arrays") + (("numel",) if src == self.world_size and pieces is None else ())
        for k, man in enumerate(mans):
            diff = {key: (man.get(key), mine[key]) for key in keys if man.get(key) != mine[key]}
            if man.get("format") not in C.SHARD_FORMATS_READ:
                diff["format"] = (man.get("format"), f"one of {list(C.SHARD_FORMATS_READ)}")
            elif man.get("format") != mans[0].get("format"):
                diff["format across ranks"] = (man.get("format"), mans[0].get("format"))
            if man.get("numel") != mans[0].get("numel") or C.manifest_updates(man) != C.manifest_updates(mans[0]):
                diff["numel/updates across ranks"] = ((man.get("numel"), C.manifest_updates(man)),
                                                      (mans[0].get("numel"), C.manifest_updates(mans[0])))
            if diff:
                desc = ", ".join(f"{key}: checkpoint {a!r} vs this run {b!r}" for key, (a, b) in diff.items())
                raise ValueError(f"checkpoint {man_paths[k]} does not match this shard's layout ({desc})")
        per_file = int(mans[0]["numel"])
        saved_dtypes = C.saved_array_dtypes(mans[0])
        expect = ShardStateArrays.file_bytes(self.arrays.names, saved_dtypes, per_file)
        bins = [C.rank_file(d, C.SHARD, k, src, ".bin") for k in range(src)]
        lo = self.rank * self.numel
        placed = pieces is not None  # an FSDP2 rank's rows: never one file's whole
        if pieces is None:
            pieces = PieceMap.contiguous(lo, self.numel, per_file * src)
        else:
            self._check_pieces(pieces)
            if pieces.flat_numel > per_file * src:
                raise C.CheckpointError(f"checkpoint {d} holds {per_file * src} elements, the piece map places "
                                        f"this shard in a flat space of {pieces.flat_numel}: load it into the model "
                                        f"it was saved from")
        if not 0 <= weights_slot < len(self.weights16_slots):
            raise ValueError(f"LOAD's weights_slot {weights_slot} but the shard has {len(self.weights16_slots)} weights slot(s)")
        for k, path in enumerate(bins):
            size = path.stat().st_size if path.exists() else -1
            if size != expect:
                raise ValueError(f"checkpoint {path} has {size} bytes, expected {expect} (truncated?)")
        man = mans[0]
        mine_k = mans[self.rank] if src == self.world_size and not placed else None
        if (mine_k is not None and mine_k.get("checksum") and self.arrays.can_read_verified(saved_dtypes)
                and self.verified_read_bytes() <= room):
            self._load_one_pass(bins[self.rank], mine_k["checksum"], saved_dtypes, expect, weights_slot)
            return dict(self._loaded(man, weights_slot), passes=1)
        for k, path in enumerate(bins):
            if not verified and any(k * per_file < f + (y - x) and f < (k + 1) * per_file  # a file this shard reads
                                    for x, y, f in pieces.split(0, self.numel)):
                C.verify(path, mans[k].get("checksum"))
        # Straight into the state arrays: temporaries would double the server's
        # memory (12 B/param) exactly when resuming, the moment a job that fits
        # would OOM.  A read that fails midway leaves a mix, so the shard is marked
        # uninitialized and refuses STEP until a LOAD or INIT succeeds.
        self._await_save()
        self.phase = ShardPhase.UNINITIALIZED
        self._state_dirty = True
        try:
            self.arrays.read_from(bins, per_file, saved_dtypes, pieces, self.weights16_slots, weights_slot, self.threads)
            self._load_bytes += expect
        except OSError as e:
            raise OSError(f"reading checkpoint {d} failed ({e}); this shard's state is now partly "
                          f"overwritten: LOAD a good checkpoint (or INIT) before the next step") from e
        return dict(self._loaded(man, weights_slot), passes=2)

    def _load_one_pass(self, path: Path, checksum: str, dtypes: dict, expect: int, weights_slot: int) -> None:
        """The shard's own file, read once into a new state while its checksum is computed;
        the running state untouched until it has verified.  The exact master's high halves
        are staged and copied into the weights slot once verified: the slot holds the
        running state's (2 B/param copied at memory speed, against a second pass over the
        disk's 8-10 B/param)."""
        new = ShardStateArrays(self.optimizer, self.numel, state_dtype=self.arrays.state_dtype,
                               exact_master=self.arrays.exact_master, seed=self.arrays.seed)
        hi = chunk_buffer(2 * self.numel).view(np.uint16) if new.exact_master else None
        try:
            pieces = new.read_verified(path, dtypes, hi_out=hi)
        except OSError as e:
            raise OSError(f"reading checkpoint file {path} failed ({e}); this shard's state is untouched") from e
        got = C.checksum_str(combine_pieces(pieces, size=expect))
        if got != checksum:
            raise C.CheckpointError(f"checkpoint file {path} is corrupt: its checksum is {got}, the manifest says "
                                    f"{checksum}; load another checkpoint (an earlier step-N beside it)")
        self._await_save()  # (nothing is saving the old state any more: LOAD replaces it)
        if hi is not None:
            parallel_copy(self.weights16_slots[weights_slot], hi, self.threads)
            new.hi_slot = weights_slot
        twin = self.arrays.twin is not None
        self.arrays = new  # the old state goes with its last reference
        if twin:  # speculation's twin, as HELLO granted it
            new.make_twin()
        self._state_dirty = True
        self._load_bytes += expect

    def _loaded(self, man: dict, weights_slot: int) -> dict:
        """After either way of reading: the counters, the weights slot, READY."""
        self.updates = C.manifest_updates(man)
        self.skipped = int(man.get("skipped", 0))
        self.hparams.update(man.get("hparams", {}))
        self._init_next = 0
        self._write_weights16(weights_slot)
        self.progress[0] = 0  # steps may repeat after a rollback: no old tag may match
        self.phase = ShardPhase.READY
        return {"updates": self.updates}
