"""A :class:`~effijax.recipe.TrainConfig` in sections: what each stage of a run receives.

The config stays one flat set of settings (its flags, its TOML and ``config.json`` keys, its
defaults and help: one schema), and each field's metadata names its section. The config
builds one frozen dataclass per section (``config.sections``: a :class:`Sections`), each
holding exactly its section's fields and checking them itself; the checks that span sections
(LoRA needs ``--from``, dpo needs LoRA, the batch over the processes, ...) stay with the
config. A stage of :func:`~effijax.recipe.train` takes the sections it uses, never the whole
config (Levanter's and torchtitan's sectioned configs), so what a stage reads is in its
signature.

Example:
  >>> from effijax.recipe import TrainConfig
  >>> s = TrainConfig(steps=40, optimizer="lion").sections
  >>> s.training.steps, s.training.warmup_steps, s.optimizer.hyperparameters
  (40, 2, {'b1': 0.9, 'b2': 0.99})
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from typing import NamedTuple

from effijax.errors import ConfigError, path_name, whole_number
from effijax.interop import GGUF_DTYPES
from effijax.memory import PRECISION_ALIASES
from effijax.optimizers import OPTIMIZERS, SCHEDULES, decay_mask, hyperparameters
from effijax.precision import PRESET_NAMES
from effijax.recipe._identity import DEFAULT_BETA, OBJECTIVE_SETTINGS, default_warmup

__all__ = ["Sections", "ModelSection", "PrecisionSection", "TrainingSection",
           "OptimizerSection", "DataSection", "ParallelSection", "OutputSection",
           "ObjectiveSection", "LoraSection", "holds_reference", "reward_names",
           "reward_weights"]

# The precision vocabulary of every command (`effijax train`, `memory`, `plan`): the policy
# presets plus "auto" (effijax.precision.auto_precision: bf16 on GPU/TPU, and on a CPU with
# native bf16 matmuls for a model wide enough; fp32 elsewhere), with the memory estimator's
# aliases ("mixed", "float32", "half", ...).
PRECISIONS = ("auto", *PRESET_NAMES)
FROZEN_DTYPES = ("auto", "fp32", "bf16", "fp16", "nf4", "int8", "gguf")
DATA_FORMATS = ("auto", "text", "chat")
# How a preference pair's side longer than a row is cut (TRL's DPOConfig.truncation_mode;
# effijax.recipe._pairs.pair_rows): None refuses it.
TRUNCATION_MODES = ("keep_start", "keep_end")
# The training objectives (effijax.recipe._objectives.OBJECTIVES; kept here too: checking a
# config must not import jax; a test checks that the two lists agree) and DPO's loss types
# (effijax.objectives.DPO_LOSS_TYPES, likewise).
OBJECTIVES = ("sft", "dpo", "simpo", "orpo", "grpo")
# Those that compare the policy with a frozen reference (Objective.reference): in full training
# it is a copy of the starting weights, whose floating dtype --frozen-dtype chooses. grpo's
# serves only its KL penalty: it holds one with beta > 0 (holds_reference decides).
REFERENCE_OBJECTIVES = ("dpo", "grpo")
REFERENCE_DTYPES = ("auto", "fp32", "bf16", "fp16")
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust")
# GRPO's loss types and reward scalings (effijax.objectives.GRPO_LOSS_TYPES, SCALE_REWARDS).
GRPO_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
# The objectives' settings (effijax.recipe._identity.OBJECTIVE_SETTINGS: which objective uses
# which) as their losses' keyword arguments are named.
SETTING_OF = {"beta": "beta", "dpo_loss": "loss_type", "label_smoothing": "label_smoothing",
              "simpo_gamma": "gamma", "cpo_alpha": "cpo_alpha",
              "num_generations": "num_generations",
              "max_completion_length": "max_completion_length",
              "rollout_temperature": "temperature",
              "rollout_top_p": "top_p", "epsilon": "epsilon", "epsilon_high": "epsilon_high",
              "grpo_loss": "loss_type", "scale_rewards": "scale_rewards",
              "num_iterations": "num_iterations", "rewards": "rewards",
              "reward_weights": "reward_weights"}
# Launchers of effijax.distributed (kept here too: checking a config must not import jax; a
# test checks that the two lists agree).
CLUSTERS = ("auto", "none", "ompi", "slurm", "mpi4py", "gke-tpu", "gce-tpu", "k8s")
WANDB_MODES = ("online", "offline", "disabled")
# The largest learning rate a config may ask for: the largest float32, as the step holds it (a
# larger one is inf, and every step NaN; one below diverges with the non-finite steps' message).
MAX_LR = 3.4028234663852886e38
# The most batches built ahead: each waits in host memory, and 2 keep the step fed.
MAX_PREFETCH = 64

_frozen = dataclasses.dataclass(frozen=True, kw_only=True)


def _one_of(field: str, value, choices) -> None:
    """Refuses a ``value`` of ``field`` that is not one of ``choices``, naming them.

    Example:
      >>> _one_of("schedule", "linear", ("cosine", "constant"))
      Traceback (most recent call last):
      effijax.errors.ConfigError: schedule='linear': choose one of cosine, constant
    """
    if value not in choices:
        raise ConfigError(field, value, f"choose one of {', '.join(choices)}")


def _set(section, name: str, value) -> None:
    object.__setattr__(section, name, value)  # a frozen section's value, normalised


@_frozen
class ModelSection:
    """What to train: the preset, or the model ``model_from`` names."""

    model: str
    seq_len: int | None
    model_from: str | None
    unroll_layers: bool

    def __post_init__(self):
        if self.model_from is not None:
            path_name("model_from", self.model_from)
        if self.seq_len is not None:
            whole_number("seq_len", self.seq_len, minimum=2)


@_frozen
class PrecisionSection:
    """The precision policy, the loss scale, and how many non-finite steps a run survives."""

    precision: str
    loss_scale: str | float
    max_non_finite: int

    def __post_init__(self):
        whole_number("max_non_finite", self.max_non_finite, minimum=0)
        _set(self, "precision", _precision(self.precision))
        _set(self, "loss_scale", _loss_scale(self.loss_scale, self.precision))

    @property
    def loss_scale_mode(self) -> str | float:
        """``loss_scale`` with ``auto`` decided: dynamic for fp16, none otherwise."""
        if self.loss_scale != "auto":
            return self.loss_scale
        return "dynamic" if self.precision == "fp16" else "none"


@_frozen
class TrainingSection:
    """The steps, the batch, the learning rate and its warm-up, regularisation, the seed, and
    what the run exports at its end."""

    steps: int
    batch_size: int
    lr: float
    warmup: int | None
    weight_decay: float
    clip: float
    accumulate: int
    seed: int
    export_hf: bool
    export_gguf: str | None

    def __post_init__(self):
        for name in ("steps", "batch_size", "accumulate"):
            whole_number(name, getattr(self, name), minimum=1)
        whole_number("seed", self.seed, minimum=0)
        if not 0 < self.lr <= MAX_LR:
            raise ConfigError("lr", self.lr, f"must be > 0 and at most {MAX_LR:.4g}, the "
                              "largest float32 (the step computes in it; adamw's usual values "
                              "are 1e-5 to 3e-3)")
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
        if self.export_gguf is not None and self.export_gguf not in GGUF_DTYPES:
            raise ConfigError("export_gguf", self.export_gguf, f"GGUF tensor types effijax "
                              f"writes: {', '.join(GGUF_DTYPES)}")

    @property
    def warmup_steps(self) -> int:
        """``warmup``, or 5% of the steps (at least 1)."""
        return self.warmup if self.warmup is not None else default_warmup(self.steps)


@_frozen
class OptimizerSection:
    """The optax optimizer, its schedule after the warm-up, and its hyperparameters."""

    optimizer: str
    schedule: str
    lr_end: float
    decay_fraction: float
    b1: float | None
    b2: float | None
    eps: float | None
    momentum: float | None
    no_decay: str | None

    def __post_init__(self):
        _one_of("optimizer", self.optimizer, OPTIMIZERS)
        _one_of("schedule", self.schedule, SCHEDULES)
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
        self.hyperparameters  # noqa: B018  (the optimizer's own checks of them)
        decay_mask(self.no_decay)  # a regex that compiles

    @property
    def hyperparameters(self) -> dict:
        """The optimizer's hyperparameters, each unset one at its default."""
        return hyperparameters(self.optimizer, b1=self.b1, b2=self.b2, eps=self.eps,
                               momentum=self.momentum)


