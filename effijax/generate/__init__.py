"""Text generation with a key/value cache: the library behind ``effijax generate``.

:func:`generate` continues token ids with any model whose family decodes with a cache (the
Llama family, the GPT): one compiled prefill, one compiled decode step, greedy or temperature /
top-p sampling with a seed, stopping at end-of-sequence; one prompt or a batch of prompts of
different lengths (left-padded, each row computing what its prompt alone computes); base models
and base + LoRA adapters (applied factored, never merged). :func:`load` opens what
``--from`` names (a run directory, a GGUF file, a Hugging Face directory, or ``smollm2``)
as a :class:`Loaded` model with its tokenizer; :meth:`Loaded.complete` goes from text to text
(:meth:`Loaded.complete_batch` for several texts), through the chat template for chat models.
:func:`rollout` samples ``G`` completions per prompt for RL (GRPO) on the parameters as they
are, and :func:`rollout_batch` / :func:`make_completion_logps` score them teacher-forced.

Example:
  >>> import jax
  >>> from effijax.models import llama_config
  >>> model = llama_config("llama-tiny")
  >>> params = model.init_params(jax.random.key(0))
  >>> out = generate(model, params, [1, 2, 3], max_new_tokens=4)
  >>> out.tokens.shape
  (1, 4)
  >>> out = generate(model, params, [[1, 2, 3], [4, 5]], max_new_tokens=4)
  >>> [row.shape for row in out.outputs], out.prompt_lengths.tolist()
  ([(4,), (4,)], [3, 2])
"""

from effijax._lazy import attach

# Each name is imported from its module on first use (the package convention, see
# effijax/_lazy.py): importing the package costs only what is used.
__getattr__, __dir__, __all__ = attach(__name__, {
    "effijax.generate._generate": ("CACHE_BUCKET", "PROMPT_BUCKET", "Generation", "generate"),
    "effijax.generate._limits": ("MAX_PROMPTS", "check_prompt_count"),
    "effijax.generate._load": ("Completion", "Loaded", "load"),
    "effijax.generate._rollout": ("Rollout", "make_completion_logps", "rollout",
        "rollout_batch", "rollout_metrics", "rollout_cache_bytes"),
    "effijax.generate._sample": ("sample", "top_p_mask"),
})
