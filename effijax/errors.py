"""effijax's error type for bad configuration, raised before anything is traced or compiled."""

from __future__ import annotations

import numbers

__all__ = ["ConfigError", "FileError", "SaveError", "WriteError", "NO_VALUE", "whole_number",
           "INT32_MAX", "all_of", "path_name", "NAME_MAX", "PATH_MAX"]

INT32_MAX = 2**31 - 1  # steps, batches, seeds and sizes that reach the device are int32


class _NoValue:
    """The value of a :class:`ConfigError` that is about no value the user gave."""

    def __repr__(self) -> str:
        return "NO_VALUE"


NO_VALUE = _NoValue()


class ConfigError(ValueError):
    """A setting is wrong. The message names the field, the offending value and the fix.

    It subclasses ``ValueError`` so callers that already catch that keep working.

    Example:
      >>> str(ConfigError("batch_size", 10, "must be divisible by the data axes (4)"))
      'batch_size=10: must be divisible by the data axes (4)'
      >>> str(ConfigError("memory", NO_VALUE, "the step needs 9 GB, more than the 8 GB free"))
      'memory: the step needs 9 GB, more than the 8 GB free'
    """

    def __init__(self, field: str, value, problem: str):
        self.field = field
        self.value = value
        self.problem = problem
        # An error about no value of the user's (a budget read from the device) says no "=".
        super().__init__(f"{field}: {problem}" if value is NO_VALUE else
                         f"{field}={value!r}: {problem}")

    def renamed(self, field: str) -> ConfigError:
        """The same error reported under another name (e.g. a library argument under the
        config field or flag that set it).

        Example:
          >>> str(ConfigError("rank", 0, "must be >= 1").renamed("lora_rank"))
          'lora_rank=0: must be >= 1'
        """
        return ConfigError(field, self.value, self.problem)

    def within(self, field: str, value) -> ConfigError:
        """This error said as part of another setting's (``field=value``): a value read from
        the file or model that setting names.

        Example:
          >>> str(ConfigError("hidden_size", 64.7, "not whole").within("model_from", "m.gguf"))
          "model_from='m.gguf': hidden_size=64.7: not whole"
        """
        return ConfigError(field, value, f"{self.field}={self.value!r}: {self.problem}")


def all_of(errors: list[ConfigError]) -> ConfigError:
    """One error for several found together, so that one run names every reason: the first's
    field and value, then each other's ``field=value: problem``.

    Example:
      >>> str(all_of([ConfigError("a", 1, "must be 2"), ConfigError("b", 3, "must be 4")]))
      'a=1: must be 2; and b=3: must be 4'
    """
    first, *rest = errors
    if not rest:
        return first
    return ConfigError(first.field, first.value,
                       "; and ".join([first.problem, *(str(e) for e in rest)]))