@_frozen
class DataSection:
    """What the run trains on, how it is read, and how many batches are built ahead."""

    data: str | None
    data_format: str
    text_column: str
    chat_template: str | None
    truncation_mode: str | None
    eval_batches: int
    eval_tasks: str | None
    eval_tasks_limit: int | None
    eval_tasks_every: int
    prefetch: int

    def __post_init__(self):
        for name in ("data", "chat_template"):
            if getattr(self, name) is not None:
                path_name(name, getattr(self, name))
        for name in ("eval_batches", "prefetch"):
            whole_number(name, getattr(self, name), minimum=0)
        whole_number("eval_tasks_limit", self.eval_tasks_limit, none=True)
        whole_number("eval_tasks_every", self.eval_tasks_every, minimum=0)
        if self.eval_tasks_every and not self.eval_tasks:
            raise ConfigError("eval_tasks_every", self.eval_tasks_every, "evaluates the tasks "
                              "of --eval-tasks, which names none")
        if self.prefetch > MAX_PREFETCH:  # each batch waits in host memory
            raise ConfigError("prefetch", self.prefetch, f"must be at most {MAX_PREFETCH} "
                              "(batches held ready in memory; 2 keeps the step fed)")
        if not isinstance(self.text_column, str) or not self.text_column.strip():
            raise ConfigError("text_column", self.text_column, "expected a column name, e.g. "
                              "text or body")
        _one_of("data_format", self.data_format, DATA_FORMATS)
        if self.truncation_mode is not None:
            _one_of("truncation_mode", self.truncation_mode, TRUNCATION_MODES)


