"""Tiny Llama checkpoints on disk for the weight and parity tests.

:func:`write_gguf` writes a GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` does for a Llama:
the hyperparameters as ``llama.*`` metadata, a byte-level BPE tokenizer, torch-layout tensors
under llama.cpp's names, ``attn_q``/``attn_k`` rows permuted (:func:`llama_cpp_permute`, written
here from the converter's description rather than taken from effijax), optionally quantized.
"""

import math

import gguf
import numpy as np

from effijax.interop import TENSORS
from effijax.models import format_of

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# A few merges over the byte alphabet: "Ġt", "he", "Ġthe", "in", "Ġ1" (never used under the
# smollm split: digits are isolated first).
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ 1"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def byte_alphabet():
    """GPT-2's bytes_to_unicode, in byte order."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def vocabulary():
    """(tokens, token types, merges): 3 specials, the 256 bytes, one token per merge."""
    tokens = SPECIALS + byte_alphabet() + [m.replace(" ", "") for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, MERGES


VOCAB_SIZE = len(vocabulary()[0])  # 264


def chat_tokenizer():
    """The tiny vocabulary as SmolLM-style byte-level BPE with :data:`CHAT_TEMPLATE`: BOS is
    ``<|im_start|>``, EOS and padding ``<|im_end|>``."""
    from effijax.models import byte_level_bpe

    tokens, types, merges = vocabulary()
    return byte_level_bpe(tokens, merges, pre="smollm", token_types=types, bos_id=1, eos_id=2,
                          pad_id=2, chat_template=CHAT_TEMPLATE)


def sharp_params(model, seed: int = 5):
    """``model``'s parameters from ``seed`` with every matrix scaled by 4: sharp softmaxes, so
    that a tiny model's greedy continuations vary with the context (the harness tests)."""
    import jax

    return jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x,
                        model.init_params(jax.random.key(seed)))


def write_qa(path, n=40):
    """``n`` chat / instruction records as JSONL: odd ones prompt/response, even ones
    messages, each a sum with its answer."""
    import json

    with open(path, "w") as f:
        for i in range(n):
            record = ({"prompt": f"{i}+1", "response": f"{i + 1}"} if i % 2 else
                      {"messages": [{"role": "user", "content": f"{i}+2"},
                                    {"role": "assistant", "content": f"{i + 2}"}]})
            f.write(json.dumps(record) + "\n")


def write_sum_prompts(path, n=16):
    """``n`` GRPO prompt records as JSONL: a sum and its ``answer`` column, the odd prompts as
    text, the even ones as chat messages."""
    import json

    with open(path, "w") as f:
        for i in range(n):
            prompt = f"{i}+1" if i % 2 else [{"role": "user", "content": f"{i}+1"}]
            f.write(json.dumps({"prompt": prompt, "answer": str(i + 1)}) + "\n")


def llama_cpp_permute(w, n_head, n_head_kv=None):
    """convert_hf_to_gguf.py's LlamaModel.permute: per head, rotary halves interleaved."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama_cpp_rope_freqs(head_dim, theta, factor, low, high, original):
    """convert_hf_to_gguf.py's LlamaModel ``rope_freqs.weight`` for Llama 3's scaling: the
    frequencies in f32, each one's divisor from Python floats, stored f32."""
    freqs = 1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32)
                                         / np.float32(head_dim)))
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def torch_tensors(model, params):
    """``{hf name: (path, torch-layout f32 array)}`` of a model's parameters."""
    out = {}
    for path, (hf, _) in TENSORS.items():
        node = params
        for part in path.split("/"):
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                break
        if node is None:
            continue
        w = np.asarray(node, np.float32)
        layers = range(model.n_layers) if path.startswith("layers/") else [None]
        for layer in layers:
            x = w if layer is None else w[layer]
            out[hf.format(i=layer)] = (path, np.ascontiguousarray(x.T if x.ndim == 2 and
                                                                  path.endswith("kernel") else x))
    return out


def write_tokenizer_gguf(path, values: dict, architecture: str = "llama"):
    """Writes a GGUF holding only ``tokenizer.ggml.*`` metadata: ``values`` maps each key (the
    prefix left out) to a (value, type, item type) tuple; a None value leaves the key out."""
    writer = gguf.GGUFWriter(str(path), architecture)
    for key, (value, kind, item) in values.items():
        if value is not None:
            writer.add_key_value(f"tokenizer.ggml.{key}", value, kind, item)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gguf(file, model, params, *, pre="smollm", qtype=None, drop=(), extra=None,
               reshape=None, architecture="llama", permuted=True, qtypes=None, raw=None,
               fields=None):
    """Writes ``model`` with ``params`` as a llama.cpp-style GGUF file.

    Args:
      qtype: a ``gguf.GGMLQuantizationType`` for the matrices (norms stay F32), or None (F32);
        qtypes: ``{GGUF name: type}`` for single tensors (a llama.cpp Q4_K_M file mixes types);
        raw: ``{GGUF name: (type, uint8 rows)}`` written as they are (types the gguf package
        does not quantize, e.g. the K-quants).
      drop: GGUF tensor names to leave out; extra: ``{name: array}`` to add; reshape:
        ``{name: shape}`` to write a tensor with the wrong shape (for error tests).
      architecture: ``general.architecture`` and the metadata keys' prefix; permuted: Q/K rows
        in llama.cpp's Llama order (its converter leaves Qwen2's in Hugging Face's order).
      fields: more metadata, ``{key: (value, gguf.GGUFValueType)}``.
    """
    writer = gguf.GGUFWriter(str(file), architecture)
    writer.add_name("tiny-llama")
    writer.add_context_length(model.max_position)
    writer.add_embedding_length(model.d_model)
    writer.add_block_count(model.n_layers)
    writer.add_feed_forward_length(model.d_ff)
    writer.add_head_count(model.n_heads)
    writer.add_head_count_kv(model.n_kv_heads)
    writer.add_rope_freq_base(model.rope_theta)
    writer.add_layer_norm_rms_eps(model.rms_eps)
    writer.add_rope_dimension_count(model.head_dim)
    writer.add_vocab_size(model.vocab_size)
    tokens, types, merges = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, (value, kind) in (fields or {}).items():
        writer.add_key_value(key, value, kind)
    # The family's own table: a Hugging Face name may have another GGUF name in another family
    # (Gemma 3's post_attention_layernorm is its post_attention_norm, the Llama's ffn_norm).
    names = {hf.format(i=i): gg.format(i=i) for hf, gg in format_of(model).tensors.values()
             for i in range(model.n_layers)}
    for hf, (_, w) in torch_tensors(model, params).items():
        name = names[hf]
        if name in drop:
            continue
        if not permuted:
            pass
        elif hf.endswith("self_attn.q_proj.weight"):
            w = llama_cpp_permute(w, model.n_heads, model.n_heads)
        elif hf.endswith("self_attn.k_proj.weight"):
            w = llama_cpp_permute(w, model.n_heads, model.n_kv_heads)
        if reshape and name in reshape:
            w = np.resize(w, reshape[name])
        kind = (qtypes or {}).get(name, qtype)
        if raw and name in raw:
            writer.add_tensor(name, raw[name][1], raw_dtype=raw[name][0])
        elif kind is not None and w.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, w)
    for name, w in (extra or {}).items():
        writer.add_tensor(name, np.asarray(w, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
