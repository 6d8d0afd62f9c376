"""A pretrained base compared by content: what a resume and whoever opens a finished LoRA run's
base check (adapters fit only the weights they were trained with).
"""

from __future__ import annotations

__all__ = ["compared_origin", "short_digest", "weight_file_changes", "base_changes"]


def short_digest(value) -> str:
    """A SHA-256 shortened for a message.

    Example:
      >>> short_digest("ab" * 32), short_digest(None)
      ('abababababab..', 'none')
    """
    return "none" if value is None else f"{value[:12]}.."


def weight_file_changes(old: dict, now: dict) -> list[str]:
    """Which weight files changed, which the run read and this one does not, and back."""
    parts = [f"{name} (sha256 {short_digest(old[name])} -> {short_digest(now[name])})"
             for name in sorted(old.keys() & now.keys()) if old[name] != now[name]]
    parts += [f"{name} (read by the run, not now)" for name in sorted(old.keys() - now.keys())]
    parts += [f"{name} (not read by the run)" for name in sorted(now.keys() - old.keys())]
    return parts


def compared_origin(origin):
    """What a run started from, as compared: an earlier run's directory and step; a pretrained
    model's content (``sha256``), not where it lay.

    Example:
      >>> compared_origin({"path": "/a/m.gguf", "sha256": "ab"}), compared_origin({"run": "r"})
      ({'sha256': 'ab'}, {'run': 'r'})
    """
    if isinstance(origin, dict) and "path" in origin:
        return {k: v for k, v in origin.items() if k != "path"}
    return origin


def base_changes(recorded: dict, current: dict) -> list[str]:
    """How the pretrained model read now differs from the one a run recorded, in words: for
    whoever opens a finished run's base (its adapters fit that content only). Compared as a
    resume compares what a run started from (by content, not place: ``sha256``); said file by
    file (as a resume says it) when the same files were read. An empty list: the same content.

    Args:
      recorded: the run's ``run`` record (``init_from_checkpoint``, ``weights``).
      current: the same two keys for the model read now (its path, combined and per-file
        SHA-256, as :func:`~effijax.sources.read_pretrained` computes them).

    Example:
      >>> run = {"init_from_checkpoint": {"path": "/a/m.gguf", "sha256": "12" * 32},
      ...        "weights": {"m.gguf": "12" * 32}}
      >>> base_changes(run, {"init_from_checkpoint": {"path": "/b/copy.gguf", "sha256": "12" * 32},
      ...                    "weights": {"copy.gguf": "12" * 32}})
      []
      >>> base_changes(run, {"init_from_checkpoint": {"path": "/a/m.gguf", "sha256": "ab" * 32},
      ...                    "weights": {"m.gguf": "ab" * 32}})
      ['m.gguf (sha256 121212121212.. -> abababababab..)']
      >>> base_changes(run, {"init_from_checkpoint": {"path": "/b/n.gguf", "sha256": "ab" * 32},
      ...                    "weights": {"n.gguf": "ab" * 32}})
      ['sha256 121212121212.. -> abababababab..']
    """
    old, now = (compared_origin(r.get("init_from_checkpoint")) or {} for r in (recorded, current))
    if old == now:
        return []
    a, b = recorded.get("weights"), current.get("weights")
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return weight_file_changes(a, b)
    return [f"sha256 {short_digest(old.get('sha256'))} -> {short_digest(now.get('sha256'))}"]