@_frozen
class ParallelSection:
    """The processes, devices, mesh and sharding strategy, and the memory a device offers."""

    strategy: str | None
    mesh: dict | None
    cpu_devices: int | None
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    join_timeout: int
    device_memory: str | None
    cluster: str

    def __post_init__(self):
        whole_number("join_timeout", self.join_timeout, minimum=1)
        if self.num_processes is not None:
            whole_number("num_processes", self.num_processes, minimum=1)
        if self.cpu_devices is not None:
            # Imported only when set: the bound lives with the code that forces the devices
            # (and imports jax, which a config without devices to force does not need).
            from effijax.distributed import MAX_CPU_DEVICES

            whole_number("cpu_devices", self.cpu_devices, maximum=MAX_CPU_DEVICES)
        if self.process_id is not None:
            whole_number("process_id", self.process_id, minimum=0)
        _set(self, "mesh", _mesh(self.mesh))
        if self.strategy is not None:
            from effijax.sharding import get_strategy  # the strategies' one list (no jax)

            get_strategy(self.strategy)
        _one_of("cluster", self.cluster, CLUSTERS)
        if self.device_memory is not None:
            from effijax.memory import parse_bytes

            parse_bytes(self.device_memory, field="device_memory")


@_frozen
class OutputSection:
    """The run directory, its checkpoints, what a resume may change, and what watches the run
    (progress bar, TensorBoard, W&B, the profiler)."""

    out: str
    checkpoints: bool
    checkpoint_every: int
    keep: int
    allow_changes: str | None
    progress: bool
    verbose: bool
    tensorboard: bool
    wandb: str | None
    wandb_mode: str | None
    profile_steps: str | None

    def __post_init__(self):
        if not self.out.strip():  # "" would write config.json and loss.png into "."
            raise ConfigError("out", self.out, "is empty (an unset shell variable?); name the "
                              "run directory, e.g. --out runs/mine")
        path_name("out", self.out)
        for name in ("checkpoint_every", "keep"):
            whole_number(name, getattr(self, name), minimum=1)
        if self.wandb is not None and not self.wandb.strip():
            raise ConfigError("wandb", self.wandb, "give a project name")
        if self.wandb_mode is not None:
            if self.wandb is None:
                raise ConfigError("wandb_mode", self.wandb_mode, "only applies with --wandb "
                                  "PROJECT")
            _one_of("wandb_mode", self.wandb_mode, WANDB_MODES)
        self.profile_range  # noqa: B018  (A:B, checked)
        self.allowed_changes  # noqa: B018  (names that may change, checked)

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """``profile_steps`` as ``(first, last)`` 1-based inclusive step numbers, or None."""
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

    @property
    def allowed_changes(self) -> tuple[str, ...]:
        """``allow_changes`` as a tuple of setting names."""
        return _allowed_changes(self.allow_changes)


