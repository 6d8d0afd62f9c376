"""The tensor types effijax writes to GGUF (:func:`~effijax.interop.save_gguf`), by the name a
user gives (``--export-gguf q8_0``). A module of its own, importing nothing: checking a run's
config must not import jax."""

__all__ = ["GGUF_DTYPES"]

#: name -> (``gguf.GGMLQuantizationType`` of the matrices, ``gguf.LlamaFileType`` of the file).
GGUF_DTYPES: dict[str, tuple[str, str]] = {
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q5_1": ("Q5_1", "MOSTLY_Q5_1"),
    "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
    "q4_1": ("Q4_1", "MOSTLY_Q4_1"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
}
