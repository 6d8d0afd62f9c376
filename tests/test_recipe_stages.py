"""Each stage of ``train(config)`` on its own: start, model, data, optimizer, plan, run
directory, state, loop, evaluate, export, summary; and the checkpoint failure plumbing the loop
uses. One tiny job is planned and compiled once for the module (compilation dominates)."""

import dataclasses
import json
import pathlib
import threading

import jax
import optax
import pytest

from effijax import checkpoint
from effijax.errors import ConfigError, SaveError
from effijax.recipe import (
    TrainConfig,
    _finish,
    _loop,
    _rundir,
    _state,
    _train,
    _watch,
    optimizer_for,
)
from effijax.run import RunDir, read_metrics
from effijax.sources import load_dataset, load_eval_data

TINY = dict(model="tiny", seq_len=16, batch_size=2, eval_batches=1, steps=2, progress=False)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(200)))
    return str(path)


@pytest.fixture(scope="module")
def planned(corpus, tmp_path_factory):
    """The stages up to compile, for a tiny run on one device."""
    out = tmp_path_factory.mktemp("run") / "out"
    config = TrainConfig(**TINY, data=corpus, out=str(out))
    s = config.sections
    mesh = _train.start(s.parallel)
    model = _train.model_for(s.model, s.data, s.training, None)
    precision = _train.decide_precision(s.precision, s.output, model).precision
    config = config.resolved(precision, **_train.placement(s.parallel, mesh))
    s = config.sections
    data = _train.load_data(s.data, model, objective=config.objective)
    job = _train.plan_run(model, optimizer_for(s.training, s.optimizer, s.precision), data, mesh,
                          precision=s.precision, training=s.training, parallel=s.parallel,
                          lora=s.lora, objective=s.objective)
    return config, data, job


# start, model, data, optimizer, plan ------------------------------------------------------------

def test_start_without_a_strategy_uses_one_device_and_resolve_decides_every_auto(planned):
    config, data, job = planned
    assert _train.start(TrainConfig(**TINY).sections.parallel) is None
    assert config.precision == "fp32" and config.strategy is None and config.mesh is None
    assert config.warmup == TrainConfig(**TINY).warmup_steps
    assert job.tokens_per_step == 2 * 16 and job.lora is None
    assert data.format == "bytes" and len(data.train) + len(data.val) == data.tokens


def test_the_model_stage_refuses_an_export_its_family_cannot_write():
    with pytest.raises(ConfigError, match=r"^export_hf=True: writes a Hugging Face model "
                       r"directory; the gpt family has no Hugging Face counterpart; families "
                       r"with one: gemma3, llama, mistral, qwen2$"):
        s = TrainConfig(**TINY, export_hf=True).sections
        _train.model_for(s.model, s.data, s.training, None)


def test_optimizer_for_follows_the_config():
    s = TrainConfig(**TINY, optimizer="sgd").sections
    opt = optimizer_for(s.training, s.optimizer, s.precision)
    assert isinstance(opt, optax.GradientTransformation)


def test_one_reader_gives_training_and_evaluation_data_the_same_content(corpus, planned):
    _, data, job = planned
    train = load_dataset(corpus, job.model)
    rows, fingerprint, fmt = load_eval_data(corpus, job.model)
    assert (fingerprint, fmt) == (train.fingerprint, train.format) == (data.fingerprint, "bytes")
    assert rows.filled == train.tokens  # every token of the file, in consecutive windows
    with pytest.raises(ConfigError, match=r"^data: chat data needs a .jsonl file"):
        load_dataset(None, job.model, data_format="chat")


# run directory, state ---------------------------------------------------------------------------

def test_open_run_locks_the_directory_until_released(planned, tmp_path):
    config, data, job = planned
    # Without checkpoints: the lock and the records (orbax's manager opens in the loop test).
    config = dataclasses.replace(config, checkpoints=False, out=str(tmp_path))
    record = _rundir.run_record(job, None, data)
    s = config.sections
    run = _rundir.open_run(config.to_dict(), s.output, s.training, job, record)
    try:
        assert (run.resume_step, run.restored, run.finished) == (None, None, False)
        assert run.config_json == run.run_json and run.record["corpus_sha256"] == data.fingerprint
        assert run.dir.ckpt is None and run.dir.lock is not None
        with pytest.raises(ConfigError, match="another run is writing this directory"):
            _rundir.open_run(config.to_dict(), s.output, s.training, job, record)
    finally:
        run.dir.release()
    assert run.dir.lock is None and run.dir.ckpt is None
    _rundir.open_run(config.to_dict(), s.output, s.training, job, record).dir.release()  # free