def holds_reference(objective: str, beta: float | None = None,
                    precompute_reference: bool = False) -> bool:
    """Whether ``objective`` with this ``beta`` compares the policy with a frozen reference: in
    full training a copy of the starting weights that the run holds (under LoRA the base with
    the adapters off, no copy). dpo always; grpo only for a KL penalty, ``beta > 0``; ``beta``
    None is the objective's default (TRL's: 0 for grpo); none with ``precompute_reference``
    (dpo's reference log-probabilities computed before training). The one answer of the
    config's checks, ``effijax memory`` and ``plan``, and :func:`~effijax.recipe.plan_job`
    (through the objective's ``reference``).

    Example:
      >>> holds_reference("dpo"), holds_reference("grpo"), holds_reference("grpo", 0.04)
      (True, False, True)
      >>> holds_reference("sft", 0.1), holds_reference("dpo", precompute_reference=True)
      (False, False)
    """
    if objective not in REFERENCE_OBJECTIVES or precompute_reference:
        return False
    beta = DEFAULT_BETA.get(objective) if beta is None else beta
    return objective != "grpo" or beta > 0


def reward_names(rewards: str | None) -> list[str]:
    """``--rewards``' names (built-ins or dotted paths), comma-separated.

    Example:
      >>> reward_names("exact_match, pkg.mod:fn")
      ['exact_match', 'pkg.mod:fn']
    """
    names = [] if rewards is None else [r.strip() for r in rewards.split(",") if r.strip()]
    if not names:
        raise ConfigError("rewards", rewards, "grpo scores completions with reward functions: "
                          "give --rewards NAME[,NAME...] (built-ins: exact_match, "
                          "answer_format; or 'package.module:function')")
    return names


def reward_weights(weights: str | None, count: int) -> list[float] | None:
    """``--reward-weights``, one finite number per reward (``count`` of them), comma-separated;
    None when not given.

    Example:
      >>> reward_weights("1,0.5", 2)
      [1.0, 0.5]
      >>> reward_weights("1,2", 1)
      Traceback (most recent call last):
      effijax.errors.ConfigError: reward_weights='1,2': expected 1 finite numbers, one per reward
    """
    if weights is None:
        return None
    try:
        values = [float(w) for w in weights.split(",")]
    except ValueError:
        raise ConfigError("reward_weights", weights, "expected comma-separated numbers, one "
                          "per reward") from None
    if len(values) != count or not all(math.isfinite(w) for w in values):
        raise ConfigError("reward_weights", weights, f"expected {count} finite numbers, one "
                          "per reward")
    return values