def _one_line(text: str, limit: int) -> str:
    """``text`` printable on one line (control characters escaped) and at most ``limit``
    characters: a forged file's names and values are the attacker's text."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text)[:2 * limit])
    return text if len(text) <= limit else text[:limit - 3] + "..."


class FileError(ConfigError):
    """A file effijax reads (a GGUF, a safetensors file, ``config.json``, a tokenizer file, a
    shard index) is malformed, or says something effijax refuses to trust. One line: the file,
    where in it (a field, a tensor, a byte offset) and what was expected.

    It is a :class:`ConfigError`, so every command reports it as one line and exits 2; unlike
    one, it keeps its words when a caller renames it after a flag (the file is the culprit,
    not the flag that named it).

    Example:
      >>> e = FileError("m.gguf", "tensor_count", "16777216 tensors cannot fit in 4,096 bytes")
      >>> str(e)
      'm.gguf: tensor_count: 16777216 tensors cannot fit in 4,096 bytes'
      >>> str(e.renamed("--from")) == str(e)
      True
      >>> long = str(FileError("m.gguf", "key 'a\\nb'", "x" * 2000))  # one line, bounded
      >>> len(long.splitlines()), len(long) < 1300
      (1, True)
    """

    def __init__(self, path, where: str, problem: str):
        self.path, self.where = str(path), _one_line(where, 200)
        ValueError.__init__(self, f"{self.path}: {self.where}: {_one_line(problem, 1000)}")
        self.field, self.value, self.problem = where, self.path, problem

    def renamed(self, field: str) -> FileError:
        """Itself: the message already names the file (see the class)."""
        return self

    def within(self, field: str, value) -> FileError:
        """Itself: the file, the field or byte, and what was expected say it all."""
        return self

    @classmethod
    def of(cls, path, error: ConfigError) -> FileError:
        """A :class:`ConfigError` about a value read from ``path``, as an error about the file.

        Example:
          >>> str(FileError.of("config.json", ConfigError("hidden_size", 64.7, "not whole")))
          'config.json: hidden_size=64.7: not whole'
        """
        if isinstance(error, FileError):
            return error
        where = error.field if error.value is NO_VALUE else f"{error.field}={error.value!r}"
        out = cls(path, where, error.problem)
        out.field, out.value = error.field, error.value  # the field in the file, its value
        return out


class SaveError(RuntimeError):
    """A checkpoint could not be written; the run stopped. One line: the step, the directory
    and the operating system's reason; the full traceback is in ``log``.

    Example:
      >>> str(SaveError(40, "runs/x/checkpoints", "[Errno 28] No space left on device",
      ...               "runs/x/error.log"))  # doctest: +NORMALIZE_WHITESPACE
      'saving the checkpoint of step 40 to runs/x/checkpoints failed: [Errno 28] No space left
       on device (traceback in runs/x/error.log)'
    """

    def __init__(self, step: int, directory: str, reason: str, log: str | None):
        self.step, self.directory, self.reason, self.log = step, directory, reason, log
        where = f" (traceback in {log})" if log else ""
        super().__init__(f"saving the checkpoint of step {step} to {directory} failed: "
                         f"{reason}{where}")


class WriteError(RuntimeError):
    """A file of the run directory (metrics, a log, an export, the summary) could not be
    written; the run stopped, the file as it was before. One line, like :class:`SaveError`.

    Example:
      >>> str(WriteError("runs/x/metrics.jsonl", "[Errno 28] No space left on device",
      ...                "runs/x/error.log"))  # doctest: +NORMALIZE_WHITESPACE
      'writing runs/x/metrics.jsonl failed: [Errno 28] No space left on device (traceback in
       runs/x/error.log)'
    """

    def __init__(self, path: str, reason: str, log: str | None):
        self.path, self.reason, self.log = path, reason, log
        where = f" (traceback in {log})" if log else " (no room for its traceback either)"
        super().__init__(f"writing {path} failed: {reason}{where}")


def whole_number(field: str, value, *, minimum: int = 1, maximum: int | None = INT32_MAX,
                 none: bool = False) -> int | None:
    """``value`` as an ``int`` when it is a whole number in ``[minimum, maximum]``, else a
    :class:`ConfigError` naming ``field``: the one integer check behind every count, size and
    step effijax takes (``True`` is not 1, ``2.0`` is not 2; NumPy integers are whole numbers).

    Args:
      field: the parameter's name, as the user wrote it (``"batch_size"``, ``"--steps"``).
      value: what was given.
      minimum: the smallest allowed value (``0`` for "none is fine", ``1`` for counts).
      maximum: the largest, ``INT32_MAX`` by default; ``None`` for no bound.
      none: ``None`` is allowed (and returned).

    Example:
      >>> whole_number("batch_size", 8)
      8
      >>> whole_number("warmup", None, minimum=0, none=True) is None
      True
      >>> whole_number("batch_size", 0)
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: batch_size=0: must be an integer >= 1
      >>> whole_number("steps", 10**12)
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: steps=1000000000000: must be an integer from 1 to 2,147,483,647
    """
    if value is None and none:
        return None
    whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    in_range = whole and minimum <= value and (maximum is None or value <= maximum)
    if not in_range:
        # The int32 ceiling is said only to a value above it; a real range is always said.
        wide = maximum is None or (maximum == INT32_MAX and not (whole and value > maximum))
        bound = f">= {minimum:,}" if wide else f"from {minimum:,} to {maximum:,}"
        raise ConfigError(field, value, f"must be an integer {bound}" +
                          (" (or None)" if none else ""))
    return int(value)


NAME_MAX, PATH_MAX = 255, 4095  # bytes in one file name, and in a whole path (Linux)


def path_name(field: str, value: str) -> str:
    """``value`` when the operating system can take it as a path, else a :class:`ConfigError`
    naming ``field``: a NUL character, bytes that are not UTF-8 (an argument Python could not
    decode; every file effijax writes records its paths in JSON), a name over 255 bytes or a
    path over 4,095. Nothing is read from the disk.

    Example:
      >>> path_name("out", "runs/mine")
      'runs/mine'
      >>> path_name("out", "runs/" + "x" * 300)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: out=...: the name ... is 300 bytes, over the 255 ...
    """
    if "\0" in value:
        raise ConfigError(field, value, "holds a NUL character, which no path can; check where "
                          "the value came from")
    try:
        encoded = value.encode("utf-8")
    except UnicodeEncodeError:
        shown = value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise ConfigError(field, NO_VALUE, f"'{_shown(shown)}' holds bytes that are not UTF-8 "
                          "(run records keep their paths as text); name it in UTF-8") from None
    if len(encoded) > PATH_MAX:
        raise ConfigError(field, _shown(value), f"is {len(encoded):,} bytes long, over the "
                          f"{PATH_MAX:,} a path may have; use a shorter path")
    for name in value.split("/"):
        if len(name.encode("utf-8")) > NAME_MAX:
            raise ConfigError(field, _shown(value), f"the name {_shown(name)!r} is "
                              f"{len(name.encode('utf-8')):,} bytes, over the {NAME_MAX} a file "
                              "name may have; use a shorter name")
    return value


def _shown(text: str, limit: int = 60) -> str:
    """A long value shortened for a message (its start and length say which it is)."""
    return text if len(text) <= limit else text[:limit - 3] + "..."
