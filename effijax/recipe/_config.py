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

Each field's metadata names its section (model, precision, training, optimizer, data, parallel,
output, objective, lora). ``config.sections`` holds the config split into those sections
(:mod:`effijax.recipe._sections`: frozen dataclasses, each checking its own fields); the checks
that span sections stay here. The stages of :func:`~effijax.recipe.train` receive sections,
never the whole config; the schema (flags, files, ``config.json``) stays flat.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import tomllib
from pathlib import Path

from effijax.errors import ConfigError
from effijax.interop import GGUF_DTYPES
from effijax.memory import PRECISION_ALIASES
from effijax.optimizers import OPTIMIZERS, SCHEDULES
from effijax.precision import AUTO_BF16_MIN_WIDTH
from effijax.recipe._identity import OBJECTIVE_SETTINGS, default_warmup
from effijax.recipe._sections import (
    CLUSTERS,
    DATA_FORMATS,
    DPO_LOSSES,
    FROZEN_DTYPES,
    GRPO_LOSSES,
    OBJECTIVES,
    PRECISIONS,
    REFERENCE_DTYPES,
    SCALE_REWARDS,
    SETTING_OF,
    TRUNCATION_MODES,
    WANDB_MODES,
    Sections,
    holds_reference,
    lora_fields,
    sections_of,
)
from effijax.sources import MAX_CONFIG_BYTES, RENAMED_SETTINGS, current_names

__all__ = ["TrainConfig", "PRECISIONS", "CLUSTERS", "WANDB_MODES", "PRECISION_ALIASES",
           "DEFAULT_MODEL", "RECORD_KEYS", "flag_of", "field_kind", "lora_fields"]

