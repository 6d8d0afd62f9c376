"""An lm-evaluation-harness model backed by effijax: :class:`EffijaxLM`, registered as ``effijax``.

The harness asks three kinds of questions, as lists of requests; :class:`EffijaxLM` answers each
list in batches of ``batch_size`` rows sorted longest first, padded into a few compiled shapes
(each batch's length rounded up to a power of two, :func:`sequence_bucket`; the batch always
full), and puts the answers back in the requests' order:

* ``loglikelihood`` (context, continuation): the continuation's summed log-probability and
  whether greedy decoding would have produced it, from the model's own scoring path
  (:func:`effijax.models.make_sequence_logps`, the fused head that DPO's log-probabilities
  come from), context and continuation tokenized as the harness's ``hf`` model does (the whole
  text encoded, the context's tokens split off; an empty context is the end-of-text token);
* ``loglikelihood_rolling`` (text): the text's log-probability in the harness's disjoint
  windows of ``max_length`` tokens (``lm_eval.utils.get_rolling_token_windows``), each window
  scored as a loglikelihood request;
* ``generate_until`` (context, generation settings): KV-cached generation
  (:func:`effijax.generate.generate`, greedy unless the task samples) for at most
  ``max_gen_toks`` tokens, stopped once every row of the batch has produced one of the task's
  ``until`` strings or its end of sequence, the text cut before the first stop string.

``apply_chat_template`` renders the harness's few-shot chat history with the model's own chat
template (``--apply_chat_template`` / ``simple_evaluate(apply_chat_template=True)``).

Any model effijax opens (:func:`effijax.generate.load`: a run directory, a LoRA run with its
base, a GGUF file, a Hugging Face directory, ``smollm2``) is one ``EffijaxLM(model_from)``;
one already in memory is ``EffijaxLM(loaded=Loaded(model, params, ...))``.

On a mesh (``mesh=effijax.sharding.make_mesh()``: the process's devices), scoring is data
parallel: each batch's rows are split over the mesh's ``("data", "fsdp")`` devices
(:func:`effijax.sharding.batch_sharding`; ``batch_size`` a multiple of their number).
Parameters already placed on that mesh (a training run's, FSDP-sharded or not) are used as they
are, no second copy; any others are replicated onto it. Generation runs with those parameters
as placed (its rows are not split: with replicated parameters every device decodes every row).

Several JAX processes (joined with :func:`effijax.distributed.initialize`): the mesh spans
every process's devices (default: ``make_mesh()`` over all of them) and every process is given
every request. Each batch, the same on every process, is scored once across them: each
process's devices score their block of its rows, and the answers are gathered onto every
process (``multihost_utils.process_allgather``), so each process returns every answer and
``lm_eval.simple_evaluate`` the same results. The harness is told of one process (``rank`` 0,
``world_size`` 1): its own split, each rank a share of the documents, pads request counts (not
batches, which a mesh across processes needs in the same shapes on every process) and gathers
through ``torch.distributed``.

This module imports without ``lm_eval``; building the class's instances needs it.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from effijax.errors import NO_VALUE, ConfigError, whole_number

try:  # the harness is optional: without it the class exists and refuses to be built
    from lm_eval.api.model import TemplateLM as _Base
    from lm_eval.api.registry import register_model as _register
except ModuleNotFoundError:
    _Base, _register = object, None

__all__ = ["EffijaxLM", "LM_EVAL_PIN", "require_lm_eval", "sequence_bucket"]

#: What ``pip install`` needs for the harness (the ``eval`` extra of effijax).
LM_EVAL_PIN = "lm_eval>=0.4.8,<0.5"

# The shortest compiled length: short requests share one shape.
MIN_BUCKET = 16

# Generation settings the harness may pass that change nothing in greedy decoding here.
_IGNORED_GEN_KWARGS = ("top_k", "num_beams", "repetition_penalty")


def require_lm_eval(field: str = "tasks", value: Any = NO_VALUE) -> None:
    """Refuses to go on without lm-evaluation-harness, saying what to install.

    Example:
      >>> require_lm_eval()  # installed here: nothing to say
    """
    try:
        import lm_eval  # noqa: F401
    except ModuleNotFoundError:
        raise ConfigError(field, value, "evaluating harness tasks needs lm-evaluation-harness: "
                          f"pip install '{LM_EVAL_PIN}' (or pip install 'effijax[eval]')"
                          ) from None


def sequence_bucket(length: int, limit: int) -> int:
    """The compiled length for rows of ``length`` tokens: the next power of two, at least
    :data:`MIN_BUCKET`, at most ``limit`` (the model's context).

    Example:
      >>> [sequence_bucket(n, 2048) for n in (1, 16, 17, 100, 2000)]
      [16, 16, 32, 128, 2048]
      >>> sequence_bucket(90, 96)
      96
    """
    if length > limit:
        raise ValueError(f"sequence_bucket: {length} tokens exceed the limit {limit}")
    return min(max(MIN_BUCKET, 1 << max(0, length - 1).bit_length()), limit)


@functools.lru_cache(maxsize=8)
def _scorer(model, lora):
    """The jitted ``(params, batch) -> (logps_B, counts_B, greedy_B)`` of a model and adapter
    spec, kept: every :class:`EffijaxLM` of the model shares its compiled shapes."""
    import jax

    from effijax.models import abstract_split, make_sequence_logps

    graphdef, _ = abstract_split(model)
    return jax.jit(make_sequence_logps(graphdef, lora, greedy=True))


def _placed(params, mesh):
    """``params`` on ``mesh``: as they are when every array already lives there (a training
    run's shardings, no second copy), else replicated onto it; None: as they are."""
    if mesh is None:
        return params
    import jax

    from effijax.sharding import replicated

    leaves = jax.tree.leaves(params)
    if all(isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)
           and x.sharding.mesh == mesh for x in leaves):
        return params
    return jax.device_put(params, replicated(mesh))


def _gathered(x) -> np.ndarray:
    """``x`` on the host, whole: a batch's answers split over several processes' devices are
    gathered onto every process."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


class _Stopped(Exception):
    """Raised from generation's per-step hook once every row has stopped: ends the loop."""


class EffijaxLM(_Base):
    """An effijax model answering lm-evaluation-harness requests (see the module docstring).

    Args:
      model_from: what ``--from`` names (a run directory, a GGUF file, a Hugging Face
        directory, ``smollm2``); or give ``loaded``.
      loaded: an :class:`effijax.generate.Loaded` model already in memory.
      batch_size: rows per forward pass and prompts per generation batch.
      max_length: the longest row scored and the context plus generated tokens (default: the
        model's context, ``model.max_context``).
      max_gen_toks: tokens generated at most when a task does not say.
      precision: the precision policy of the forward passes (a preset's name).
      add_bos_token: whether text is encoded with the tokenizer's special tokens (default: as
        the tokenizer adds them, except to a text that starts with BOS already).
      mesh: a ``jax.sharding.Mesh`` from :func:`effijax.sharding.make_mesh` to score on, data
        parallel (see the module docstring); None: JAX's default device (several processes:
        ``make_mesh()``, every process's devices).
      device, max_batch_size: what ``lm_eval`` passes to every model it builds; ignored (JAX
        places the model on its default device, or ``mesh``; a batch is ``batch_size`` rows).

    Raises:
      ConfigError: ``lm_eval`` is not installed, a bad setting (a ``batch_size`` the mesh's
        data-parallel devices do not divide), or a model that cannot be opened.

    Example (with ``lm_eval`` installed)::

      import lm_eval
      from effijax.harness import EffijaxLM, task_manager
      lm = EffijaxLM("smollm2", batch_size=8)
      out = lm_eval.simple_evaluate(model=lm, tasks=["effijax_qa_choice"], limit=20,
                                    task_manager=task_manager())
    """

    def __init__(self, model_from: str | None = None, *, loaded: Any = None,
                 batch_size: int | str = 8, max_length: int | None = None,
                 max_gen_toks: int = 256, precision: str = "fp32",
                 add_bos_token: bool | None = None, mesh: Any = None,
                 device: str | None = None, max_batch_size: int | None = None) -> None:
        require_lm_eval("model", model_from)
        super().__init__()
        del device, max_batch_size  # JAX's default device; the batch is batch_size
        if isinstance(batch_size, str) and batch_size.isdigit():
            batch_size = int(batch_size)  # lm_eval's command line passes text
        if not isinstance(batch_size, int) or isinstance(batch_size, bool):
            raise ConfigError("batch_size", batch_size, "expected a whole number of rows (a "
                              "batch size chosen automatically is not supported)")
        whole_number("batch_size", batch_size)
        whole_number("max_gen_toks", max_gen_toks)
        whole_number("max_length", max_length, minimum=2, none=True)
        if (model_from is None) == (loaded is None):
            raise ConfigError("model_from", model_from, "give either model_from (what --from "
                              "names) or loaded (a model in memory), not both or neither")
        import jax

        from effijax.generate import load
        from effijax.precision import get_policy

        try:  # a bad name refused before the model is read
            policy = get_policy(precision)
        except ConfigError as e:
            raise e.renamed("precision") from None
        if mesh is None and jax.process_count() > 1:  # data parallel across the processes
            from effijax.sharding import make_mesh

            mesh = make_mesh()
        if mesh is not None:  # a batch the mesh cannot split, refused before the model is read
            from effijax.sharding import check_batch

            check_batch(batch_size, mesh)

        self.loaded = load(model_from) if loaded is None else loaded
        model = self.loaded.model
        self.batch_size = batch_size
        self._max_length = max_length or model.max_context
        if self._max_length > model.max_context:
            raise ConfigError("max_length", self._max_length, f"exceeds the model's context "
                              f"({model.max_context} tokens)")
        self.max_gen_toks = max_gen_toks
        self.add_bos_token = add_bos_token
        self.precision = precision
        self.mesh = mesh
        self.params = _placed(policy.cast_to_compute(self.loaded.params), mesh)
        self._score = _scorer(model, self.loaded.lora)

    # How lm_eval builds a model from ``--model_args from=...``: ``from`` is ``model_from``.
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        require_lm_eval("model_args")
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        args = {("model_from" if k in ("from", "pretrained") else k): v
                for k, v in arg_dict.items()}
        args |= {k: v for k, v in (additional_config or {}).items() if v is not None}
        known = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        unknown = sorted(set(args) - set(known))
        if unknown:
            raise ConfigError("model_args", ",".join(unknown), "not settings of the effijax "
                              f"model; it takes from (or model_from), {', '.join(known[1:])}")
        return cls(**args)

    # Tokens ---------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        """The model's :class:`~effijax.models.Tokenizer` (None: UTF-8 bytes)."""
        return self.loaded.tokenizer

    @property
    def eot_token_id(self) -> int:
        """The end-of-sequence id (as the ``hf`` model's; a tokenizer without one: its
        end-of-text token); a byte model's is 0."""
        if self.tokenizer is None:
            return 0
        if self.tokenizer.eos_id is not None:
            return self.tokenizer.eos_id
        from effijax.data import end_of_text_id

        return end_of_text_id(self.tokenizer)

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and the first rolling window are read after: BOS, else the
        end of sequence (as the ``hf`` model's)."""
        bos = None if self.tokenizer is None else self.tokenizer.bos_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        """What fingerprints the harness's request cache: the model's source and tokenizer."""
        tok = "bytes" if self.tokenizer is None else self.tokenizer.fingerprint()
        return f"{self.loaded.source or self.loaded.model.name}-{tok}".replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The model's chat template (None when not asked for or when there is none)."""
        if not chat_template or self.tokenizer is None:
            return None
        return self.tokenizer.chat_template

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The harness's chat history rendered with the model's chat template."""
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise ConfigError("apply_chat_template", True, f"{self.loaded.source or 'the model'}"
                              " has no chat template (a base model); evaluate without it")
        return self.tokenizer.apply_chat_template(chat_history,
                                                  add_generation_prompt=add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs) -> list[int]:
        """Token ids of ``string``, special tokens added as the ``hf`` model adds them."""
        if self.tokenizer is None:
            ids = list(string.encode("utf-8"))
        else:
            add = add_special_tokens
            if add is None:
                bos = self.tokenizer.token(self.tokenizer.bos_id)
                add = (self.add_bos_token if self.add_bos_token is not None else True) and \
                    not (bos and string.startswith(bos))
            ids = self.tokenizer.encode(string, add_special_tokens=add).tolist()
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = np.asarray(ids, np.int64).reshape(-1)
        if self.tokenizer is None:
            return bytes(ids.astype(np.uint8).tolist()).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # Log-likelihoods --------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                              ) -> list[tuple[float, bool]]:
        """``[(logp, is_greedy)]`` of ``[(texts, context ids, continuation ids)]``, in order."""
        rows = []
        for _, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self._max_length + 1):]
            rows.append((np.asarray(whole, np.int32), min(len(continuation), len(whole) - 1)))
        logps, greedy = self._score_rows(rows)
        out = [(float(lp), bool(g)) for lp, g in zip(logps, greedy, strict=True)]
        for (texts, _, _), answer in zip(requests, out, strict=True):
            if texts is not None and texts[0] is not None:
                self.cache_hook.add_partial("loglikelihood", texts, answer)
        return out

    def _score_rows(self, rows: Sequence[tuple[np.ndarray, int]]):
        """Each row's (tokens, continuation length) scored: the f32 log-probability of its last
        tokens and whether each was the argmax, in batches sorted longest first."""
        n = len(rows)
        logps, greedy = np.zeros(n, np.float64), np.ones(n, bool)
        order = sorted(range(n), key=lambda i: (-rows[i][0].size, i))
        b = self.batch_size
        for start in range(0, n, b):
            chunk = order[start:start + b]
            width = sequence_bucket(max(rows[i][0].size - 1 for i in chunk), self._max_length)
            inputs_BS = np.zeros((b, width), np.int32)
            targets_BS = np.zeros((b, width), np.int32)
            mask_BS = np.zeros((b, width), bool)
            for r, i in enumerate(chunk):
                tokens, scored = rows[i]
                length = tokens.size - 1
                inputs_BS[r, :length], targets_BS[r, :length] = tokens[:-1], tokens[1:]
                mask_BS[r, length - scored:length] = True
            batch = {"inputs": inputs_BS, "targets": targets_BS, "mask": mask_BS}
            if self.mesh is not None:  # data parallel: each device scores its rows
                import jax

                from effijax.sharding import batch_sharding

                batch = jax.device_put(batch, batch_sharding(self.mesh))
            lp_B, _, greedy_B = self._score(self.params, batch)
            lp_B, greedy_B = _gathered(lp_B), _gathered(greedy_B)
            for r, i in enumerate(chunk):
                logps[i], greedy[i] = lp_B[r], greedy_B[r]
        return logps, greedy

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-probability over the harness's disjoint windows of ``max_length``
        tokens, the first predicted from :attr:`prefix_token_id`."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self._max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(i)
        scores = self._loglikelihood_tokens(windows)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, scores, strict=True):
            totals[i] += logp
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # Generation -------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation up to its first stop string (see the module
        docstring); requests with the same settings run together, longest first."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        eos_text = None if self.tokenizer is None else self.tok_decode(
            [self.eot_token_id], skip_special_tokens=False)
        out: list[str | None] = [None] * len(requests)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            new = int(kwargs.pop("max_gen_toks"))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            sampling = {"temperature": temperature if kwargs.pop("do_sample", False) else 0.0,
                        "top_p": float(kwargs.pop("top_p", 1.0) or 1.0),
                        "seed": int(kwargs.pop("seed", 0) or 0)}
            unknown = sorted(k for k in kwargs if k not in _IGNORED_GEN_KWARGS)
            if unknown:
                raise ConfigError("gen_kwargs", unknown, "settings effijax's generation does "
                                  "not take; it takes until, max_gen_toks, do_sample, "
                                  "temperature, top_p, seed")
            if new >= self._max_length:
                raise ConfigError("max_gen_toks", new, f"leaves no room for a prompt in "
                                  f"max_length={self._max_length}")
            prompts = {i: self.tok_encode(requests[i].args[0],
                                          left_truncate_len=self._max_length - new)
                       for i in members}
            order = sorted(members, key=lambda i: (-len(prompts[i]), i))
            for start in range(0, len(order), self.batch_size):
                chunk = order[start:start + self.batch_size]
                texts = self._generate([prompts[i] for i in chunk], new, until, sampling)
                for i, text in zip(chunk, texts, strict=True):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    def _stop_ids(self) -> tuple[int, ...]:
        """End of sequence, and the token a chat template closes a turn with."""
        if self.tokenizer is None:
            return ()
        from effijax.data import turn_end_id

        ends = {self.tokenizer.eos_id, turn_end_id(self.tokenizer)} - {None}
        return tuple(sorted(ends))

    def _generate(self, prompts: list[list[int]], new: int, until: list[str],
                  sampling: dict) -> list[str]:
        """One batch of prompts continued (filled to ``batch_size`` rows with copies of the
        last, so that every batch has one shape), each text cut before its first stop."""
        from lm_eval.models.utils import postprocess_generated_text

        from effijax.generate import generate

        real = len(prompts)
        ids = [np.asarray(p or [self.prefix_token_id], np.int32) for p in prompts]
        ids += [ids[-1]] * (self.batch_size - real)
        stops = self._stop_ids()
        steps: list[np.ndarray] = []
        done = np.zeros(self.batch_size, bool)
        done[real:] = True

        def watch(tokens_B):  # after each step: stop once every real row has stopped
            steps.append(np.asarray(tokens_B))
            row_tokens = np.stack(steps, axis=1)
            for r in np.flatnonzero(~done):
                if np.isin(row_tokens[r], stops).any() or any(
                        s and s in self.tok_decode(row_tokens[r]) for s in until):
                    done[r] = True
            if done.all():
                raise _Stopped

        try:
            generate(self.loaded.model, self.params, ids, max_new_tokens=new,
                     eos_id=stops or None, lora=self.loaded.lora, on_tokens=watch, **sampling)
        except _Stopped:
            pass
        tokens_BN = np.stack(steps, axis=1)
        texts = []
        for r in range(real):
            row = tokens_BN[r]
            ends = np.flatnonzero(np.isin(row, stops)) if stops else np.array([], int)
            row = row[:ends[0]] if ends.size else row
            texts.append(postprocess_generated_text(self.tok_decode(row), until, None))
        return texts


if _register is not None:  # lm_eval.simple_evaluate(model="effijax", ...) finds it by name
    _register("effijax")(EffijaxLM)
