"""The run directory stage: lock it, restore its newest intact step, open its checkpoints.

:func:`open_run` does it in this order, every process agreeing at each step: a directory that
already holds this run finished is recognised from the step's metadata alone (nothing touched);
otherwise process 0 locks the directory, the newest intact checkpoint is restored (its settings
checked against the run's, :mod:`effijax.recipe._identity`), damaged newer steps are set aside,
the storage is checked for room, and the checkpointer opens. The result is a :class:`RunStart`
holding the :class:`~effijax.run.RunDir` (its lock and checkpointer).
"""

from __future__ import annotations

import datetime
import os
import stat
import sys
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from effijax import atomic, distributed
from effijax.checkpoint import LOCK_FILE, ROOM_FILE, latest_step, open_checkpoints
from effijax.errors import ConfigError
from effijax.provenance import library_versions
from effijax.recipe import _identity, _resume
from effijax.recipe._objective import COMPLETIONS
from effijax.recipe._report import summary_step
from effijax.recipe._sections import OutputSection, TrainingSection
from effijax.run import RunDir
from effijax.sources import missing_exports, state_bytes, storage

__all__ = ["RunStart", "run_record", "open_run", "refuse_planted"]


class RunStart(NamedTuple):
    """The run directory's side of a run, as :func:`open_run` found it.

    Attributes:
      dir: the :class:`~effijax.run.RunDir`, locked, with its checkpointer open (neither when
        ``finished``, or without checkpoints).
      run_json: the settings in effect and the run record (stored with every checkpoint).
      resume_step: the step restored (None: a fresh run).
      restored: the restored state (None: a fresh run, or a finished one).
      config_json: what ``config.json`` says: the settings, or on resume the run's original
        ``config.json`` with each resume's step and what it changed.
      finished: the directory already holds this run, trained to ``config.steps`` or past it
        (at step ``resume_step``): nothing is restored, opened or written.
    """

    dir: RunDir
    run_json: dict
    resume_step: int | None = None
    restored: Any = None
    config_json: dict | None = None
    finished: bool = False

    @property
    def record(self) -> dict:
        """The ``run`` record: model, sizes, data, devices, what the run started from."""
        return self.run_json["run"]


def run_record(job, origin: dict | None, data, weights: dict[str, str] | None = None, *,
               chat_template: str | None = None) -> dict:
    """The ``run`` record of ``config.json``: the model and its sizes, what it starts from
    (``origin``) and each pretrained weight file read (``weights``, ``{name: sha256}``), the
    data's size and fingerprint, the tokenizer's fingerprint, the devices; with
    ``chat_template`` (a ``--chat-template`` file's text), the template itself, which the run's
    tokenizer uses from then on (``effijax generate --chat``, exports) whatever becomes of the
    file.

    ``tokenizer_sha256`` is the tokenizer the data went through
    (:meth:`~effijax.models.Tokenizer.fingerprint`), its chat template included when the data
    is chat (rendered with it); None for a model without one (the byte GPT reads bytes).
    """
    tokenizer = getattr(job.model, "tokenizer", None)
    return {
        "model_config": job.model.to_dict(),
        "num_params": job.num_params,
        "trainable_params": job.trainable_params,
        "init_from_checkpoint": origin,
        "weights": weights,
        "corpus_tokens": int(data.tokens),
        "corpus_sha256": data.fingerprint,
        "tokenizer_sha256": None if tokenizer is None else tokenizer.fingerprint(
            chat_template=data.format == "chat"),
        "devices": [str(d) for d in jax.devices()],
        "process_count": jax.process_count(),
        **({} if chat_template is None else {"chat_template": chat_template}),
    }


def open_run(settings: dict, output: OutputSection, training: TrainingSection, job,
             record: dict) -> RunStart:
    """Locks the run directory ``output.out``, restores its newest intact checkpoint (checked
    against the job and the run's identity: ``settings``, the config's fields as
    ``config.json`` records them, and the ``run`` ``record``) and opens its checkpoints.

    A directory that already holds the run trained to ``training.steps`` (or past it) is checked
    like a resume, from the step's metadata alone: the same settings give a :class:`RunStart`
    with ``finished`` set and nothing read, opened or written; other settings are refused
    listing each difference, as a resume is.

    Raises:
      ConfigError: another run holds the directory; checkpoints of another model or optimizer,
        or of a run with other settings (each difference listed); no step restores; a
        malformed ``config.json``.
    """
    out = Path(output.out).resolve()
    run_json = {**settings, "run": record}
    _resume.agree(refuse_planted, out)  # before anything there is read, locked or written
    done = _finished(output, training, job, run_json, out / "checkpoints")
    if done is not None:  # the same run, trained this far: not even its lock is touched
        return RunStart(RunDir(output.out), run_json, done, finished=True)
    run_dir = RunDir(output.out, lock=_resume.lock(out))
    try:
        start = _restored(output, job, run_dir, run_json, out / "checkpoints")
        if output.checkpoints:
            run_dir.ckpt = _checkpointer(output, job, run_json, out / "checkpoints")
    except BaseException:
        run_dir.release()
        raise
    return start


