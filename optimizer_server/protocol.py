"""Wire protocol between training workers and the optimizer server.

Importable without torch.  Every control message is one ZeroMQ frame holding a
msgpack map ``{"t": TYPE, field: value, ...}``; tensor bytes never travel here,
they live in the shared segment described by ``optimizer_server.shm``.  The set
of types is closed, each decoder accepts exactly its fields with their types
(unknown or missing fields are errors) and no pickle is involved anywhere.

Conversation (worker = DEALER, server = ROUTER; one request in flight per shard):

    worker                                    server
      HELLO(version, token, rank, ...)  --->    check version, token, RAM; create segment
                                        <---  HELLO_OK(session, segment, layout, pid)
      (write fp32 weights [o, o+c) to staging)          in chunks of at most
      INIT(session, offset=o, count=c)  --->    staging -> master[o:o+c]    staging_numel,
                                        <---  OK                            in order from 0;
                                  (after the chunk that reaches numel: weights16 written)
      (write 16-bit grads to gradient slot g)
      STEP(session, step, grad_slot=g, lr, grad_scale, hparams, predict)
                                        --->    update on a worker thread
                                        (progress word: weights16 final up to here)
                                        <---  DONE(step, update_s)    (weights16 ready)
      SPECULATE(session, step, ..., upto) --->  (no reply)  grads [0, upto) are in the slot: the
                                                server may update them now, undo-logged (below)
      SKIP(session, step)               --->  OK        (overflow: state untouched)
      GET_MASTER(session, offset, count) ---> OK        (master[o:o+c] copied into staging)
      SAVE(session, dir) / LOAD(...)    --->  OK
      STATS(session)                    --->  STATS_OK(...)
      HEARTBEAT(session)                --->  HEARTBEAT_OK   (own socket, own thread)
      BYE(session)                      --->  OK        (segment unlinked, state freed)
    any request that fails              <---  ERROR(code, message)

The shared segment of one shard (offsets in HELLO_OK) is drawn in
optimizer_server.shm.ShardLayout.

Writers: the worker writes a gradient slot and the staging area before the
request that names them; the server writes weights16 (and staging on GET_MASTER)
before its reply.  The reply is the synchronisation, with one exception that
only ever lets the worker read earlier: during a STEP the server publishes
(step << 40) | n in the progress word after each block, meaning weights16[:n]
already holds this step's weights (release store after the block's writes; the
worker reads it with an acquire load).  INIT and LOAD reset it to 0.

Speculation: SPECULATE (one-way, never answered) carries the STEP the worker expects to
send, assuming no clipping and no overflow, and `upto`: the gradients of shard elements
[0, upto) are final in the slot.  The server may update them at once, saving first what
it overwrites in an undo log of HELLO.undo_log_bytes (optimizer_server.undo).  The STEP
that follows settles it: where its values equal the assumption over what was
speculated, that part is kept and only the rest is updated; otherwise the undo log is
restored first and the whole STEP runs.  Any other request that touches the state (SKIP,
GET_MASTER, SAVE, LOAD, INIT, BYE) restores it first.  DONE.speculated / rolled_back say
which happened; a SPECULATE the server cannot use is dropped and counted
(STATS_OK.speculate_dropped, last_drop_reason), since a hint has nobody to answer.
After a step's first SPECULATE the worker stores how far the gradients are final in the
ready word (HELLO_OK.ready_offset; drawn in ShardLayout) instead of sending a SPECULATE
per bucket, and the server follows it until the STEP.  RELEASE_TWIN: the worker will
not speculate again, so the shard frees its twin of the state and its undo log.

Long requests (INIT, LOAD, GET_MASTER, SAVE) run on the shard's update thread, so
heartbeats are answered throughout; HEARTBEAT_OK.work grows while they move data (a
client waits for as long as it grows).  SAVE.background answers once the save has
started (a snapshot of what later STEPs overwrite: ckpt_io.SaveJob), and STATS_OK.save_*
say how far it is.  SAVE.pieces / LOAD.pieces (with flat_numel, piece_map): an FSDP2
rank's server writes its rows straight into a checkpoint's shared one-rank file, and
reads them back out of any checkpoint.  STEP.reverse: the update runs back to front and
the progress word counts the elements done from the shard's end.

What each version changed, in order: docs/protocol.md ("Versions").
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 17
MAX_MESSAGE_BYTES = 64 * 1024          # a control message is never larger
MAX_NUMEL = (1 << 40) - 1              # one shard's length: the progress word's 40-bit count
DEFAULT_PROGRESS_BLOCK = 1 << 20       # elements per progress publication (2 MiB of 16-bit weights)
MIN_PROGRESS_BLOCK = 64                # a smaller one only multiplies a STEP's (and a SPECULATE's) pieces
DTYPES = ("fp16", "bf16")                  # the one list of 16-bit types (config, wire, server)
OPTIMIZERS = ("adamw", "adam", "adagrad", "lion")  # the one list of optimizers
STATE_DTYPES = ("fp32", "bf16", "int8")    # the one list of optimizer-state dtypes (optimizer_server.state)
COMPACT_OPTIMIZERS = ("adamw", "adam", "lion")  # the optimizers that take a state dtype other than fp32
QBLOCK = 256                           # elements per int8 block (one scale per moment); cython_ext agrees
MAX_PREDICT = 4.0                      # STEP.predict (and OffloadConfig.dpu_predict) lie in [0, MAX_PREDICT]
MAX_GRAD_SLOTS = 2
MAX_PIECES = 2048                      # SAVE/LOAD.pieces (piece_map.MAX_PIECES): 48 KiB of the message
MAX_GROUPS = 512                       # ranges in one STEP (each 8 numbers, <= 72 B: well inside the message)
GROUP_FIELDS = ("offset", "count", "lr", "beta1", "beta2", "eps", "weight_decay", "updates")
DEFAULT_STAGING_NUMEL = 1 << 24        # fp32 elements per INIT/GET_MASTER chunk (64 MiB)


class ProtocolError(ValueError):
    """A message that does not decode to one of the known types."""


# --------------------------------------------------------------------------- field checks

def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool))


_CHECKS = {
    int: (_is_int, "an int"),
    float: (_is_num, "a number"),
    str: (lambda x: isinstance(x, str), "a string"),
    bool: (lambda x: isinstance(x, bool), "a bool"),
    dict: (lambda x: isinstance(x, dict), "a map"),
    list: (lambda x: isinstance(x, list), "a list"),
    bytes: (lambda x: isinstance(x, bytes), "bytes"),
}


_TYPES = {t.__name__: t for t in _CHECKS}
_FIELD_CACHE: dict[type, tuple[str, ...]] = {}


def _fields(cls: type) -> tuple[str, ...]:
    names = _FIELD_CACHE.get(cls)
    if names is None:
        names = _FIELD_CACHE[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


@dataclass(kw_only=True)
class Message:
    TYPE: ClassVar[str] = ""

    def encode(self) -> bytes:
        # a flat field walk, not dataclasses.asdict (which deep-copies): this is
        # on the per-step path
        d = {"t": self.TYPE}
        for f in _fields(type(self)):
            d[f] = getattr(self, f)
        return msgpack.packb(d, use_bin_type=True)

    def validate(self) -> None:
        """Value checks beyond types; raise ProtocolError naming the field."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ProtocolError(msg)