def test_a_run_dir_releases_its_lock_when_its_block_fails(tmp_path):
    with pytest.raises(RuntimeError), RunDir(tmp_path, lock=checkpoint.lock_run_dir(tmp_path)):
        raise RuntimeError("the run failed")
    checkpoint.lock_run_dir(tmp_path).release()  # nobody holds it any more


# state, compile, loop, evaluate, export, summary -------------------------------------------------

@pytest.fixture(scope="module")
def trained(planned):
    """The stages from the run directory to the loop, checkpointing, as ``train`` runs them."""
    config, data, job = planned
    s = config.sections
    run = _rundir.open_run(config.to_dict(), s.output, s.training, job,
                           _rundir.run_record(job, None, data))
    with run.dir:
        initial = _state.initial_state(s.output, s.training, job, run, None)
        assert int(initial.state.step) == 0 and initial.frozen is None
        compiled = _train.compile_run(job, initial, None, data, model=s.model,
                                      precision=s.precision, training=s.training,
                                      parallel=s.parallel, output=s.output)
        run.dir.begin(run.config_json)
        start = _finish.evaluate_start(job, initial, data.val,
                                       eval_batches=config.eval_batches)
        with _watch.watching(s.output, run.run_json, {}, 0) as watch:
            result = _loop.loop(s.output, job, run, compiled, initial, data.train, watch,
                                steps=config.steps, prefetch=config.prefetch,
                                max_non_finite=config.max_non_finite)
        assert run.dir.ckpt is None  # saved and closed by the loop
    return compiled, start, result


def test_the_loop_trains_logs_and_saves_the_last_step(planned, trained):
    config, _, _ = planned
    _, start, result = trained
    assert start == {}  # not a fine-tune: no evaluation before the first step
    assert result.signal is None and int(result.state.step) == 2
    assert result.summary["steps"] == 2 and result.summary["trained_tokens"] == 2 * 2 * 16
    assert [r["step"] for r in read_metrics(config.out)] == [1, 2]
    assert json.loads((pathlib.Path(config.out) / "config.json").read_text())["steps"] == 2
    assert checkpoint.latest_step(pathlib.Path(config.out) / "checkpoints") == 2


def test_evaluate_export_and_summary_after_the_loop(planned, trained):
    config, data, job = planned
    compiled, _, result = trained
    evaluation = _finish.evaluate_end(job, result.state.params, data.val,
                                      eval_batches=config.eval_batches)
    assert set(evaluation) == {"eval_loss"} and evaluation["eval_loss"] > 0
    assert _finish.evaluate_end(job, result.state.params, data.val, eval_batches=0) == {}
    s = config.sections
    assert _finish.export(s.output, s.training, job, result.state.params) == {}  # none asked
    summary = _finish.summarize(job, compiled, result.summary, config.out, evaluation)
    assert summary["eval_loss"] == evaluation["eval_loss"]
    assert summary["final_loss_steps"] == 2 and summary["num_params"] == job.num_params
    assert summary["trained_tokens"] == result.summary["trained_tokens"]


# the checkpoint failure plumbing ---------------------------------------------------------------

def test_a_failed_write_is_one_line_with_its_traceback_in_the_log(tmp_path):
    released = []
    with pytest.raises(SaveError) as e, checkpoint.save_errors(
            tmp_path, None, 7, lambda: released.append(True)):
        raise RuntimeError("the write failed") from OSError(28, "No space left on device")
    assert released == [True]
    assert str(e.value) == (f"saving the checkpoint of step 7 to {tmp_path / 'checkpoints'} "
                            f"failed: [Errno 28] No space left on device (traceback in "
                            f"{tmp_path / 'error.log'})")
    log = (tmp_path / "error.log").read_text()
    assert log.startswith(f"step 7: saving to {tmp_path / 'checkpoints'}\n")
    assert "RuntimeError: the write failed" in log