def _checkpointer(output: OutputSection, job, run_json: dict, ckpt_dir: Path):
    """The run's checkpointer, once every process found room for ``output.keep`` states."""
    _resume.agree(storage, ckpt_dir, state_bytes(job.state), output.keep)
    return open_checkpoints(ckpt_dir, every=output.checkpoint_every, keep=output.keep,
                            metadata={"config": run_json, "versions": library_versions()})


def _restored(output: OutputSection, job, run_dir: RunDir, run_json: dict,
              ckpt_dir: Path) -> RunStart:
    """The newest intact step restored (a fresh start when there is none), damaged newer
    steps set aside once every process has read the directory."""
    start = RunStart(run_dir, run_json, config_json=run_json)
    bad = []
    if output.checkpoints:
        found, _ = _resume.restore(ckpt_dir, job, run_json, output.allowed_changes)
        bad = found.bad
        if found.step is None and bad:
            raise _resume.no_intact_step(ckpt_dir, bad)
        if found.step is not None:
            start = start._replace(resume_step=found.step, restored=found.state,
                                   config_json=_resumed_config(output.out, found, run_json))
    # Every process has read the directory (the restore) before any
    # process moves, creates or cleans up anything: their decisions agree.
    distributed.barrier("effijax:run-directory-read")
    if start.resume_step is not None and bad:
        _resume.set_aside_bad(ckpt_dir, bad, start.resume_step)
        distributed.barrier("effijax:damaged-steps-set-aside")
    return start