@_frozen
class ObjectiveSection:
    """What the run optimises, and the objective's own settings."""

    objective: str
    beta: float | None
    dpo_loss: str
    precompute_reference: bool
    label_smoothing: float
    simpo_gamma: float
    cpo_alpha: float
    num_generations: int
    max_completion_length: int
    rollout_temperature: float
    rollout_top_p: float
    epsilon: float
    epsilon_high: float | None
    grpo_loss: str
    scale_rewards: str
    num_iterations: int
    rewards: str | None
    reward_weights: str | None

    def __post_init__(self):
        _one_of("objective", self.objective, OBJECTIVES)
        # The settings the objective uses (the config refuses the others away from their
        # defaults: "only applies to --objective ...").
        uses = OBJECTIVE_SETTINGS[self.objective]
        if "dpo_loss" in uses:
            _one_of("dpo_loss", self.dpo_loss, DPO_LOSSES)
        if "beta" in uses and self.objective != "grpo" and not self.resolved_beta > 0:
            raise ConfigError("beta", self.beta, "must be > 0 (TRL's default is 0.1)")
        if self.objective == "grpo":
            self._check_grpo()
        if "label_smoothing" in uses:
            if self.label_smoothing and self.objective == "dpo" and self.dpo_loss != "robust":
                raise ConfigError("label_smoothing", self.label_smoothing, "only applies to "
                                  "--dpo-loss robust")
            if not 0 <= self.label_smoothing < 0.5:
                raise ConfigError("label_smoothing", self.label_smoothing,
                                  "must be in [0, 0.5)")
        if "simpo_gamma" in uses and not math.isfinite(self.simpo_gamma):
            raise ConfigError("simpo_gamma", self.simpo_gamma, "must be a finite number "
                              "(TRL's default is 0.5)")
        if "cpo_alpha" in uses and not 0 <= self.cpo_alpha < math.inf:
            raise ConfigError("cpo_alpha", self.cpo_alpha, "must be >= 0 and finite (TRL's "
                              "default is 1.0; 0 for SimPO without the NLL term)")

    @property
    def resolved_beta(self) -> float | None:
        """``beta``, or the objective's TRL default when it was not given (None for sft)."""
        return DEFAULT_BETA.get(self.objective) if self.beta is None else self.beta

    def _check_grpo(self) -> None:
        for name in ("num_generations", "max_completion_length", "num_iterations"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be >= 1")
        _one_of("grpo_loss", self.grpo_loss, GRPO_LOSSES)
        _one_of("scale_rewards", self.scale_rewards, SCALE_REWARDS)
        if not self.resolved_beta >= 0:
            raise ConfigError("beta", self.beta, "must be >= 0: grpo's KL penalty (TRL's "
                              "default is 0)")
        if not self.rollout_temperature > 0:
            raise ConfigError("rollout_temperature", self.rollout_temperature, "a rollout "
                              "samples: must be > 0 (TRL's default is 1.0)")
        if not 0 < self.rollout_top_p <= 1:
            raise ConfigError("rollout_top_p", self.rollout_top_p, "must be in (0, 1]")
        if not 0 < self.epsilon < 1:
            raise ConfigError("epsilon", self.epsilon, "must be in (0, 1): the ratio is "
                              "clipped below at 1 - epsilon (TRL's default is 0.2)")
        if self.epsilon_high is not None and not self.epsilon_high > 0:
            raise ConfigError("epsilon_high", self.epsilon_high, "must be > 0 (DAPO recommends "
                              "0.28)")
        reward_weights(self.reward_weights, len(reward_names(self.rewards)))

    @property
    def settings(self) -> dict:
        """The objective's own settings, as its loss takes them (empty for sft; ``beta`` the
        objective's default when not given)."""
        settings = {SETTING_OF[name]: self.resolved_beta if name == "beta"
                    else getattr(self, name) for name in OBJECTIVE_SETTINGS[self.objective]}
        # Not part of the run's identity (the same losses to f32 rounding): only when given.
        return {**settings, **({"precompute_reference": True} if self.precompute_reference
                               else {})}


@_frozen
class LoraSection:
    """LoRA's adapters (``lora_rank`` None: full training) and the frozen base's storage."""

    lora_rank: int | None
    lora_alpha: float
    lora_targets: str | None
    lora_dropout: float
    frozen_dtype: str
    lora_random_base: bool

    def __post_init__(self):
        if self.lora_rank is None:  # the config refuses the other settings away from defaults
            return
        whole_number("lora_rank", self.lora_rank, minimum=1)
        _one_of("frozen_dtype", self.frozen_dtype, FROZEN_DTYPES)
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

    def spec(self, default_targets: str):
        """The run's :class:`~effijax.lora.LoraSpec` (None: full training); a spec error is
        reported under the config's field name (``lora_rank``, ``lora_targets``, ...)."""
        if self.lora_rank is None:
            return None
        from effijax.lora import LoraSpec

        with lora_fields():
            return LoraSpec(rank=self.lora_rank, alpha=self.lora_alpha,
                            targets=self.lora_targets or default_targets,
                            dropout=self.lora_dropout)


class Sections(NamedTuple):
    """A config's sections (``TrainConfig.sections``), in the order they are checked."""

    output: OutputSection
    data: DataSection
    model: ModelSection
    training: TrainingSection
    precision: PrecisionSection
    optimizer: OptimizerSection
    parallel: ParallelSection
    objective: ObjectiveSection
    lora: LoraSection


# The section a TrainConfig field's metadata names -> its dataclass.
SECTION_TYPES = {name: kind for name, kind in zip(
    Sections._fields, (OutputSection, DataSection, ModelSection, TrainingSection,
                       PrecisionSection, OptimizerSection, ParallelSection, ObjectiveSection,
                       LoraSection), strict=True)}


def sections_of(values) -> Sections:
    """Each section built (and checked) from ``values``: an object holding every field of
    every section as an attribute (a TrainConfig, as it builds itself)."""
    return Sections(*(kind(**{f.name: getattr(values, f.name) for f in dataclasses.fields(kind)})
                      for kind in SECTION_TYPES.values()))


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


# Values of one section's fields -----------------------------------------------------------------

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
