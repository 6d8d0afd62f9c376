"""A resume (and a finished run's re-run) repeats the tokenizer, chat template and weight files
the run started with: an edit is refused naming what changed, the same files elsewhere or
reformatted are accepted, and a run recorded before these digests existed still resumes.

One tiny Llama with a tokenizer and chat template, saved as a Hugging Face directory, trains
two steps once (the module's only compilation); every refusal comes before anything compiles,
and an accepted resume is stopped at its compilation (its state already restored).
"""

import dataclasses
import json
import shutil
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from _llama_files import CHAT_TEMPLATE, VOCAB_SIZE, vocabulary

from effijax.errors import ConfigError, FileError
from effijax.interop import save_hf
from effijax.models import Tokenizer, byte_level_bpe, gpt_config, llama_config
from effijax.recipe import TrainConfig, _identity, _rundir, _train, train
from effijax.sources._data import Dataset

SEQ = 32
STEPS = 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``(root, settings)``: ``root/hf`` (the pretrained model), ``root/qa.jsonl`` and
    ``root/run``, a chat run of ``STEPS`` steps from ``root/hf``, checkpointed at its end."""
    root = tmp_path_factory.mktemp("identity")
    tokens, types_, merges = vocabulary()
    tok = byte_level_bpe(tokens, merges, pre="smollm", token_types=types_, bos_id=1, eos_id=2,
                         pad_id=2, chat_template=CHAT_TEMPLATE)
    model = dataclasses.replace(llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=SEQ),
                                tokenizer=tok)
    save_hf(root / "hf", model, jax.jit(model.init_params)(jax.random.key(0)))
    with open(root / "qa.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": f"{i}+1", "response": f"{i + 1}"}) + "\n")
    settings = dict(data=str(root / "qa.jsonl"), seq_len=SEQ, batch_size=2, eval_batches=0,
                    progress=False, checkpoint_every=STEPS, out=str(root / "run"))
    assert train(TrainConfig(model_from=str(root / "hf"), steps=STEPS, **settings)).status == "done"
    return root, settings


def _copy(trained, tmp_path) -> Path:
    """The pretrained model copied elsewhere (another path, the same files)."""
    root, _ = trained
    return Path(shutil.copytree(root / "hf", tmp_path / "elsewhere"))


def _refusals(trained, model_dir, out=None) -> tuple[str, str]:
    """The messages of the finished run re-run and of a resume past it, from ``model_dir``."""
    _, settings = trained
    settings = {**settings, "out": out or settings["out"]}
    messages = []
    for steps, allow in ((STEPS, None), (STEPS + 2, "steps")):
        with pytest.raises(ConfigError) as e:
            train(TrainConfig(model_from=str(model_dir), steps=steps, allow_changes=allow,
                              **settings))
        messages.append(str(e.value))
    return messages[0], messages[1]


class _Compiling(Exception):
    """Raised in place of compiling: the resume got through its checks and restored."""


def _resume_until_compiling(trained, model_dir, monkeypatch, out=None):
    """Resumes the run for two more steps from ``model_dir`` up to the compilation; returns
    what compilation would have been given: ``(job, initial, source, data, why)`` (and the
    config's sections, by keyword)."""
    _, settings = trained

    def stop(*args, **sections):
        raise _Compiling(*args)

    monkeypatch.setattr(_train, "compile_run", stop)
    with pytest.raises(_Compiling) as e:
        train(TrainConfig(model_from=str(model_dir), steps=STEPS + 2, allow_changes="steps",
                          **{**settings, "out": out or settings["out"]}))
    return e.value.args


def _edit_json(path: Path, edit) -> None:
    values = json.loads(path.read_text())
    edit(values)
    path.write_text(json.dumps(values))


def _edit_template(model_dir: Path) -> None:
    """A blank line after each turn of the chat template: other tokens, the same turns."""
    _edit_json(model_dir / "tokenizer_config.json",
               lambda c: c.update(chat_template=c["chat_template"].replace(">\n{% endfor",
                                                                          ">\n\n{% endfor")))


def test_an_edited_chat_template_is_refused_on_resume_and_when_finished(trained, tmp_path):
    model_dir = _copy(trained, tmp_path)
    _edit_template(model_dir)
    finished, resumed = _refusals(trained, model_dir)
    assert f"holds a run finished at step {STEPS} with other settings: tokenizer: the " \
           "tokenizer or chat template changed since the run started (sha256 " in finished
    assert "resume=" in resumed and "tokenizer: the tokenizer or chat template changed" in resumed
    for message in (finished, resumed):  # that alone: the same weights, another place
        assert "weights" not in message and "model_from" not in message, message


def test_an_edited_tokenizer_json_is_refused_on_resume_and_when_finished(trained, tmp_path):
    model_dir = _copy(trained, tmp_path)
    _edit_json(model_dir / "tokenizer.json",
               lambda t: t["model"].update(merges=t["model"]["merges"][:-1]))
    finished, resumed = _refusals(trained, model_dir)
    root, _ = trained
    old = Tokenizer.load(root / "hf").fingerprint()[:12]
    new = Tokenizer.load(model_dir).fingerprint()[:12]
    for message in (finished, resumed):
        assert f"tokenizer: the tokenizer or chat template changed since the run started " \
               f"(sha256 {old}.. -> {new}..); restore the tokenizer files" in message, message
        assert "weights" not in message and "model_from" not in message, message


def test_changed_weight_bytes_are_refused_naming_the_file(trained, tmp_path):
    model_dir = _copy(trained, tmp_path)
    weights = model_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    last = np.frombuffer(bytes(data[-4:]), np.float32)[0]
    data[-4:] = np.float32(last + 1).tobytes()  # a finite weight, another value
    weights.write_bytes(bytes(data))
    finished, resumed = _refusals(trained, model_dir)
    for message in (finished, resumed):
        assert "weights: the pretrained weight files changed since the run started: " \
               "model.safetensors (sha256 " in message, message
        # Said once, file by file: not again as the digest of all the files.
        assert "model_from" not in message and "tokenizer" not in message, message


def test_the_same_files_elsewhere_and_reformatted_are_the_same_run(trained, tmp_path,
                                                                   monkeypatch):
    model_dir = _copy(trained, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # other whitespace, other order
        values = json.loads((model_dir / name).read_text())
        (model_dir / name).write_text(json.dumps(dict(reversed(values.items())), indent=7))
    root, settings = trained
    again = train(TrainConfig(model_from=str(model_dir), steps=STEPS, **settings))
    assert again.status == "finished_before"
    job, initial, _, _, _ = _resume_until_compiling(trained, model_dir, monkeypatch)
    assert int(initial.state.step) == STEPS
    record = json.loads((root / "run" / "config.json").read_text())["run"]
    assert record["weights"] == {"model.safetensors": record["init_from_checkpoint"]["sha256"]}
    assert record["tokenizer_sha256"] == job.model.tokenizer.fingerprint()


def _as_legacy(run: Path) -> None:
    """``run``'s records as a run before the tokenizer and weight digests wrote them."""
    def drop(values):
        for key in ("tokenizer_sha256", "weights"):
            del values["run"][key]

    _edit_json(run / "config.json", drop)
    for meta in run.glob("checkpoints/*/_CHECKPOINT_METADATA"):
        _edit_json(meta, lambda m: drop(m["custom_metadata"]["effijax"]["metadata"]["config"]))


def test_a_run_recorded_before_the_digests_resumes_and_records_them(trained, tmp_path,
                                                                    monkeypatch):
    root, settings = trained
    run = Path(shutil.copytree(root / "run", tmp_path / "legacy"))
    _as_legacy(run)
    model_dir = _copy(trained, tmp_path)  # edited: a change the legacy run cannot tell
    _edit_template(model_dir)
    again = train(TrainConfig(model_from=str(model_dir), steps=STEPS,
                              **{**settings, "out": str(run)}))
    assert again.status == "finished_before"
    job, initial, _, _, _ = _resume_until_compiling(trained, model_dir, monkeypatch,
                                                       out=str(run))
    assert int(initial.state.step) == STEPS
    # Its weights are still compared, through the digest of all its files.
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + np.float32(3).tobytes())
    finished, _ = _refusals(trained, model_dir, out=str(run))
    assert "model_from: this run continues a run that started from {sha256=" in finished


def test_a_run_whose_config_says_init_from_loads_resumes_and_opens(trained, tmp_path,
                                                                   monkeypatch):
    """An earlier effijax wrote the source as ``init_from`` (now ``model_from``): its run is
    the same run, its config.json a settings file, and its directory a model to open."""
    from effijax.sources import open_model

    root, settings = trained
    run = Path(shutil.copytree(root / "run", tmp_path / "older"))

    def older(values):
        values["init_from"] = values.pop("model_from")

    _edit_json(run / "config.json", older)
    for meta in run.glob("checkpoints/*/_CHECKPOINT_METADATA"):
        _edit_json(meta, lambda m: older(m["custom_metadata"]["effijax"]["metadata"]["config"]))
    assert "model_from" not in (run / "config.json").read_text()
    assert TrainConfig.from_file(run / "config.json").model_from == str(root / "hf")
    again = train(TrainConfig(model_from=str(root / "hf"), steps=STEPS,
                              **{**settings, "out": str(run)}))
    assert again.status == "finished_before"
    _, initial, _, _, _ = _resume_until_compiling(trained, root / "hf", monkeypatch,
                                                  out=str(run))
    assert int(initial.state.step) == STEPS
    assert open_model(str(run)).model.vocab_size == VOCAB_SIZE
    with pytest.raises(ConfigError, match="init_from='a': is now model_from"):
        TrainConfig(init_from="a")
    with pytest.raises(ConfigError, match=r"is now model_from \(given too: 'b'\); keep one"):
        TrainConfig.from_dict({"init_from": "a", "model_from": "b"})


def test_not_recorded_fields_are_not_compared_and_recorded_ones_are():
    new = {"seed": 0, "run": {"corpus_sha256": "c", "tokenizer_sha256": "t" * 64,
                              "init_from_checkpoint": {"path": "/a", "sha256": "s"},
                              "weights": {"model.safetensors": "s"}}}
    legacy = {"seed": 0, "run": {"corpus_sha256": "c",
                                 "init_from_checkpoint": {"path": "/b", "sha256": "s"}}}
    assert _identity.identity(legacy)["tokenizer"] is _identity.NOT_RECORDED
    assert _identity.differences(legacy, new) == {} == _identity.differences(new, legacy)
    byte_run = {"seed": 0, "run": {"corpus_sha256": "c", "tokenizer_sha256": None,
                                   "init_from_checkpoint": None, "weights": None}}
    assert _identity.differences(byte_run, new) == {
        "tokenizer": (None, "t" * 64), "model_from": (None, {"sha256": "s"})}
    sharded = {"seed": 0, "run": {**new["run"], "init_from_checkpoint": {"sha256": "z"},
                                  "weights": {"a.safetensors": "s", "b.safetensors": "y"}}}
    with pytest.raises(ConfigError) as e:
        _identity.check_resume(new, sharded, (), where="ckpt")
    assert "weights: the pretrained weight files changed since the run started: " \
           "model.safetensors (read by the run, not now), a.safetensors (not read by the run), " \
           "b.safetensors (not read by the run); start from the files" in str(e.value)
    assert "model_from" not in str(e.value)


def test_the_attention_implementation_is_a_run_choice_the_architecture_is_not():
    def run(**model):
        config = {"family": "llama", "seq_len": 64, "d_model": 64, **model}
        return {"seed": 0, "run": {"corpus_sha256": "c", "model_config": config}}

    # A run recorded with the Llama family's earlier default resumes under "auto".
    assert _identity.differences(run(attention="naive"), run(attention="auto")) == {}
    assert _identity.differences(run(unroll_layers=True), run(unroll_layers=False)) == {}
    assert _identity.differences(run(d_model=64), run(d_model=32)) == {
        "model": ({"d_model": 64}, {"d_model": 32})}


def test_a_byte_model_records_no_tokenizer_and_no_weights():
    model = gpt_config("tiny", seq_len=16)
    job = types.SimpleNamespace(model=model, num_params=1, trainable_params=1)
    data = Dataset(np.zeros(64, np.uint8), np.zeros(64, np.uint8), "64:ab", "bytes", 128)
    record = _rundir.run_record(job, None, data)
    assert (record["tokenizer_sha256"], record["weights"]) == (None, None)


@pytest.mark.parametrize("file, content, expected", [
    ("tokenizer_config.json", {"chat_template": 5},
     "tokenizer_config.json: chat_template: expected a string, or a list of {name, template}"),
    ("tokenizer.json", {"model": {"vocab": {"a": 0}, "merges": ["a b c"]}},
     "tokenizer.json: model.merges: expected a list of pairs"),
    ("tokenizer.json", {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}},
     "tokenizer.json: file: the tokenizers library cannot read it"),
])
def test_tokenizer_load_checks_its_files_in_one_line(tmp_path, file, content, expected):
    directory = tmp_path / "tok"
    byte_level_bpe(["a", "b", "ab"], ["a b"], eos_id=2, chat_template="{{ messages }}").save(
        directory)
    assert Tokenizer.load(directory).encode("ab").tolist() == [2]  # as saved, it loads
    (directory / file).write_text(json.dumps(content))
    with pytest.raises(FileError) as e:
        Tokenizer.load(directory)
    assert str(e.value).startswith(str(directory / file) + ": ") and "\n" not in str(e.value)
    assert expected in str(e.value)