# The vocabularies (PRECISIONS, OBJECTIVES, CLUSTERS, ...) and each section's checks live in
# effijax.recipe._sections, which the fields' `section` metadata names.
DEFAULT_MODEL = "mini"
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
      >>> cfg = TrainConfig(steps=50, lora_rank=4, model_from="runs/base")
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
    model_from: str | None = _field(None, "the model to start from (its architecture and "
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
    truncation_mode: str | None = _field(None, "dpo, simpo, orpo: cut a pair's side longer "
                                         "than a row (seq_len + 1 tokens, TRL's max_length) "
                                         "as TRL's truncation_mode: keep_start (its first "
                                         "tokens; a pair whose prompt fills a row is dropped) "
                                         "or keep_end (its last); default: refuse the pair",
                                         choices=TRUNCATION_MODES, section="data")
    eval_batches: int = _field(8, "validation batches evaluated at the end (0: none)",
                               section="data")
    eval_tasks: str | None = _field(None, "lm-evaluation-harness tasks run on the trained "
                                    "weights at the end, comma-separated (effijax_offline: "
                                    "the shipped ones); scores as eval_tasks/TASK/METRIC",
                                    metavar="TASKS", section="data")
    eval_tasks_limit: int | None = _field(None, "documents of each --eval-tasks task (default: "
                                          "all)", metavar="N", section="data")
    eval_tasks_every: int = _field(0, "also run --eval-tasks every K steps during training "
                                   "(0: only at the end)", metavar="K", section="data")
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
                            "reference; see docs/preference.md; or grpo (completions sampled "
                            "from the policy each step, scored by --rewards, on {prompt} JSONL "
                            "records)",
                            choices=OBJECTIVES, section="objective")
    beta: float | None = _field(None, "dpo, simpo, orpo, grpo: beta, by default the "
                                "objective's TRL default (DPOConfig, CPOConfig and ORPOConfig "
                                "beta, 0.1 in each; GRPOConfig beta, 0.0): dpo's pull towards "
                                "the reference (for ipo, its regulariser tau), simpo's reward "
                                "scale, orpo's weight (lambda) of the odds-ratio term, grpo's "
                                "KL penalty (> 0: against a reference)", section="objective")
    dpo_loss: str = _field("sigmoid", "dpo: the loss (TRL's DPOConfig.loss_type): sigmoid, "
                           "ipo (length-normalised), hinge or robust (label-smoothed)",
                           choices=DPO_LOSSES, section="objective")
    precompute_reference: bool = _field(False, "dpo: compute the reference's log-probabilities "
                                        "of every pair once, before the first step (TRL's "
                                        "precompute_ref_log_probs), and keep them in "
                                        "OUT/reference_logps.npz: full fine-tuning then holds "
                                        "no reference copy", flag="--precompute-reference",
                                        section="objective")
    label_smoothing: float = _field(0.0, "dpo with --dpo-loss robust, and simpo: the "
                                    "probability that a pair's labels are flipped, in [0, 0.5) "
                                    "(TRL's DPOConfig and CPOConfig label_smoothing)",
                                    section="objective")
    simpo_gamma: float = _field(0.5, "simpo: the target reward margin gamma (TRL's "
                                "CPOConfig.simpo_gamma)", section="objective")
    cpo_alpha: float = _field(1.0, "simpo: the weight of the chosen completions' NLL added to "
                              "the loss (TRL's CPOConfig.cpo_alpha; its default gives "
                              "CPO-SimPO); 0 for SimPO as published", section="objective")
    num_generations: int = _field(8, "grpo: completions sampled per prompt, G (TRL's "
                                  "GRPOConfig.num_generations); --batch-size counts completions "
                                  "and must be a multiple of it", metavar="G",
                                  section="objective")
    max_completion_length: int = _field(256, "grpo: new tokens per completion at most (TRL's "
                                        "default); a row is the prompt in seq_len minus this, "
                                        "then the completion", metavar="T", section="objective")
    rollout_temperature: float = _field(1.0, "grpo: the rollouts' sampling temperature (> 0; "
                                        "TRL's GRPOConfig.temperature, 1.0)",
                                        section="objective")
    rollout_top_p: float = _field(1.0, "grpo: the rollouts' nucleus (top-p) sampling, in "
                                  "(0, 1] (TRL's GRPOConfig.top_p)", section="objective")
    epsilon: float = _field(0.2, "grpo: the ratio's lower clipping range (TRL's "
                            "GRPOConfig.epsilon)", section="objective")
    epsilon_high: float | None = _field(None, "grpo: the upper clipping range (default: "
                                        "--epsilon; DAPO recommends 0.28)",
                                        section="objective")
    grpo_loss: str = _field("dapo", "grpo: the loss's normalisation (TRL's "
                            "GRPOConfig.loss_type): dapo, grpo, bnpo or dr_grpo",
                            choices=GRPO_LOSSES, section="objective")
    scale_rewards: str = _field("group", "grpo: divide the advantages by the group's reward "
                                "deviation (group), the batch's (batch) or not (none, Dr. "
                                "GRPO)", choices=SCALE_REWARDS, section="objective")
    num_iterations: int = _field(1, "grpo: policy updates per rollout (TRL's "
                                 "GRPOConfig.num_iterations, mu): each sampled batch is trained "
                                 "on this many steps, the ratio taken to the sampling pass's "
                                 "log-probabilities, so that from the second on it clips",
                                 metavar="N", section="objective")
    rewards: str | None = _field(None, "grpo: the reward functions, comma-separated: "
                                 "built-ins (exact_match, answer_format) or dotted paths "
                                 "'package.module:function' with TRL's signature",
                                 metavar="NAMES", section="objective")
    reward_weights: str | None = _field(None, "grpo: one weight per reward, comma-separated "
                                        "(default: all 1)", metavar="W,...",
                                        section="objective")
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
                               "gguf: a GGUF base's quantized blocks kept as they are); in full "
                               "fine-tuning with --objective dpo, of the reference copy (auto, "
                               "fp32, bf16, fp16)",
                               choices=FROZEN_DTYPES, section="lora")
    lora_random_base: bool = _field(False, "train adapters on a randomly initialised base (for "
                                    "experiments; LoRA normally adapts the model --from names)",
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
        # Each section checks its own fields (and normalises them: the precision's aliases,
        # the loss scale, the mesh), which the config then holds as the sections hold them.
        sections = sections_of(self)
        for section in sections:
            for f in dataclasses.fields(section):
                object.__setattr__(self, f.name, getattr(section, f.name))
        object.__setattr__(self, "_sections", sections)
        # The checks that span sections.
        if self.num_processes and self.batch_size % self.num_processes:
            raise ConfigError("batch_size", self.batch_size, f"must be divisible by "
                              f"num_processes={self.num_processes} (each process builds its own "
                              "rows of the global batch)")
        self._check_lora()
        self._check_objective()
        if self.profile_steps is not None:
            first, last = self.profile_range
            if last > self.steps:
                raise ConfigError("profile_steps", self.profile_steps, f"ends after the last "
                                  f"step (steps={self.steps})")

    @property
    def sections(self) -> Sections:
        """The config in its sections (:mod:`effijax.recipe._sections`), each a frozen
        dataclass of the fields its metadata names, checked: what the stages of
        :func:`~effijax.recipe.train` receive. Built once with the config; not a field (so
        ``to_dict``, equality and ``dataclasses.replace`` see the flat fields alone).

        Example:
          >>> s = TrainConfig(lora_rank=4, model_from="runs/base").sections
          >>> s.lora.lora_rank, s.model.model_from, s.output.out
          (4, 'runs/base', 'runs/train')
        """
        return self._sections

    @property
    def hyperparameters(self) -> dict:
        """The optimizer's hyperparameters, each unset one at its default."""
        return self.sections.optimizer.hyperparameters

    @property
    def allowed_changes(self) -> tuple[str, ...]:
        """``allow_changes`` as a tuple of setting names."""
        return self.sections.output.allowed_changes

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """``profile_steps`` as ``(first, last)`` 1-based inclusive step numbers, or None.

        Example:
          >>> TrainConfig(profile_steps="3:4").profile_range
          (3, 4)
          >>> TrainConfig(profile_steps="4:3")
          Traceback (most recent call last):
          ...
          effijax.errors.ConfigError: profile_steps='4:3': expected A:B with 1 <= A ...
        """
        return self.sections.output.profile_range

    def _check_lora(self) -> None:
        if self.lora_rank is None:
            reference = holds_reference(self.objective, self.beta, self.precompute_reference)
            if self.precompute_reference and self.frozen_dtype != _DEFAULTS["frozen_dtype"]:
                raise ConfigError("frozen_dtype", self.frozen_dtype, "a full fine-tune with "
                                  "--precompute-reference holds no reference copy (the "
                                  "starting weights score the pairs once, in the compute "
                                  "dtype): leave it out")
            for name in ("lora_alpha", "lora_targets", "lora_dropout", "frozen_dtype",
                         "lora_random_base"):
                if getattr(self, name) == _DEFAULTS[name] or (name == "frozen_dtype"
                                                               and reference):
                    continue
                raise ConfigError(name, getattr(self, name), "only applies to LoRA; "
                                  "give the adapters' rank too (--lora-rank R)" + (
                                      " (grpo holds a reference copy, whose dtype it sets, "
                                      "only with --beta > 0)" if self.objective == "grpo"
                                      and name == "frozen_dtype" else ""))
            if reference and self.frozen_dtype not in REFERENCE_DTYPES:
                raise ConfigError("frozen_dtype", self.frozen_dtype, f"{self.objective}'s "
                                  "reference copy (full fine-tuning) is kept in a floating "
                                  f"dtype: choose one of {', '.join(REFERENCE_DTYPES)}, or "
                                  "train LoRA adapters (--lora-rank R) on a quantized base")
            return
        if self.model_from is None and not self.lora_random_base:
            raise ConfigError("lora_rank", self.lora_rank, "LoRA adapts a trained model: give "
                              "--from SOURCE, or --lora-random-base to train adapters on "
                              "a random base on purpose")

    def _check_objective(self) -> None:
        if self.precompute_reference and self.objective != "dpo":
            why = ("grpo's reference scores the completions sampled at each step, which do not "
                   "exist before training" if self.objective == "grpo" else
                   f"{self.objective} compares the policy with no reference model")
            raise ConfigError("precompute_reference", True, f"only applies to --objective dpo: "
                              f"{why}; leave it out")
        if self.truncation_mode is not None and self.objective not in ("dpo", "simpo", "orpo"):
            raise ConfigError("truncation_mode", self.truncation_mode, "only applies to the "
                              "preference objectives' pairs (--objective dpo, simpo or orpo)")
        uses = OBJECTIVE_SETTINGS[self.objective]
        for name in SETTING_OF:
            if name in uses or getattr(self, name) == _DEFAULTS[name]:
                continue
            users = [o for o in OBJECTIVES if name in OBJECTIVE_SETTINGS[o]]
            which = (", ".join(users[:-1]) + " or " if len(users) > 1 else "") + users[-1]
            raise ConfigError(name, getattr(self, name), f"only applies to --objective {which}")
        if self.objective == "sft":
            return
        if self.objective == "grpo":
            self._check_grpo()
            return
        if self.data is None:
            raise ConfigError("data", None, f"{self.objective} trains on preference pairs: give "
                              "--data PAIRS.jsonl ({\"prompt\", \"chosen\", \"rejected\"} "
                              "records)")
        if self.batch_size % 2:
            raise ConfigError("batch_size", self.batch_size, f"counts rows, and "
                              f"{self.objective} trains pairs of rows (chosen, rejected): use an "
                              f"even size, e.g. {self.batch_size + 1}")

    def _check_grpo(self) -> None:
        if self.data is None:
            raise ConfigError("data", None, "grpo samples completions of prompts: give --data "
                              "PROMPTS.jsonl ({\"prompt\": ...} records, other columns for "
                              "the rewards)")
        if self.batch_size % self.num_generations:
            raise ConfigError("batch_size", self.batch_size, f"counts completions, "
                              f"num_generations={self.num_generations} of each prompt: use a "
                              f"multiple of it")
        if self.prefetch not in (0, _DEFAULTS["prefetch"]):
            raise ConfigError("prefetch", self.prefetch, "grpo samples each step's batch from "
                              "the parameters the step before made, so nothing can be built "
                              "ahead: leave it out or give 0")
        if self.num_processes and self.num_processes > 1:
            raise ConfigError("num_processes", self.num_processes, "grpo's rollouts run in one "
                              "process for now")
        if self.seq_len is not None and self.max_completion_length >= self.seq_len:
            raise ConfigError("max_completion_length", self.max_completion_length, f"leaves no "
                              f"room for a prompt in a row of seq_len={self.seq_len} tokens: "
                              "use less, or raise --seq-len")

    @property
    def objective_settings(self) -> dict:
        """The objective's own settings, as its loss takes them (empty for sft).

        Example:
          >>> TrainConfig(objective="simpo", data="p.jsonl", cpo_alpha=0.0).objective_settings
          {'beta': 0.1, 'gamma': 0.5, 'cpo_alpha': 0.0, 'label_smoothing': 0.0}
        """
        return self.sections.objective.settings

    # Derived values ---------------------------------------------------------------------------

    @property
    def loss_scale_mode(self) -> str | float:
        """``loss_scale`` with ``auto`` decided: dynamic for fp16, none otherwise."""
        return self.sections.precision.loss_scale_mode

    @property
    def warmup_steps(self) -> int:
        """``warmup``, or 5% of the steps (at least 1)."""
        return self.sections.training.warmup_steps

    def resolved(self, precision: str, *, strategy: str | None,
                 mesh: dict | None) -> TrainConfig:
        """A copy with every ``auto`` decided, as ``config.json`` records it: the precision
        (``precision``, a preset's name), the optimizer's hyperparameters, the warm-up and the
        loss scale, and the run's placement (``strategy`` and ``mesh``: the mesh's actual
        shape; both None on one device).

        A warm-up at its default follows ``steps``: when a resume may change ``steps``
        (``allow_changes``), it may change that warm-up too, without a second name (a warm-up
        set to another value is a setting of its own).

        Example:
          >>> cfg = TrainConfig(steps=40, allow_changes="steps").resolved(
          ...     "fp32", strategy=None, mesh=None)
          >>> cfg.warmup, cfg.loss_scale, cfg.allow_changes, cfg.b1
          (2, 'none', 'steps,warmup', 0.9)
        """
        allow = self.allowed_changes
        if ("steps" in allow and "warmup" not in allow
                and self.warmup_steps == default_warmup(self.steps)):  # it follows the steps
            allow = (*allow, "warmup")
        return dataclasses.replace(
            self, **self.hyperparameters, precision=precision, loss_scale=self.loss_scale_mode,
            warmup=self.warmup_steps, allow_changes=",".join(allow) or None, strategy=strategy,
            mesh=mesh)

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
        ignored, and a setting an earlier effijax wrote under another name
        (:data:`~effijax.sources.RENAMED_SETTINGS`: ``init_from``) is read under its name now.

        Example:
          >>> TrainConfig.from_dict({"init_from": "runs/base", "lora_rank": 4}).model_from
          'runs/base'
        """
        if not isinstance(values, dict):
            raise ConfigError("config", type(values).__name__, "expected a table of settings")
        values = current_names({k: v for k, v in values.items() if k not in RECORD_KEYS})
        _check_keys(values)
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | Path) -> TrainConfig:
        """A config from a ``.toml`` or ``.json`` file.

        Example:
          >>> import tempfile, pathlib
          >>> p = pathlib.Path(tempfile.mkdtemp()) / "run.toml"
          >>> _ = p.write_text('steps = 20\\nlora_rank = 4\\nmodel_from = "runs/base"\\n')
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
# Each field's default: a setting that does not apply (another objective's, LoRA's without a
# rank) must stay at it.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


# Checks ------------------------------------------------------------------------------------------

def _check_keys(values: dict) -> None:
    known = [f.name for f in dataclasses.fields(TrainConfig)]
    for key in values:
        if key in RENAMED_SETTINGS:  # given with its name now too (a file), or in Python
            raise ConfigError(key, values[key], f"is now {RENAMED_SETTINGS[key]}"
                              + (f" (given too: {values[RENAMED_SETTINGS[key]]!r}); keep one"
                                 if RENAMED_SETTINGS[key] in values else ""))
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