@dataclass(kw_only=True)
class ShardSpec:
    """What a worker asks its shard to be: the one typed description that goes from the
    engine (which builds it from OffloadConfig) through ShardClient into HELLO, whose
    fields it is, to admission and the server's Shard, which read them there."""
    rank: int = 0
    world_size: int = 1
    numel: int
    dtype: str = "fp16"
    optimizer: str = "adamw"
    hparams: dict = field(default_factory=dict)  # lr, beta1, beta2, eps, weight_decay
    progress_block: int = 0  # elements per progress publication during a STEP (0: DEFAULT_PROGRESS_BLOCK)
    weights_slots: int = 1    # 2: two weights16 slots, STEP.weights_slot picks one (a CPU worker's zero-copy model)
    grad_slots: int = 1      # 2: a second gradient slot (DPU whose backward never waits for the update)
    staging_numel: int = 0   # fp32 elements of the staging window (0: DEFAULT_STAGING_NUMEL)
    state_dtype: str = "fp32"  # the moments' dtype on the server (STATE_DTYPES)
    exact_master: bool = False  # the fp32 master kept as the weights slot's bf16 + a 16-bit remainder
    frees_bytes: int = 0     # host bytes the worker lets go of once INIT is done (its fp32 copy of the model)
    undo_log_bytes: int = 0  # capacity of the shard's undo log for SPECULATE (0: no speculation)
    worker_peak_bytes: int = 0  # host bytes the worker itself takes at its peak (gradients, casts) beyond what it holds

    def spec_fields(self) -> dict:
        """The spec's own fields (a HELLO's, less version, token and pid), shallow."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(ShardSpec)}


@dataclass(kw_only=True)
class Hello(Message, ShardSpec):
    """A ShardSpec, and who sends it."""
    TYPE: ClassVar[str] = "HELLO"
    version: int
    token: str
    pid: int = 0

    def validate(self) -> None:
        _require(0 <= self.world_size - 1 < 1 << 20, f"world_size must be >= 1, got {self.world_size}")
        _require(0 <= self.rank < self.world_size, f"rank must be in [0, world_size), got {self.rank}")
        _require(0 <= self.numel <= MAX_NUMEL, f"numel must be in [0, {MAX_NUMEL}], got {self.numel}")
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.optimizer in OPTIMIZERS, f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        validate_hparams(self.hparams)
        _require(self.weights_slots in (1, 2), f"weights_slots must be 1 or 2, got {self.weights_slots}")
        _require(1 <= self.grad_slots <= MAX_GRAD_SLOTS, f"grad_slots must be 1 or 2, got {self.grad_slots}")
        _require(0 <= self.staging_numel <= MAX_NUMEL,
                 f"staging_numel must be in [0, {MAX_NUMEL}] (0: server default), got {self.staging_numel}")
        _require(self.progress_block == 0 or MIN_PROGRESS_BLOCK <= self.progress_block <= MAX_NUMEL,
                 f"progress_block must be 0 (server default) or in [{MIN_PROGRESS_BLOCK}, {MAX_NUMEL}], "
                 f"got {self.progress_block}")
        _require(0 <= self.frees_bytes < 1 << 62, f"frees_bytes must be >= 0, got {self.frees_bytes}")
        _require(0 <= self.undo_log_bytes < 1 << 62, f"undo_log_bytes must be >= 0, got {self.undo_log_bytes}")
        _require(0 <= self.worker_peak_bytes < 1 << 62,
                 f"worker_peak_bytes must be >= 0, got {self.worker_peak_bytes}")
        _require(self.state_dtype in STATE_DTYPES, f"state_dtype must be one of {STATE_DTYPES}, got {self.state_dtype!r}")
        _require(self.state_dtype == "fp32" or self.optimizer in COMPACT_OPTIMIZERS,
                 f"state_dtype {self.state_dtype!r} is implemented for {COMPACT_OPTIMIZERS}, not {self.optimizer!r}: "
                 f"use state_dtype='fp32'")
        _require(self.state_dtype != "int8" or self.world_size == 1 or self.numel % QBLOCK == 0,
                 f"state_dtype 'int8' with {self.world_size} ranks needs shards of a multiple of {QBLOCK} elements "
                 f"(its blocks must not straddle two ranks), got {self.numel}: pad the flat space to a multiple "
                 f"of world_size * {QBLOCK}")
        _require(not self.exact_master or (self.dtype == "bf16" and self.state_dtype != "fp32"),
                 "exact_master needs bf16 weights and a compact state_dtype (fp16 weights keep an fp32 master)")


HPARAM_KEYS = ("lr", "beta1", "beta2", "eps", "weight_decay")
MIN_EPS = 1.1754943508222875e-38


MAX_PATH = 4096


def _check_abs_dir(d: str) -> None:
    _require(0 < len(d) <= MAX_PATH and d.startswith("/") and "\0" not in d,
             f"a checkpoint directory must be an absolute path of at most {MAX_PATH} bytes, got {d[:100]!r}")


def _check_pieces(pieces: bytes, flat_numel: int) -> None:
    _require(0 <= flat_numel <= MAX_NUMEL, f"flat_numel must be in [0, {MAX_NUMEL}], got {flat_numel}")
    _require(len(pieces) % 24 == 0 and len(pieces) <= 24 * MAX_PIECES,
             f"pieces must be whole 24-byte pieces, at most {MAX_PIECES}; got {len(pieces)} bytes")
    _require(flat_numel > 0 or not pieces, "pieces without a flat_numel")


def _check_range(offset: int, count: int) -> None:
    _require(0 <= offset <= MAX_NUMEL and 0 <= count <= MAX_NUMEL,
             f"offset and count must be in [0, {MAX_NUMEL}], got {offset} and {count}")


def validate_hparams(h: dict) -> None:
    for k, v in h.items():
        _require(k in HPARAM_KEYS, f"unknown hyper-parameter {k!r}; known: {HPARAM_KEYS}")
        _require(_is_num(v) and math.isfinite(v), f"hyper-parameter {k} must be a finite number, got {v!r}")
    for k in ("beta1", "beta2"):
        if k in h:
            _require(0.0 <= h[k] < 1.0, f"{k} must be in [0, 1), got {h[k]}")
    if "eps" in h:
        # a denormal eps (1e-45) is 0 to a kernel that flushes denormals: a division by ~0
        _require(h["eps"] >= MIN_EPS, f"eps must be >= {MIN_EPS:.3g} (the smallest normal fp32), got {h['eps']}")
    for k in ("lr", "weight_decay"):
        if k in h:
            _require(h[k] >= 0, f"{k} must be >= 0, got {h[k]}")


@dataclass(kw_only=True)
class HelloOk(Message):
    TYPE: ClassVar[str] = "HELLO_OK"
    session: str
    segment: str
    segment_bytes: int
    numel: int
    grad_offsets: list
    weights_offsets: list  # one per weight slot
    staging_offset: int
    staging_numel: int     # INIT/GET_MASTER move at most this many fp32 elements each
    progress_offset: int
    ready_offset: int      # the worker's ready word (speculation)
    server_pid: int
    version: int = PROTOCOL_VERSION


@dataclass(kw_only=True)
class Init(Message):
    TYPE: ClassVar[str] = "INIT"
    session: str
    offset: int  # staging[:count] holds master[offset:offset + count]
    count: int

    def validate(self) -> None:
        _check_range(self.offset, self.count)


@dataclass(kw_only=True)
class Step(Message):
    TYPE: ClassVar[str] = "STEP"
    session: str
    step: int
    grad_slot: int        # the gradient slot holding this step's gradients (HELLO.grad_slots)
    lr: float
    grad_scale: float = 1.0
    hparams: dict = field(default_factory=dict)  # per-step overrides (schedules)
    predict: float = 0.0  # weights16 gets p + predict*(p - p_prev): DPU weight prediction (Adam only)
    weights_slot: int = 0     # which weights16 slot receives the new weights (HELLO.weights_slots = 2)
    # back to front, block by block; the progress word then counts elements done from the end:
    # weights16[numel - done:] is final (the next forward's first layers lie at the end)
    reverse: bool = False
    # ranges of the shard, in order, covering it, each GROUP_FIELDS: [offset, count, lr, beta1,
    # beta2, eps, weight_decay, updates] (a param group's range, or part of one); updates is the
    # range's own Adam step count, this update included (the bias correction's t; a parameter
    # skipped on some steps lags `step`), 0: no gradient this step, the range stays as it is.
    # Empty: the whole shard with lr and hparams above, at step `step`.
    groups: list = field(default_factory=list)

    def validate(self) -> None:
        _require(self.step >= 1, f"step must be >= 1, got {self.step}")
        _require(self.weights_slot in (0, 1), f"weights_slot must be 0 or 1, got {self.weights_slot}")
        _require(math.isfinite(self.predict) and 0.0 <= self.predict <= MAX_PREDICT,
                 f"predict must be in [0, {MAX_PREDICT:g}], got {self.predict}")
        _require(0 <= self.grad_slot < MAX_GRAD_SLOTS, f"grad_slot must be 0 or 1, got {self.grad_slot}")
        _require(math.isfinite(self.lr) and self.lr >= 0, f"lr must be finite and >= 0, got {self.lr}")
        _require(math.isfinite(self.grad_scale), f"grad_scale must be finite, got {self.grad_scale}")
        validate_hparams(self.hparams)
        _require(len(self.groups) <= MAX_GROUPS, f"at most {MAX_GROUPS} ranges, got {len(self.groups)}")
        end = 0
        for i, g in enumerate(self.groups):
            _require(isinstance(g, list) and len(g) == len(GROUP_FIELDS) and all(_is_num(x) for x in g),
                     f"groups[{i}] must be [{', '.join(GROUP_FIELDS)}], got {g!r}")
            off, count, updates = g[0], g[1], g[7]
            _require(_is_int(off) and _is_int(count) and off == end and count > 0,
                     f"groups[{i}] must start where the previous ended ({end}) and hold > 0 elements, got {g[:2]}")
            _require(_is_int(updates) and 0 <= updates <= self.step,
                     f"groups[{i}]'s updates must be an int in [0, step={self.step}], got {updates!r}")
            end = off + count
            validate_hparams(dict(zip(GROUP_FIELDS[2:7], g[2:7])))


@dataclass(kw_only=True)
class Speculate(Step):
    """One-way: the STEP the worker expects to send (its fields), and that the gradients
    of shard elements [0, upto) are final in gradient slot `grad_slot`.  Never answered (see the module
    docstring); each one repeats the whole assumption, so the server keeps no partial one.
    After the first of a step the worker says how far the gradients are final in the
    ready word instead (ShardLayout); a later SPECULATE still counts."""
    TYPE: ClassVar[str] = "SPECULATE"
    upto: int = 0

    def validate(self) -> None:
        super().validate()
        _require(0 <= self.upto <= MAX_NUMEL, f"upto must be in [0, {MAX_NUMEL}], got {self.upto}")


@dataclass(kw_only=True)
class Done(Message):
    TYPE: ClassVar[str] = "DONE"
    step: int
    update_s: float
    speculated: int = 0    # elements updated during backward (SPECULATE) and kept
    rolled_back: int = 0   # elements speculated, then restored from the undo log and redone


@dataclass(kw_only=True)
class Skip(Message):
    TYPE: ClassVar[str] = "SKIP"
    session: str
    step: int


@dataclass(kw_only=True)
class ReleaseTwin(Message):
    """The worker speculates no more: free the twin and the undo log (version 13)."""
    TYPE: ClassVar[str] = "RELEASE_TWIN"
    session: str


@dataclass(kw_only=True)
class GetMaster(Message):
    TYPE: ClassVar[str] = "GET_MASTER"
    session: str
    offset: int  # master[offset:offset + count] goes to staging[:count]
    count: int

    def validate(self) -> None:
        _check_range(self.offset, self.count)


@dataclass(kw_only=True)
class Save(Message):
    TYPE: ClassVar[str] = "SAVE"
    session: str
    dir: str                 # absolute: a relative path would be the server's cwd, not the worker's
    background: bool = False  # answer once started; STATS_OK.save_state says when it is done
    # flat_numel > 0: write into dir's shared one-rank file of that layout, where `pieces`
    # (piece_map.PieceMap bytes) put the shard's elements; no manifest, and the result's
    # crc (STATS_OK.save_crc) is the shard's masked CRC
    pieces: bytes = b""
    flat_numel: int = 0

    def validate(self) -> None:
        _check_abs_dir(self.dir)
        _check_pieces(self.pieces, self.flat_numel)


@dataclass(kw_only=True)
class Load(Message):
    TYPE: ClassVar[str] = "LOAD"
    session: str
    dir: str
    weights_slot: int = 0  # the weights slot that gets the loaded weights (the exact master's high halves)
    pieces: bytes = b""    # flat_numel > 0: the shard's elements lie there in the flat space (SAVE.pieces)
    flat_numel: int = 0
    verified: bool = False  # the worker checked the files' checksums (FSDP2's ranks together): read only

    def validate(self) -> None:
        _require(0 <= self.weights_slot < 2, f"weights_slot must be 0 or 1, got {self.weights_slot}")
        _check_abs_dir(self.dir)
        _check_pieces(self.pieces, self.flat_numel)


@dataclass(kw_only=True)
class Stats(Message):
    TYPE: ClassVar[str] = "STATS"
    session: str


@dataclass(kw_only=True)
class StatsOk(Message):
    TYPE: ClassVar[str] = "STATS_OK"
    updates: int          # updates done (STEPs; SKIPs are `skipped`)
    skipped: int
    last_update_s: float
    mean_update_s: float
    bytes_read: int
    bytes_written: int
    threads: int
    simd: str
    speculate_dropped: int = 0  # SPECULATE messages the server could not use (a hint is not answered)
    last_drop_reason: str = ""
    speculated: int = 0         # elements of the coming step already updated by speculation (its pieces so far)
    save_state: str = "idle"    # the newest SAVE: idle, writing, done or failed
    save_bytes_done: int = 0
    save_bytes_total: int = 0
    save_error: str = ""        # why it failed (the previous checkpoint stays current)
    save_seconds: float = 0.0   # how long it ran (so far)
    save_waited_s: float = 0.0  # how long updates waited for it (what it cost training)
    save_snapshot: bool = False  # the updates during it copy what they overwrite (else they write it first)
    save_snapshot_peak: int = 0  # host bytes its snapshot held at most
    save_update_writes: int = 0  # chunks the updates wrote to the file themselves (no snapshot)
    state_dtype: str = ""       # what the shard keeps master and moments in (HELLO.state_dtype)
    state_bytes: int = 0        # the host bytes its master (the exact one's remainder) and moments hold
    save_crc: int = -1          # a done SAVE with pieces: the shard's masked CRC (ckpt_io.combine_disjoint)


@dataclass(kw_only=True)
class Heartbeat(Message):
    TYPE: ClassVar[str] = "HEARTBEAT"
    session: str


@dataclass(kw_only=True)
class HeartbeatOk(Message):
    TYPE: ClassVar[str] = "HEARTBEAT_OK"
    server_pid: int
    work: int = 0  # grows while the shard's long requests move data (Shard.work_done)
    save_state: str = "idle"  # the newest SAVE's state (STATS_OK.save_state), for a client with a STEP in flight
    save_error: str = ""
    save_seq: int = 0         # which SAVE that is (its OK's info["seq"]): a late heartbeat tells of an older one
    save_crc: int = -1        # STATS_OK.save_crc, for a client with a STEP in flight (a placed save's publish)


@dataclass(kw_only=True)
class Bye(Message):
    TYPE: ClassVar[str] = "BYE"
    session: str


@dataclass(kw_only=True)
class Ok(Message):
    TYPE: ClassVar[str] = "OK"
    info: dict = field(default_factory=dict)


# Error codes: what kind of failure, so a client can decide without parsing text.
E_DECODE = "decode"          # not a message: bad bytes, wrong shape, unknown type/field
E_INVALID = "invalid"        # a well-formed request that does not fit this session (a slot it lacks, ...)
E_VERSION = "version"        # protocol version mismatch
E_AUTH = "auth"              # wrong or missing token
E_SESSION = "session"        # unknown session
E_ORDER = "order"            # out-of-order step, busy shard
E_RESOURCE = "resource"      # not enough RAM / shm
E_CHECKPOINT = "checkpoint"  # save/load failed or layout mismatch
E_INTERNAL = "internal"      # a bug on the server, answered rather than crashed on
# Raised on the worker's side only, never sent: the server process is gone, or a request
# made no progress within its bound.  In the same set, so OptimizerServerError.code is
# always one of these.
E_DEAD = "dead"
E_TIMEOUT = "timeout"
# The closed set: an ERROR with any other code is not a message of this protocol.
ERROR_CODES = frozenset({E_DECODE, E_INVALID, E_VERSION, E_AUTH, E_SESSION, E_ORDER, E_RESOURCE, E_CHECKPOINT,
                         E_INTERNAL, E_DEAD, E_TIMEOUT})


@dataclass(kw_only=True)
class Error(Message):
    TYPE: ClassVar[str] = "ERROR"
    code: str
    message: str

    def validate(self) -> None:
        _require(self.code in ERROR_CODES, f"unknown error code {self.code!r}; known: {sorted(ERROR_CODES)}")


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls for cls in (Hello, HelloOk, Init, Step, Speculate, Done, Skip, ReleaseTwin, GetMaster, Save,
                              Load, Stats, StatsOk, Heartbeat, HeartbeatOk, Bye, Ok, Error)
}


_SPECS: dict[type, dict[str, tuple[type, bool]]] = {}


def _spec(cls: type) -> dict[str, tuple[type, bool]]:
    """name -> (type, required) of a message class, computed once (decode is on the per-step path)."""
    spec = _SPECS.get(cls)
    if spec is None:
        spec = _SPECS[cls] = {
            f.name: (_TYPES[f.type] if isinstance(f.type, str) else f.type,  # annotations are strings
                     f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)}
    return spec


def decode(data: bytes) -> Message:
    """Decode one frame into its message, or raise ProtocolError saying why."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"a message is bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message is a msgpack map, got {type(obj).__name__}")
    t = obj.pop("t", None)
    cls = MESSAGE_TYPES.get(t) if isinstance(t, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {t!r}; known: {sorted(MESSAGE_TYPES)}")
    spec = _spec(cls)
    if not obj.keys() <= spec.keys():
        raise ProtocolError(f"{t}: unknown field(s) {sorted(set(map(str, obj)) - set(spec))}")
    for name, (typ, required) in spec.items():
        if name not in obj:
            if required:
                raise ProtocolError(f"{t}: missing field {name!r}")
            continue
        check, what = _CHECKS[typ]
        if not check(obj[name]):
            raise ProtocolError(f"{t}: field {name!r} must be {what}, got {type(obj[name]).__name__}")
        if typ is float:
            obj[name] = float(obj[name])
    msg = cls(**obj)
    msg.validate()
    return msg


def error(code: str, message: str) -> bytes:
    msg = Error(code=code, message=message)
    msg.validate()  # the closed set: a ProtocolError (a ValueError) for any other code
    return msg.encode()
