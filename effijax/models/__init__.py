"""Language models and the interface the training recipe talks to.

:class:`LanguageModel` is the interface (parameters, loss, logits, partition rules, default LoRA
targets, the memory formulas' numbers, the tokenizer); a family implements it on its frozen
architecture config and registers with :func:`register_family`. The GPT is the first family:
``gpt_config("mini")`` is a model, ``model.init_params(key, policy)`` its parameters and
``model.loss_fn()(params, batch, rng)`` its loss. The Llama family (``llama_config("llama-tiny")``,
``"smollm2-135m"``, ...) is the second, Qwen2 (``qwen2_config("qwen2-tiny")``, the Llama's
layer with q/k/v biases) the third, Mistral (``mistral_config("mistral-tiny")``, the Llama with a
sliding attention window) the fourth, Gemma 3 (``gemma3_config("gemma3-tiny")``: sandwich
norms, GeGLU, query/key norms, local and global layers with their own rotary bases) the fifth;
their pretrained weights and :class:`Tokenizer` come from GGUF files and Hugging Face
directories through :mod:`effijax.interop`. All are built on one decoder skeleton
(``effijax.models._decoder``: the config plumbing, the module's forward and decode passes,
self-attention, the pre-norm block; its docstring says how to add a family), so a family file
holds only its layer, norm, MLP, attention variant, positions and weight names.
The functional API (``abstract_split``, ``make_loss_fn``, ...) stays for code that works with a
graphdef directly.
Parameters are plain nested dicts whose '/'-joined paths (``blocks/attn/q/kernel``) are what
precision overrides, sharding rules and LoRA targets match.
"""

# The one package that imports its modules at once, against the lazy convention of the others
# (effijax/_lazy.py): each family registers itself in FAMILIES when its module is imported, and
# model_from_dict / preset must find every family whichever name was imported first.
from effijax.models._attention import (
    ATTENTION,
    AttentionChoice,
    AttentionFallbackWarning,
    attend,
    auto_attend,
    choose_attention,
    keeps_scores,
    segment_mask,
    xla_attend,
)
from effijax.models._backend import attention_backend, target_backend
from effijax.models._blockwise import blockwise_attend, default_block_size
from effijax.models._cache import KVCache, cached_attend, make_decode, split_layers
from effijax.models._gpt import (
    GPT,
    PRESETS,
    REMAT,
    GPTConfig,
    abstract_params,
    abstract_split,
    gpt_config,
    init_params,
    make_apply,
    make_loss_fn,
    param_count,
    split_params,
)
from effijax.models._head import (
    head_sequence_logps,
    head_token_logps,
    make_sequence_logps,
    make_token_logps,
)
from effijax.models._interface import (
    FAMILIES,
    PRETRAINED,
    LanguageModel,
    ModelShape,
    PretrainedFormat,
    format_of,
    model_from_dict,
    preset,
    preset_names,
    pretrained_format,
    register_family,
    register_pretrained,
)
from effijax.models._layers import segment_positions
from effijax.models._llama import LLAMA_PRESETS, Llama, LlamaConfig, llama_config
from effijax.models._mistral import MISTRAL_PRESETS, Mistral, MistralConfig, mistral_config
from effijax.models._qwen2 import QWEN2_PRESETS, Qwen2, Qwen2Config, qwen2_config
from effijax.models._ring import (
    CONTEXT_VARIANTS,
    DEFAULT_CONTEXT_VARIANT,
    context_attend,
    from_load_balanced,
    to_load_balanced,
)
from effijax.models._rotary import llama3_scaling, rope_factors
from effijax.models._sentencepiece import sentencepiece_bpe
from effijax.models._tokenizer import (
    PRE_TOKENIZERS,
    Tokenizer,
    byte_level_bpe,
    read_chat_template,
)

# Families register in import order, the order preset_names() lists them in (the GPT's first):
# Gemma 3 after the others, whatever the alphabet says.
# isort: off
from effijax.models._gemma3 import GEMMA3_PRESETS, Gemma3, Gemma3Config, gemma3_config
# isort: on

__all__ = [
    "LanguageModel",
    "ModelShape",
    "FAMILIES",
    "register_family",
    "model_from_dict",
    "preset",
    "preset_names",
    "GPT",
    "GPTConfig",
    "gpt_config",
    "PRESETS",
    "param_count",
    "Llama",
    "LlamaConfig",
    "llama_config",
    "LLAMA_PRESETS",
    "rope_factors",
    "llama3_scaling",
    "Qwen2",
    "Qwen2Config",
    "qwen2_config",
    "QWEN2_PRESETS",
    "Mistral",
    "MistralConfig",
    "mistral_config",
    "MISTRAL_PRESETS",
    "Gemma3",
    "Gemma3Config",
    "gemma3_config",
    "GEMMA3_PRESETS",
    "PretrainedFormat",
    "PRETRAINED",
    "register_pretrained",
    "pretrained_format",
    "format_of",
    "Tokenizer",
    "byte_level_bpe",
    "read_chat_template",
    "sentencepiece_bpe",
    "PRE_TOKENIZERS",
    "attend",
    "blockwise_attend",
    "default_block_size",
    "xla_attend",
    "context_attend",
    "to_load_balanced",
    "from_load_balanced",
    "CONTEXT_VARIANTS",
    "DEFAULT_CONTEXT_VARIANT",
    "auto_attend",
    "choose_attention",
    "keeps_scores",
    "attention_backend",
    "target_backend",
    "segment_mask",
    "segment_positions",
    "AttentionChoice",
    "AttentionFallbackWarning",
    "ATTENTION",
    "REMAT",
    "split_params",
    "make_apply",
    "make_loss_fn",
    "make_sequence_logps",
    "head_sequence_logps",
    "make_token_logps",
    "head_token_logps",
    "KVCache",
    "make_decode",
    "cached_attend",
    "split_layers",
    "init_params",
    "abstract_params",
    "abstract_split",
]
