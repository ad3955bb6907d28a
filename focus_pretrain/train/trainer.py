"""``Trainer``: a recipe's run, from process groups to the last checkpoint.

The constructor builds the run in order: parallel layout -> data -> model (build -> context
parallelism -> HuggingFace initialisation -> freezing) -> optimizer and DeepSpeed -> resume.
:meth:`Trainer.train_step` is one optimizer step, :meth:`Trainer.train` the loop. The
components own their cadence: :class:`~focus_pretrain.checkpoint.save.Checkpointer`
(interval, keep-last-N, atomic ``latest``), :class:`~focus_pretrain.train.validate.Validator`
(validation and the recall metric), :class:`~focus_pretrain.train.stop.StopSignal` (a stop all
ranks agree on), :class:`~focus_pretrain.train.metrics.MetricsLogger` (console, TensorBoard,
``metrics.jsonl``). :func:`pretrain` is the one-call entry that ``launchers/pretrain.py`` runs
under ``deepspeed``, ``torchrun``, ``srun`` or plain ``python``.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

import deepspeed
import numpy as np
import torch
import torch.distributed as dist

from focus_pretrain.checkpoint.layout import run_layout
from focus_pretrain.checkpoint.save import Checkpointer, latest_checkpoint
from focus_pretrain.config import Config, save_config
from focus_pretrain.convert import load_hf_weights
from focus_pretrain.convert.hf_import import check_hf_source
from focus_pretrain.data.coordinate import prepare_data_in_job
from focus_pretrain.data.datasets import ResumableSampler, build_datasets
from focus_pretrain.data.tokenizer import Tokenizer
from focus_pretrain.errors import InputError, as_input_error
from focus_pretrain.focus import FocusRouter
from focus_pretrain.model import build_model
from focus_pretrain.model.attention import FocusSelfAttention
from focus_pretrain.parallel.context_parallel import apply_context_parallel
from focus_pretrain.parallel.launch import ParallelLayout
from focus_pretrain.parallel.mpu import MegatronMPU
from focus_pretrain.parallel.sequence_parallel import reduce_sequence_parallel_grads
from focus_pretrain.storage.checkpoint_files import read_latest
from focus_pretrain.storage.files import RunLock
from focus_pretrain.train.announce import announce_end, announce_start
from focus_pretrain.train.bad_steps import BadStepPolicy, GradientWatch, TooManyBadSteps, skippable
from focus_pretrain.train.exit_status import write_exit_status
from focus_pretrain.train.focus_stats import (
    attention_density,
    discard_balance,
    max_group_share,
    ring_skipped_share,
    set_training_pattern,
    update_balance,
)
from focus_pretrain.train.loss import Objective, batch_to, group_mean, micro_batch_loss
from focus_pretrain.train.metrics import (
    IntervalMeter,
    MetricsLogger,
    flops_per_sample,
    peak_memory_gb,
    peak_tflops,
    step_flops_per_sample,
    wandb_run,
)
from focus_pretrain.train.optim import (
    PhaseGate,
    apply_freeze_policy,
    build_optimizer,
    deepspeed_config,
    lr_lambda,
    parameter_groups,
)
from focus_pretrain.train.resume import check_resume, check_run_config
from focus_pretrain.train.stop import StopSignal
from focus_pretrain.train.validate import Validator, validation_samples


class Trainer:
    """Trains ``config``; resumes from ``run.output_dir/checkpoints`` when it holds one.

    Attributes:
        config: the resolved recipe.
        layout: the process grid (:class:`~focus_pretrain.parallel.launch.ParallelLayout`).
        engine, optimizer: DeepSpeed's engine around the Megatron model, and its optimizer.
        step, consumed_samples: optimizer steps done and samples drawn (the resume point).
        checkpointer, validator, logger, stop, bad_steps: the run's components.
    """

    def __init__(self, config: Config) -> None:
        if config.train.precision == "fp16" and not torch.cuda.is_available():
            raise InputError(
                "train.precision=fp16 needs a GPU (DeepSpeed's CPU accelerator has no fp16 "
                "support); use bf16 or fp32 on CPU"
            )
        self.config = config
        self.layout = ParallelLayout.initialize(config.parallel, config.run.seed)
        self.output_dir = Path(config.run.output_dir)
        self.run_lock = RunLock(self.output_dir)
        self._claim_output_dir()  # one run per directory; its checkpoints resumable
        try:
            self._build(config)
        except BaseException:
            self.close(discard_if_unused=True)  # refused before it wrote: no empty run dir
            raise

    def _build(self, config: Config) -> None:
        """Everything after the output directory is claimed (see the class docstring)."""
        self.grad_accum = self._gradient_accumulation()
        # before anything is built or written: a resume with another model or data order
        # is refused, naming the keys (train.allow_changes continues anyway)
        # ... and one at another parallel layout unless train.load_universal (resharding)
        self.run_layout = run_layout(self.layout, config.parallel)
        self.recipe_changes = check_resume(
            latest_checkpoint(self.output_dir / "checkpoints"),
            config,
            self.run_layout,
        )
        self.device = torch.device("cpu")
        if torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.tokenizer, self.train_set, valid_set = self._build_data()
        self.validator = Validator(config, valid_set, self.tokenizer, self.layout, self.device)
        self.model, self.counts, self.ring_stats = self._build_model()
        self.routers = [m for m in self.model.modules() if isinstance(m, FocusRouter)]
        self.focus_layers = [m for m in self.model.modules() if isinstance(m, FocusSelfAttention)]
        self.engine, self.optimizer, self.gate = self._build_engine()
        if self.layout.is_main:  # the inputs checked: the run's own record of its recipe
            path = save_config(config, self.output_dir / "config.yaml")
            print(f"focus-pretrain: resolved config ({path}):\n{path.read_text()}", flush=True)
        self.schedule = lr_lambda(config.train)
        self.objective = Objective.from_config(config.train)  # lm, or distillation (retrofits)
        self.checkpointer = Checkpointer(
            self.output_dir / "checkpoints",
            self.engine,
            config,
            self.state_dict,
            self.run_layout,
            tokenizer=self.tokenizer.path,
        )
        state = self.checkpointer.load()
        self.resumed_step = None if state is None else state["step"]
        self.load_state_dict(state or {"step": 0, "consumed_samples": 0})
        self.logger = MetricsLogger(
            self.output_dir,
            self.layout.is_main,
            config.train.tensorboard,
            wandb_run(config, self.output_dir) if self.layout.is_main else None,
        )
        self.stop = StopSignal()
        self.last_train_loss: float | None = None

    # -- building -----------------------------------------------------------------------------
    def _claim_output_dir(self) -> None:
        """Rank 0 takes the run directory's lock (a second run there is refused, naming the
        holder) and validates its checkpoints' ``latest`` (never a silent restart over
        checkpoints); every rank raises the same one-line error when either fails."""
        refusal = None
        if self.layout.is_main:
            try:
                self.run_lock.acquire()
                read_latest(self.output_dir / "checkpoints")
                check_run_config(self.output_dir / "config.yaml")
            except InputError as err:
                refusal = err
        if dist.is_initialized() and self.layout.world_size > 1:
            shared = [None if refusal is None else (type(refusal), str(refusal))]
            dist.broadcast_object_list(shared, src=0)
            if shared[0] is not None and refusal is None:
                refusal = shared[0][0](shared[0][1])
        if refusal is not None:
            self.close(discard_if_unused=True)
            raise refusal

    def close(self, discard_if_unused: bool = False) -> None:
        """Release the run directory (its lock); idempotent. ``discard_if_unused``: a run
        directory this run made and wrote nothing into is removed with its lock file."""
        self.run_lock.release(discard_if_unused)

    def _gradient_accumulation(self) -> int:
        train = self.config.train
        per_step = train.micro_batch_size * self.layout.data_parallel_size
        if train.global_batch_size % per_step:
            raise ValueError(
                f"train.global_batch_size ({train.global_batch_size}) must be a "
                f"multiple of train.micro_batch_size x data-parallel size ({per_step})"
            )
        return train.global_batch_size // per_step

    def _build_data(self) -> tuple[Tokenizer, Any, Any]:
        """Token files prepared once (rank 0), then every rank's train and valid splits."""
        config, train = self.config, self.config.train
        if train.init_from_hf:  # before any data work: the checkpoint's architecture, tokens
            as_input_error(lambda: check_hf_source(train.init_from_hf, config))
        tokenizer_path, prefixes = prepare_data_in_job(config.data, config.run.seed)
        tokenizer = Tokenizer(tokenizer_path)
        if tokenizer.vocab_size > config.model.vocab_size:
            fix = (  # a retrofit's embeddings are the checkpoint's: the tokenizer is wrong
                f"data.tokenizer ({config.data.tokenizer}) is not the tokenizer of "
                f"{train.init_from_hf}; set data.tokenizer to the checkpoint's"
                if train.init_from_hf
                else "raise model.vocab_size"
            )
            raise InputError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but "
                f"model.vocab_size is {config.model.vocab_size}; {fix}"
            )
        per_step = train.micro_batch_size * self.layout.data_parallel_size
        train_set, valid_set = build_datasets(
            config.data,
            tokenizer,
            prefixes,
            train.steps * train.global_batch_size,
            validation_samples(train, per_step),
            config.run.seed,
        )
        return tokenizer, train_set, valid_set

    def _build_model(self):
        """The Megatron model with context parallelism installed, HuggingFace weights on a
        fresh retrofit run, and the freezing policy applied; its parameter counts."""
        config = self.config
        model = build_model(config.model, sequence_parallel=config.parallel.sequence_parallel)
        reduce_sequence_parallel_grads(model)  # DeepSpeed does not sum them over TP
        ring_stats = None
        cp_group = self.layout.context_parallel_group
        if cp_group is not None:
            ring_stats = apply_context_parallel(model, cp_group, config.parallel.cp_mode)
        hf_tensors = None
        fresh = read_latest(self.output_dir / "checkpoints") is None
        if config.train.init_from_hf and fresh:
            hf_tensors = load_hf_weights(model, config.train.init_from_hf, config.model)
            if self.layout.is_main:
                print(
                    f"focus-pretrain: initialised {hf_tensors} tensors from the HuggingFace "
                    f"checkpoint {config.train.init_from_hf} (routers: fresh)",
                    flush=True,
                )
        counts = apply_freeze_policy(model, config.train)
        counts["hf_tensors"] = hf_tensors
        return model, counts, ring_stats

    def _build_engine(self):
        """AdamW groups, DeepSpeed (ZeRO over data x context-parallel ranks, Megatron's groups
        as ``mpu``) and the two-phase gate."""
        config = self.config
        groups = parameter_groups(self.model, config.train)
        # counted before ZeRO-3 partitions the parameters (their numel is 0 afterwards)
        self.counts["optimized"] = sum(p.numel() for g in groups for p in g["params"])
        optimizer = build_optimizer(groups, config.train, config.parallel.cpu_offload)
        gate = PhaseGate(self.model) if config.train.freeze == "two_phase" else None
        # a bad step (non-finite loss or gradient) is skipped: train/bad_steps.py
        self.step_switch = skippable(optimizer)
        watch = None
        if config.train.precision != "fp16":  # fp16: DeepSpeed's loss scaler owns overflows
            watch = GradientWatch(self.model.parameters(), self.device)
        self.bad_steps = BadStepPolicy(config.train.max_consecutive_bad_steps, watch)
        engine, optimizer, _, _ = deepspeed.initialize(
            model=self.model,
            optimizer=optimizer,
            config=deepspeed_config(config, self.grad_accum),
            mpu=MegatronMPU(),
        )
        return engine, optimizer, gate

    def _train_loader(self):
        sampler = ResumableSampler(
            len(self.train_set),
            self.consumed_samples,
            self.config.train.micro_batch_size,
            self.layout.data_parallel_rank,
            self.layout.data_parallel_size,
        )
        return iter(torch.utils.data.DataLoader(self.train_set, batch_sampler=sampler))

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs besides the engine: step, consumed samples, RNG states."""
        generator, keys, *numbers = np.random.get_state()  # keys: a uint32 array
        return {
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "skipped_steps": self.bad_steps.skipped,
            "rng": {
                "python": random.getstate(),
                "numpy": [generator, keys.tolist(), *numbers],  # plain data: no numpy global
                "torch": torch.get_rng_state(),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (:meth:`state_dict`): the data stream resumes exactly."""
        self.step, self.consumed_samples = state["step"], state["consumed_samples"]
        self.bad_steps.skipped = state.get("skipped_steps", 0)  # counted over resumes
        if "rng" in state:
            random.setstate(state["rng"]["python"])
            generator, keys, *numbers = state["rng"]["numpy"]  # numpy's tuple in older files
            np.random.set_state((generator, np.asarray(keys, dtype=np.uint32), *numbers))
            torch.set_rng_state(state["rng"]["torch"])
        if self.gate is not None and self.step >= self.config.train.router_only_steps:
            self.gate.open()
        self.loader = self._train_loader()

    # -- training -----------------------------------------------------------------------------

    def train_step(self) -> float | None:
        """One optimizer step over ``grad_accum`` micro-batches, then the routers' balance
        update. Returns the step's loss (mean over tokens, averaged over data-parallel ranks),
        or ``None`` when the step was skipped as bad (a non-finite loss or gradient on any
        rank: weights, optimizer state and router balance untouched, the batch consumed)."""
        train = self.config.train
        if self.gate is not None and self.gate.closed and self.step >= train.router_only_steps:
            self.gate.open()
        for group in self.optimizer.param_groups:
            scale = self.gate.scale(group) if self.gate is not None else group.get("lr_scale", 1)
            group["lr"] = train.lr * self.schedule(self.step) * scale
        set_training_pattern(self.focus_layers, self.config.model.focus, self.step)
        self.engine.train()
        loss = torch.zeros((), device=self.device)
        cp_group = self.layout.context_parallel_group
        skipped = False
        for micro in range(self.grad_accum):
            batch = batch_to(next(self.loader), self.device)
            backward, mean = micro_batch_loss(self.engine, batch, cp_group, self.objective)
            self.engine.backward(backward)
            loss += mean / self.grad_accum
            if micro == self.grad_accum - 1:  # before DeepSpeed's update: one check per step
                skipped = self.bad_steps.is_bad(loss, self.step + 1)
                self.step_switch.skip = skipped
            self.engine.step()
        self.step_switch.skip = False
        self.step += 1
        self.consumed_samples += train.global_batch_size
        if skipped:
            discard_balance(self.routers)
            return None
        update_balance(self.routers, self.layout.data_context_group)
        return group_mean(loss, self.layout.data_parallel_group)

    def train(self) -> dict[str, Any]:
        """Train to ``train.steps`` or until any rank receives SIGTERM/SIGINT (all ranks stop
        at the same step); the last step is always checkpointed.

        Returns:
            ``{"step", "train_loss", "valid_loss", "recall", "output_dir",
            "stopped_by_signal"}``; ``recall`` holds the last long-range recall scores (demo
            corpus, else ``None``).

        Raises:
            TooManyBadSteps: ``train.max_consecutive_bad_steps`` steps in a row were bad; a
                checkpoint of the last good weights was saved first.
        """
        config = self.config
        meter = IntervalMeter(
            step_flops_per_sample(config.model, config.data.seq_length, self.objective.name),
            config.train.global_batch_size,
            config.data.seq_length,
            self.layout.world_size,
            peak_tflops(config.train.peak_tflops),
        )
        announce_start(self)
        self.logger.total_steps = config.train.steps
        self._clock = (time.perf_counter(), self.step)  # this launch's start: elapsed, ETA
        try:
            with self.stop:
                while self.step < config.train.steps and not self.stop.should_stop():
                    meter.add(self.train_step())
                    if self.bad_steps.exhausted:
                        self._stop_after_bad_steps(meter)
                    self._after_step(meter)
                self.checkpointer.save(self.step, last=True)
            return self._finish()
        finally:
            self.logger.close()
            self.close()

    def _stop_after_bad_steps(self, meter: IntervalMeter) -> None:
        """Log, save a checkpoint (the last good weights, the data position past the bad
        batches), record why, and raise :class:`TooManyBadSteps`."""
        self.logger.log(self.step, self._train_scalars(meter))
        path = self.checkpointer.save(self.step, last=True) or self.checkpointer.latest
        message = self.bad_steps.message(self.step, path)
        self.logger.event(
            "end",
            step=self.step,
            bad_steps=self.bad_steps.consecutive,
            checkpoint=str(path),
            error=message,
        )
        if self.layout.is_main:
            write_exit_status(None, self.step, failed="bad_steps")
        raise TooManyBadSteps(message)

    def _after_step(self, meter: IntervalMeter) -> None:
        """Log, validate and checkpoint when each is due."""
        train = self.config.train
        if self.step % train.log_interval == 0 or self.step == train.steps:
            self.logger.log(self.step, self._train_scalars(meter))
        if self.validator.due(self.step):
            with meter.excluded("eval"):  # throughput counts training time only
                scalars = self.validator.run(self.engine)
            self.logger.log(self.step, scalars, prefix="valid")
        with meter.excluded("save"):
            self.checkpointer.save(self.step)

    def _progress(self) -> dict[str, float]:
        """Tokens seen (all launches), this launch's elapsed seconds and the estimated seconds
        to ``train.steps`` at its pace so far."""
        start, first_step = self._clock
        elapsed = time.perf_counter() - start
        done = self.step - first_step
        remaining = self.config.train.steps - self.step
        return {
            "tokens_seen": float(self.consumed_samples * self.config.data.seq_length),
            "elapsed_s": elapsed,
            "eta_s": elapsed / done * remaining if done > 0 else None,
        }

    def _train_scalars(self, meter: IntervalMeter) -> dict[str, float | None]:
        density = attention_density(self.focus_layers, self.layout.data_context_group)
        flops = None
        if density is not None:  # sparse training: FLOPs of the pairs computed
            config = self.config
            flops = flops_per_sample(config.model, config.data.seq_length, density=density)
        interval = meter.scalars(flops)
        self.last_train_loss = interval["loss"]
        norm = self.engine.get_global_grad_norm()
        norm = None if norm is None else float(norm)
        if norm is not None and not math.isfinite(norm):  # a skipped bad step: not JSON
            norm = None
        return {
            "loss": interval["loss"],
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": norm,
            "tokens_per_s": interval["tokens_per_s"],
            "tflops": interval["tflops"],
            "mfu": interval["mfu"],
            "peak_mem_gb": peak_memory_gb(),
            "max_group_share": max_group_share(self.routers, self.layout.data_context_group),
            "attention_density": density,  # sparse training: share of causal pairs computed
            "ring_skipped": ring_skipped_share(self.ring_stats),
            "skipped_steps": self.bad_steps.skipped,  # bad steps so far (not in loss)
            **self._progress(),
            "eval_s": interval.get("eval_s", 0.0),  # left out of tokens_per_s, tflops, mfu
            "save_s": interval.get("save_s", 0.0),
        }

    def _finish(self) -> dict[str, Any]:
        """The end line, the ``end`` record, and the result."""
        latest, stopped = self.checkpointer.latest, self.stop.agreed
        self.logger.event("end", step=self.step, stopped_by_signal=stopped, checkpoint=str(latest))
        if self.layout.is_main:
            announce_end(self, latest, stopped)
            write_exit_status(stopped, self.step)
        return {
            "step": self.step,
            "train_loss": self.last_train_loss,
            "valid_loss": self.validator.last_loss,
            "recall": self.validator.last_recall,
            "output_dir": str(self.output_dir),
            "stopped_by_signal": stopped,
        }


def pretrain(config: Config) -> dict[str, Any]:
    """Train ``config`` (see :meth:`Trainer.train`); resumes from its last checkpoint."""
    return Trainer(config).train()
