"""OffloadTrainer: transformers.Trainer with the optimizer offloaded (needs transformers).

    from zero_offload.hf import OffloadTrainer
    trainer = OffloadTrainer(model=model, args=TrainingArguments(..., bf16=True),
                             train_dataset=ds, offload={"mode": "dpu", "server": {"threads": 8}})
    trainer.train()          # or train(resume_from_checkpoint=True)

It builds an OffloadAdamW from the TrainingArguments as Trainer builds
torch.optim.AdamW: learning_rate, weight_decay with Trainer's own no-decay groups
(get_decay_parameter_names: biases and norm weights), adam_beta1/2, adam_epsilon,
gradient_accumulation_steps; lr_scheduler_type and warmup are Trainer's own
scheduler on it.  max_grad_norm clips in the CPU update, and the logged grad_norm
is the true global norm.  Checkpoints (save_steps) hold master, m and v as an
engine checkpoint in checkpoint-N/zero_offload/ (loadable at any world size), so
resume_from_checkpoint goes on bitwise.  A plain Trainer's checkpoint (optimizer.pt,
torch AdamW's state) resumes too: its m, v and step counts go on offloaded, on the
fp32 weights Trainer loads into the model (runtime.torch_state).

`offload`: OffloadAdamW's offload options (an OffloadConfig's fields as a dict, or
an OffloadConfig): dtype (bf16, the default; the weights are 16-bit whatever
args.bf16 says, and args.fp16 is refused: it needs loss scaling a plain backward
does not do), mode, server, ...

TrainingArguments.optim picks the optimizer and its state as Trainer would: the
AdamW names (adamw_torch, adamw_torch_fused, paged_adamw_32bit, ...) OffloadAdamW
with fp32 state (the default), the 8-bit ones (adamw_8bit, adamw_bnb_8bit,
paged_adamw_8bit, adamw_torch_8bit) with state_dtype="int8" (block-wise 8-bit
moments, as bitsandbytes and torchao keep them); lion_32bit and paged_lion_32bit
OffloadLion, lion_8bit and paged_lion_8bit OffloadLion with int8 state (betas
from adam_beta1/2, as Trainer gives bitsandbytes' Lion).  offload={"state_dtype":
...} may choose any state dtype for a 32-bit name and must agree with an 8-bit
one.  Any other optim (Adagrad, Adafactor, SGD, ...) is refused before training.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import warnings

import torch
from transformers import Trainer

from zero_offload.server.checkpoint import has_checkpoint

from . import accelerate_prep, compute_dtype, fsdp2
from .config import OffloadConfig
from .devices import resolve_device
from .offload_adamw import OffloadAdamW
from .offload_lion import OffloadLion

log = logging.getLogger(__name__)
CHECKPOINT_SUBDIR = "zero_offload"   # checkpoint-N/zero_offload: the engine's checkpoint
# TrainingArguments.optim values offloaded: the optimizer class and the state dtype each
# implies (None: offload's state_dtype, fp32 by default)
OPTIMS = {**{name: (OffloadAdamW, None) for name in (
              "adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused", "adamw_apex_fused",
              "adamw_anyprecision", "adamw_hf", "paged_adamw_32bit")},
          **{name: (OffloadAdamW, "int8") for name in (
              "adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "adamw_torch_8bit")},
          "lion_32bit": (OffloadLion, None), "paged_lion_32bit": (OffloadLion, None),
          "lion_8bit": (OffloadLion, "int8"), "paged_lion_8bit": (OffloadLion, "int8")}
SCHEDULER_FILE = "scheduler.pt"     # Trainer's own name for the scheduler's state
TORCH_OPTIMIZER_FILE = "optimizer.pt"  # Trainer's own name for a torch optimizer's state_dict()


class OffloadTrainer(Trainer):
    def __init__(self, *args, offload: OffloadConfig | dict | None = None, **kwargs):
        if isinstance(offload, OffloadConfig):
            offload = {f.name: getattr(offload, f.name) for f in dataclasses.fields(offload)}
        elif offload is not None and not isinstance(offload, dict):
            raise TypeError(f"offload must be a dict of OffloadConfig fields or an OffloadConfig, got "
                            f"{type(offload).__name__}")
        self.offload_options = dict(offload or {})
        for k in ("lr", "betas", "eps", "weight_decay", "optimizer", "grad_accumulation_steps", "clip_grad_norm"):
            if k in self.offload_options:
                raise ValueError(f"offload[{k!r}] comes from TrainingArguments (learning_rate, adam_beta1/2, "
                                 f"adam_epsilon, weight_decay, gradient_accumulation_steps, max_grad_norm); "
                                 f"set it there")
        super().__init__(*args, **kwargs)
        self._optimizer_from_optim()
        # before anything wraps the model (evaluate() before train() does too)
        self._compute_dtype = self._expected_compute_dtype()
        self._autocast_off_under_fp32_compute()
        self._no_ddp()
        if self.args.fp16:
            raise ValueError("OffloadTrainer does not train with fp16=True (loss scaling through a plain backward "
                             "is not supported): use bf16=True, or the engine API (OffloadEngine) for fp16")

    def _optimizer_from_optim(self) -> None:
        """TrainingArguments.optim as an optimizer class and a state dtype (module
        docstring), or a ValueError before anything trains."""
        optim = getattr(self.args.optim, "value", self.args.optim)
        if optim not in OPTIMS:
            raise ValueError(f"OffloadTrainer offloads AdamW and Lion, not optim={optim!r}: use one of "
                             f"{', '.join(sorted(OPTIMS))} (for less host RAM, an 8-bit one or "
                             f"offload={{'state_dtype': 'bf16'}})")
        self.offload_optimizer_cls, want = OPTIMS[optim]
        have = self.offload_options.get("state_dtype")
        if want is not None and have not in (None, want):
            raise ValueError(f"optim={optim!r} keeps 8-bit moments (state_dtype={want!r}) but offload asks for "
                             f"state_dtype={have!r}: drop one of them")
        if want is not None:
            self.offload_options["state_dtype"] = want

    def create_optimizer(self, model=None):
        """OffloadAdamW or OffloadLion (optim) with Trainer's groups and hyper-parameters (module docstring)."""
        opt_model = self.model if model is None else model
        if self.optimizer is None:
            decay = set(self.get_decay_parameter_names(opt_model))
            named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                      {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
            groups = [g for g in groups if g["params"]]
            opts = self._engine_options()
            hp = dict(lr=self.args.learning_rate, betas=(self.args.adam_beta1, self.args.adam_beta2),
                      weight_decay=self.args.weight_decay)
            if self.offload_optimizer_cls is OffloadAdamW:
                hp["eps"] = self.args.adam_epsilon
            self.optimizer = self.offload_optimizer_cls(groups, **hp, model=opt_model,
                                                grad_accumulation_steps=self.args.gradient_accumulation_steps, **opts)
            eng = getattr(self.optimizer, "engine", None)
            if eng is not None:  # the engine's own answer (the same one, from the same inputs)
                self._compute_dtype = eng.compute_dtype
                self._autocast_off_under_fp32_compute()
        return self.optimizer

    def _engine_options(self) -> dict:
        """The offload options the engine is built with: bf16 weights unless they say."""
        return {"dtype": "bf16", **self.offload_options}

    def _expected_compute_dtype(self) -> torch.dtype | None:
        """The compute dtype the engine will pick (runtime.compute_dtype), from the offload
        options and the device Trainer put the model on, before the engine exists."""
        try:
            with warnings.catch_warnings():  # the engine warns of deprecated names itself
                warnings.simplefilter("ignore", DeprecationWarning)
                cfg = OffloadConfig(**self._engine_options())
        except (TypeError, ValueError):
            return None  # the engine's own error comes when it is built
        param = next(self.model.parameters(), None)
        if param is None:
            return None
        device = resolve_device(cfg.device, param.device)
        return compute_dtype.resolve(cfg.expert.compute_dtype, cfg.dtype, device)[0]

    def _fp32_compute(self) -> bool:
        return getattr(self, "_compute_dtype", None) == torch.float32

    def _autocast_off_under_fp32_compute(self) -> None:
        """bf16=True makes Accelerate run the model's forward under torch.autocast(bf16),
        which on a CPU computing in fp32 (runtime.compute_dtype: no native 16-bit matmul)
        would put every matmul back on the emulated bf16 path the fp32 compute is there
        to avoid (~75x slower than fp32 there).  The weights hold bf16 values either way;
        so autocast is turned off for this trainer's model, whichever of train() and
        evaluate() wraps it first."""
        if not self._fp32_compute():
            return
        from accelerate.utils import AutocastKwargs
        self.accelerator.autocast_handler = AutocastKwargs(enabled=False)

    def _no_ddp(self) -> None:
        """With several processes (torchrun, accelerate launch) Accelerate's prepare(model)
        wraps the model in DistributedDataParallel, which would all-reduce the gradients
        the engine reduces itself (each rank sends its shard down: ZeRO-2), and its device
        placement copies every parameter with several CPU processes (Accelerate's device
        is cpu:0, and tensor.to("cpu:0") of a "cpu" tensor is a copy), so the engine's
        16-bit weights would no longer reach the model (the engine refuses that at the
        first backward).  So this trainer's accelerator prepares models as transformers
        prepares one that owns its placement and gradient reduction: autocast (and
        torch.compile) only, Trainer having put the model on its device.  Where Accelerate
        would not use DDP (FSDP, DeepSpeed) its preparation is left as it is."""
        acc = self.accelerator
        if not accelerate_prep.would_wrap_in_ddp(acc):
            return  # FSDP, DeepSpeed, XLA: Accelerate's own wrapping, as before
        prepare_model = acc.prepare_model

        def prepare_model_without_ddp(model, device_placement=None, evaluation_mode=False):
            return prepare_model(model, device_placement=False, evaluation_mode=True)
        acc.prepare_model = prepare_model_without_ddp

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
        # transformers releases that autocast here themselves (CPU AMP): not under fp32 compute
        if self._fp32_compute():
            return contextlib.nullcontext()
        return super().autocast_smart_context_manager(cache_enabled=cache_enabled)

    @property
    def offload_optimizer(self) -> OffloadAdamW:
        """The OffloadAdamW (or OffloadLion, its subclass) under Accelerate's wrapper."""
        opt = self.optimizer
        while not isinstance(opt, OffloadAdamW) and hasattr(opt, "optimizer"):
            opt = opt.optimizer
        if not isinstance(opt, OffloadAdamW):
            raise RuntimeError("OffloadTrainer's optimizer is not an OffloadAdamW: do not pass optimizers= to it "
                               "(use transformers.Trainer for another optimizer)")
        return opt

    def _clip_grad_norm(self, model):
        # the parameters hold no .grad (they went to the host): the engine has the norm
        return self.offload_optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A model FSDP2 shards (the library's wrapping with several processes, or the
        user's fully_shard) holds each rank's rows: Trainer's own save would read them on
        rank 0 alone, a collective for the others' (a hang).  Here every rank takes part
        in gathering the whole state dict (fsdp2.full_state_dict, on rank 0 only) and
        rank 0 writes it as Trainer would: a checkpoint's model files read as a plain
        run's (from_pretrained, or a resume on any number of processes)."""
        if self.args.world_size <= 1 or not fsdp2.is_sharded(self.model):
            return super().save_model(output_dir, _internal_call)
        state_dict = fsdp2.full_state_dict(self.model)
        if self.args.should_save:
            self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _load_best_model(self) -> None:
        """load_best_model_at_end with a model FSDP2 shards: Trainer's own load copies whole
        tensors into the sharded parameters, which fails.  Here the optimizer is closed
        first (its close lands the last update into the local shards, which would
        otherwise overwrite what is loaded next), then every rank reads the best
        checkpoint's weights and takes its rows of each (fsdp2.load_full_state_dict)."""
        if self.args.world_size <= 1 or not fsdp2.is_sharded(self.model):
            return super()._load_best_model()
        import safetensors.torch
        d = self.state.best_model_checkpoint
        files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"load_best_model_at_end: {d} holds no .safetensors weights (a model FSDP2 shards "
                             f"loads from those): save with save_safetensors=True")
        if self.optimizer is not None:
            self.offload_optimizer.close()
        full = {}
        for f in files:
            full.update(safetensors.torch.load_file(os.path.join(d, f)))
        log.info("Loading best model from %s (score: %s).", d, self.state.best_metric)
        fsdp2.load_full_state_dict(self.model, full)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # every rank writes its shard (a collective), in the background: training goes on
        # while the server writes, and the next step (or the end of train()) publishes it.
        # With save_total_limit Trainer deletes older checkpoints as soon as this returns,
        # so the save is blocking then: were the process killed before a background save
        # is published, no checkpoint would hold a whole optimizer state.  The scheduler as
        # Trainer does.
        background = not (self.args.save_total_limit and self.args.save_total_limit > 0)
        self.offload_optimizer.save_checkpoint(os.path.join(output_dir, CHECKPOINT_SUBDIR), keep=1,
                                               background=background)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        d = os.path.join(checkpoint, CHECKPOINT_SUBDIR)
        torch_file = os.path.join(checkpoint, TORCH_OPTIMIZER_FILE)
        if os.path.isdir(d):
            self.offload_optimizer.load_checkpoint(d)
        elif os.path.isfile(torch_file):
            # a plain Trainer's checkpoint (torch AdamW): its m, v and step counts, on the
            # fp32 weights Trainer has just loaded into the model (runtime.torch_state)
            # (through a temporary checkpoint in output_dir: every rank sees it, and it has room for one)
            sd = torch.load(torch_file, map_location="cpu", weights_only=True)
            self.offload_optimizer._load_torch_state(sd, self.args.output_dir)
        else:
            raise ValueError(f"{checkpoint} has neither {CHECKPOINT_SUBDIR}/ (master, m and v) nor "
                             f"{TORCH_OPTIMIZER_FILE}: resume from a checkpoint Trainer or OffloadTrainer saved, "
                             f"or start from the model's weights")
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_FILE), weights_only=True))

    def _last_whole_checkpoint(self) -> str:
        """resume_from_checkpoint=True: the newest checkpoint-N in output_dir whose
        optimizer state is whole (zero_offload/ published, or a plain Trainer's
        optimizer.pt), where Trainer would take the newest by name.  A background save
        is published at the step after it (or at the end of train()), so a process killed
        in between leaves checkpoint-N without one: the one before it is taken, and
        the run redoes those steps."""
        from transformers.trainer import TRAINER_STATE_NAME
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
        root = self.args.output_dir
        found = []
        for name in os.listdir(root) if os.path.isdir(root) else ():
            m = re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", name)
            if m and os.path.isdir(os.path.join(root, name)):
                found.append((int(m.group(1)), name))
        skipped = []
        for _, name in sorted(found, reverse=True):
            ck = os.path.join(root, name)
            whole = (has_checkpoint(os.path.join(ck, CHECKPOINT_SUBDIR))
                     or os.path.isfile(os.path.join(ck, TORCH_OPTIMIZER_FILE)))
            if whole and os.path.isfile(os.path.join(ck, TRAINER_STATE_NAME)):
                if skipped:
                    log.warning("resume_from_checkpoint=True: %s hold no whole optimizer state (the run stopped "
                                "before their background save was published); resuming from %s",
                                ", ".join(skipped), name)
                return ck
            skipped.append(name)
        raise ValueError(f"resume_from_checkpoint=True but no checkpoint in {root} holds a whole optimizer state"
                         f"{' (' + ', '.join(skipped) + ' do not)' if skipped else ''}: start without "
                         f"resume_from_checkpoint, or pass a checkpoint's path")

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._last_whole_checkpoint()
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            # land the last update on the model (DPU) and stop the server, as close() does;
            # a later train() call builds a new optimizer from the trained weights
            if self.optimizer is not None:
                self.offload_optimizer.close()
                self.optimizer = None
                self.lr_scheduler = None
