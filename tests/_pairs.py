"""Preference pairs the objective tests train on: ``write_pairs(path, n)`` writes ``n``
``{"prompt", "chosen", "rejected"}`` records (``"i+1"``: ``"i + 1"`` chosen, ``"the i"``
rejected) as JSONL; ``write_model_and_pairs(directory, model)`` writes a tiny model's GGUF
beside them."""

import json


def write_pairs(path, n: int = 40) -> None:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"{i}+1", "chosen": f"{i + 1}",
                                "rejected": f"the {i}"}) + "\n")


def write_model_and_pairs(directory, model):
    """``directory`` with ``tiny.gguf`` (``model``'s weights from seed 0) and ``pairs.jsonl``."""
    import jax
    from _llama_files import write_gguf

    write_gguf(directory / "tiny.gguf", model, jax.jit(model.init_params)(jax.random.key(0)))
    write_pairs(directory / "pairs.jsonl")
    return directory