def _resumed_config(out: str, found, run_json: dict) -> dict:
    """``config.json`` of a resumed run in ``out``: the run's original settings (kept as
    written), and each resume's step and what it changed."""
    saved = found.record["metadata"]["config"]
    path = Path(out).resolve() / "config.json"
    original = _resume.read_run_json(path) if path.exists() else saved
    edited = _identity.edited(original, saved)
    if edited:  # the checkpoint is what the run is: config.json gets its record back
        if distributed.is_main():
            print(f"effijax train: warning: {path} says another run than its checkpoint of "
                  f"step {found.step} ({', '.join(edited)} differ: edited by hand?); the "
                  "checkpoint's record is what this run is, and config.json gets it back",
                  file=sys.stderr, flush=True)
        start = {k: v for k, v in (original.get("run") or {}).items() if k == "eval_loss_start"}
        original = {**saved, "run": {**saved.get("run", {}), **start},
                    "resumes": original.get("resumes", [])}
    resumes = [*original.get("resumes", []), {
        "step": found.step,
        "at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "changed": _identity.changed(saved, run_json)}]
    kept = {k: v for k, v in original.items() if k not in ("versions", "resumes")}
    return {**kept, "resumes": resumes}


def _finished(output: OutputSection, training: TrainingSection, job, run_json: dict,
              ckpt_dir: Path) -> int | None:
    """The step of this run, finished, in ``ckpt_dir``; None unless every process saw its end
    written (a multi-process run agrees before any process returns)."""
    if not output.checkpoints:
        return None
    done = _finished_step(output, training, job, run_json, ckpt_dir)
    if jax.process_count() > 1:
        seen = multihost_utils.process_allgather(np.int32(done is not None))
        done = done if bool(np.all(np.asarray(seen))) else None
    return done


def _finished_step(output: OutputSection, training: TrainingSection, job, run_json: dict,
                   ckpt_dir: Path) -> int | None:
    """The step of the finished run in ``ckpt_dir`` (trained to ``training.steps`` or past it)
    when its settings match, checked like a resume from the step's metadata alone; None when
    the run is not finished (or its newest finished step is damaged: it resumes instead).

    Raises:
      ConfigError: the finished run has other settings (each difference listed).
    """
    newest = latest_step(ckpt_dir)  # a look only: nothing is locked, opened or written
    if newest is None or newest < training.steps:
        return None
    try:
        found, _ = _resume.restore(ckpt_dir, job, run_json, output.allowed_changes,
                                   arrays=False)
    except ConfigError as e:
        if e.field != "resume":
            raise
        raise ConfigError("out", output.out, f"holds a run finished at step {newest} with "
                          "other settings: "
                          + e.problem.removeprefix("the run's settings changed: ")) from None
    if found.step is None or found.step < training.steps:
        return None
    # Finished means its end was written too: a run stopped after its last checkpoint (killed,
    # Ctrl-C in the final evaluation or export) resumes there and completes the end, and so
    # does a run asked now for an export it lacks.
    if missing_exports(output.out, lora=job.lora is not None, export_hf=training.export_hf,
                       export_gguf=training.export_gguf):
        return None
    return found.step if summary_step(output.out) == found.step else None


# The harness's scores of a run with --eval-tasks, one record each time it scores (metrics.jsonl
# keeps one record a step).
TASK_SCORES = "task_scores.jsonl"
# What a run writes in a run directory, by how: files written in place (appended to, the
# lock), files written under a temporary name and renamed over the old one, and folders.
_IN_PLACE = (LOCK_FILE, "metrics.jsonl", "error.log", "orbax.log", ROOM_FILE, COMPLETIONS,
             TASK_SCORES)
_RENAMED = ("config.json", "summary.json", "loss.png", "metrics.jsonl", "adapters.safetensors",
            "model.gguf", COMPLETIONS, TASK_SCORES)
_FOLDERS = ("checkpoints", "hf", "peft")  # the observers' own: effijax.observe checks them
# The exports a run replaces at its end: in a directory that holds no run yet, they are not
# the run's own, and replacing them would lose the user's files.
_EXPORTS = ("hf", "peft", "adapters.safetensors", "model.gguf")
_KIND = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device",
         stat.S_IFBLK: "a device", stat.S_IFDIR: "a folder", stat.S_IFREG: "a file"}


def _planted(path: Path, folder: bool, in_place: bool) -> str | None:
    """What is wrong with the entry at ``path`` (a link, the wrong kind, a second name of a file
    elsewhere), or None: missing, or what effijax would have written there. A link at a file
    that is replaced by a rename (``in_place`` false) is replaced, never followed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return (f"{path.name} -> {os.readlink(path)} (a symbolic link)"
                if in_place or folder else None)
    kind = _KIND.get(stat.S_IFMT(st.st_mode), "a special file")
    if folder != stat.S_ISDIR(st.st_mode) or kind not in ("a file", "a folder"):
        return f"{path.name} ({kind}, where effijax writes {'a folder' if folder else 'a file'})"
    if in_place and st.st_nlink > 1:  # writing in place would change the file's other names
        return f"{path.name} (a file with {st.st_nlink} names: hard links to it are elsewhere)"
    return None


def refuse_planted(out: Path) -> None:
    """Refuses a run directory holding, where effijax writes, what effijax never puts there: a
    symbolic link (at a file written in place, a folder or a checkpoint step; a link at a file
    replaced by a rename is replaced, never followed), a pipe, socket or device, a file
    with other names (a hard link written in place would change them too), or, in a directory
    that holds no run yet, an export (``hf/``, ``peft/``, ``model.gguf``) the run would replace.
    Only looks: nothing is opened, so nothing can block.

    Raises:
      ConfigError: naming each entry and what it is, and the fix.

    Example:
      >>> import os, tempfile, pathlib
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> os.symlink("/etc/hostname", d / ".config.json.tmp")
      >>> os.mkfifo(d / "summary.json")
      >>> try:
      ...     refuse_planted(d)
      ... except ConfigError as e:
      ...     print(e.problem.split(": remove")[0])  # doctest: +NORMALIZE_WHITESPACE
      holds what effijax never writes there: summary.json (a FIFO, where effijax writes a
      file), .config.json.tmp -> /etc/hostname (a symbolic link)
    """
    checks = [*((n, False, True) for n in _IN_PLACE),
              *((n, False, False) for n in _RENAMED if n not in _IN_PLACE),
              *((atomic.temporary_name(n), False, True) for n in _RENAMED),
              *((n, True, False) for n in _FOLDERS),
              *((atomic.temporary_name(n), True, False) for n in ("hf", "peft"))]
    found = [what for name, folder, in_place in checks
             if (what := _planted(out / name, folder, in_place))]
    steps = out / "checkpoints"
    if steps.is_dir() and not steps.is_symlink():
        found += [f"checkpoints/{p.name} -> {os.readlink(p)} (a symbolic link)"
                  for p in sorted(steps.iterdir()) if p.is_symlink()]
    if found:
        raise ConfigError("out", str(out), f"holds what effijax never writes there: "
                          f"{', '.join(found)}: remove them (effijax writes only inside its run "
                          "directory, never through links), or choose another --out")
    if not (out / "config.json").exists():
        foreign = [n + "/" * (out / n).is_dir() for n in _EXPORTS if os.path.lexists(out / n)]
        if foreign:
            raise ConfigError("out", str(out), f"holds {', '.join(foreign)} but no effijax run "
                              "(no config.json): the run's exports would replace them; move "
                              "them away, or choose another --out")
