"""A tiny SentencePiece vocabulary of Gemma's kind, written as a GGUF file the way llama.cpp's
converter writes one (``tokenizer.ggml.model = 'llama'``: tokens, scores, token types, no
merges), for the tokenizer tests and the hostile-file tests.

Control tokens first, then the 256 byte-fallback tokens ``<0x00>``..``<0xFF>``, user-defined
tokens (newline runs, space runs spelled with real spaces as Gemma's file does, a tab, a tag),
then normal tokens scored by rank (``-position``), as SentencePiece's BPE trainer scores them.
"""

import gguf
from _llama_files import write_tokenizer_gguf

CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>"]  # ids 0..3: pad, eos, bos, unk as in Gemma 3
TURNS = ["<start_of_turn>", "<end_of_turn>"]  # control tokens after the bytes
BYTES = [f"<0x{b:02X}>" for b in range(256)]
SPACES = ["  ", "   ", "    "]  # user-defined runs of spaces (Gemma's: 2 to 31)
USER = ["\n", "\n\n", "\t", "<tool>"]  # user-defined, matched whole in the text
NORMAL = ["▁", "a", "b", "c", "ab", "bc", "t", "h", "e", "he", "th", "▁t", "the", "▁the", "▁a",
          "x", "▁x", "=", "▁=", "(", ")", "1", "2", "12", "中", "文", "中文", "é", "'"]
# llama.cpp's token types.
TYPES = {"normal": 1, "unknown": 2, "control": 3, "user": 4, "byte": 6}


def vocabulary(*, spaces: bool = True):
    """``(tokens, scores, types)``; ``spaces=False`` leaves the space runs out."""
    user = USER + (SPACES if spaces else [])
    tokens = CONTROL + TURNS + BYTES + user + NORMAL
    types = ([TYPES["control"]] * (len(CONTROL) + len(TURNS)) + [TYPES["byte"]] * len(BYTES)
             + [TYPES["user"]] * len(user) + [TYPES["normal"]] * len(NORMAL))
    scores = ([-1000.0] * (len(CONTROL) + len(TURNS)) + [0.0] * len(BYTES)
              + [-1000.0] * len(user) + [-float(i) for i in range(len(NORMAL))])
    return tokens, scores, types


def write_sentencepiece_gguf(path, *, architecture="gemma3", tokens=None, scores=None,
                             types=None, add_space_prefix=False, add_bos=True, fields=None):
    """Writes a GGUF holding only tokenizer metadata; ``fields`` replaces or adds keys
    (``tokenizer.ggml.`` prefix left out; a (value, type, item type) tuple each)."""
    default_tokens, default_scores, default_types = vocabulary()
    array, string = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING
    u32, f32, boolean = (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32,
                         gguf.GGUFValueType.BOOL)
    values = {"model": ("llama", string, None), "pre": ("default", string, None),
              "tokens": (tokens or default_tokens, array, string),
              "scores": (scores or default_scores, array, f32),
              "token_type": (types or default_types, array, gguf.GGUFValueType.INT32),
              "bos_token_id": (2, u32, None), "eos_token_id": (1, u32, None),
              "unknown_token_id": (3, u32, None), "padding_token_id": (0, u32, None),
              "add_bos_token": (add_bos, boolean, None), "add_eos_token": (False, boolean, None),
              "add_space_prefix": (add_space_prefix, boolean, None), **(fields or {})}
    return write_tokenizer_gguf(path, values, architecture)