def test_last_good_without_checkpoints_says_so():
    assert checkpoint.last_good(None, lambda: None) == "no checkpoint (--no-checkpoints)"


# the loop's prefetching -------------------------------------------------------------------------

def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "effijax-prefetch"]


def _loop_until_it_fails(planned, trained, tmp_path, step=None):
    """The loop of a fresh run (no checkpoints) from a copy of the module's last state (step
    2) to step 4, with the module's compiled step or ``step``."""
    config, data, job = planned
    compiled, _, result = trained
    compiled = compiled if step is None else compiled._replace(step=step)
    config = config.with_overrides(out=str(tmp_path / "out"), checkpoints=False, steps=4)
    s = config.sections
    run = _rundir.open_run(config.to_dict(), s.output, s.training, job,
                           _rundir.run_record(job, None, data))
    initial = _state.Initial(jax.tree.map(lambda x: x.copy(), result.state))  # it is donated
    with run.dir, _watch.watching(config.sections.output, run.run_json, {}, 0) as watch:
        _loop.loop(config.sections.output, job, run, compiled, initial, data.train, watch,
                   steps=config.steps, prefetch=config.prefetch,
                   max_non_finite=config.max_non_finite)


def test_the_loop_leaves_no_prefetch_thread_however_it_ends(planned, trained, tmp_path,
                                                            monkeypatch):
    assert not _prefetch_threads()  # after the module's loop ran to its last step
    steps = []

    def failing_step(state, batch):
        steps.append(batch)
        if len(steps) == 2:
            raise RuntimeError("the step failed")
        return trained[0].step(state, batch)

    with pytest.raises(RuntimeError, match="^the step failed$"):
        _loop_until_it_fails(planned, trained, tmp_path / "step", failing_step)
    assert not _prefetch_threads()
    # An error building a batch (on the worker thread) ends the loop with that error.
    fetch = _loop._job.batch_fn
    built = []

    def failing_batch_fn(job, tokens, frozen):
        def batch(step_no):
            built.append(step_no)
            if step_no == 3:
                raise ConfigError("data", "corpus.txt", "changed while training")
            return fetch(job, tokens, frozen)(step_no)
        return batch

    monkeypatch.setattr(_loop._job, "batch_fn", failing_batch_fn)
    with pytest.raises(ConfigError, match=r"^data='corpus.txt': changed while training$"):
        _loop_until_it_fails(planned, trained, tmp_path / "batch")
    assert not _prefetch_threads() and built == [2, 3]


@pytest.mark.parametrize("mesh, strategy, expected", [
    ("fsdp=2,tensor=4", None, "fsdp"),  # naming an fsdp axis asks for FSDP
    ("data=2,fsdp=4", None, "fsdp"),
    ("data=8", None, "ddp"),
    ("fsdp=1,tensor=8", None, "ddp"),  # no axis to shard over
    ("fsdp=2,tensor=4", "zero1", "zero1"),  # a strategy given is kept
])
def test_a_mesh_without_a_strategy_implies_one(mesh, strategy, expected):
    from effijax.recipe._train import placement
    from effijax.sharding import make_mesh

    def resolve(config, mesh, precision):
        return config.resolved(precision, **placement(config.sections.parallel, mesh))

    config = TrainConfig(mesh=mesh, strategy=strategy)
    assert resolve(config, make_mesh(**config.mesh), "fp32").strategy == expected
    # Several processes without --mesh: effijax's own all-fsdp mesh, data parallel as before.
    assert resolve(TrainConfig(), make_mesh(fsdp=8), "fp32").strategy == "ddp"


def test_a_fine_tune_without_evaluation_says_so(capsys):
    from types import SimpleNamespace

    from effijax.recipe import _finish

    job = SimpleNamespace(lora=object())  # a LoRA run: judged by its validation loss
    assert _finish.evaluate_start(job, None, None, eval_batches=0) == {}
    assert capsys.readouterr().out == ("effijax train: note: --eval-batches 0: no validation "
                                       "loss before or after training (the summary and the "
                                       "done line will have none)\n")
    job = SimpleNamespace(lora=None)  # a run from the seed evaluates nothing at its start
    assert _finish.evaluate_start(job, None, None, eval_batches=0) == {}
    assert capsys.readouterr().out == ""
