"""The folders the observers write into, inside a run directory: never a symbolic link.

TensorBoard's events go to ``OUT/tensorboard`` and the profiler's traces to ``OUT/profile``
(the profiler's writer adds ``plugins/profile/<time>/`` below it). A link planted at any of them
would send those writes to a file elsewhere, so it is refused in one line, as the run
directory's own files are (``effijax.recipe``'s ``refuse_planted``); the files inside are created
by their writers without following links.
"""

from __future__ import annotations

import os
from pathlib import Path

from effijax.errors import ConfigError

__all__ = ["own_folder"]


def own_folder(path: str | os.PathLike, inside: tuple[str, ...] = ()) -> Path:
    """``path`` as a folder to write into (created if missing), refused when it, one of the
    folders ``inside`` it (relative paths) or one of their entries is a symbolic link.

    Args:
      path: the folder, in a run directory (its parent).
      inside: folders below ``path`` that another writer creates and writes into; each entry
        of theirs is checked too (a link at a name that writer will pick).

    Raises:
      ConfigError: naming the link and where it points, and the fix (remove it).

    Example:
      >>> import os, tempfile, pathlib
      >>> out = pathlib.Path(tempfile.mkdtemp())
      >>> own_folder(out / "tensorboard").is_dir()
      True
      >>> os.symlink("/etc", out / "profile")
      >>> try:
      ...     own_folder(out / "profile")
      ... except ConfigError as e:
      ...     print(e.problem.split(";")[0])
      holds a symbolic link where effijax writes (profile -> /etc)
    """
    path = Path(path)
    candidates = [path]
    for sub in inside:
        candidates += [path / sub, *_entries(path / sub)]
    for candidate in candidates:
        if candidate.is_symlink():
            shown = candidate.relative_to(path.parent).as_posix()
            raise ConfigError("out", str(path.parent), f"holds a symbolic link where effijax "
                              f"writes ({shown} -> {os.readlink(candidate)}); effijax never "
                              "writes through links in a run directory: remove it")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _entries(folder: Path) -> list[Path]:
    """The entries of ``folder`` (none when it is missing, or is a link: checked itself)."""
    if folder.is_symlink() or not folder.is_dir():
        return []
    return list(folder.iterdir())
