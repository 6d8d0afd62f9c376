"""Preference pairs the objective tests train on: ``write_pairs(path, n)`` writes ``n``
``{"prompt", "chosen", "rejected"}`` records (``"i+1"``: ``"i + 1"`` chosen, ``"the i"``
rejected) as JSONL."""

import json


def write_pairs(path, n: int = 40) -> None:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"{i}+1", "chosen": f"{i + 1}",
                                "rejected": f"the {i}"}) + "\n")
