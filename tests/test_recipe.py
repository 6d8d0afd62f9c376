"""The training recipe: TrainConfig (loading, checking, flags), the model interface, train()."""

import dataclasses
import json
import os
import pathlib
import re

import numpy as np
import optax
import pytest

from effijax.cli import build_parser
from effijax.cli._train import config_from_args
from effijax.errors import ConfigError
from effijax.models import FAMILIES, GPTConfig, gpt_config, model_from_dict, preset
from effijax.recipe import TrainConfig, flag_of, plan_job, train

TINY = dict(model="tiny", seq_len=16, batch_size=2, eval_batches=1, progress=False)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(200)))
    return str(path)


# TrainConfig -------------------------------------------------------------------------------------

def test_unknown_and_mistyped_settings_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"lrr=0.1: unknown setting; did you mean 'lr'\?"):
        TrainConfig.from_dict({"lrr": 0.1})
    with pytest.raises(ConfigError, match=r"lrr=0.1: unknown setting; did you mean 'lr'\?"):
        TrainConfig(lrr=0.1)  # in Python too, not the dataclass's bare TypeError
    # inf trained NaN parameters and ended "done", exit 0; 10**12 steps overflowed int32 in jax.
    for name in ("lr", "weight_decay", "clip", "lora_alpha", "lr_end"):
        with pytest.raises(ConfigError, match=f"^{name}=inf: must be a finite number"):
            TrainConfig(**{name: float("inf")})
    with pytest.raises(ConfigError, match=r"^steps=1000000000000: must be at most 2,147,483,647"):
        TrainConfig(steps=10**12)
    with pytest.raises(ConfigError, match=r"^seed=\d+: must be at most 2,147,483,647"):
        TrainConfig(seed=2**31)
    assert TrainConfig(seed=2**31 - 1).seed == 2**31 - 1
    with pytest.raises(ConfigError, match=r"steps='10': expected an integer"):
        TrainConfig(steps="10")
    with pytest.raises(ConfigError, match=r"checkpoints=1: expected true or false"):
        TrainConfig(checkpoints=1)
    with pytest.raises(ConfigError, match=r"lora_targets='\(': not a valid regex"):
        TrainConfig(lora_rank=4, lora_targets="(", lora_random_base=True)
    with pytest.raises(ConfigError, match=r"lora_dropout=0.5: only applies to LoRA"):
        TrainConfig(lora_dropout=0.5)
    with pytest.raises(ConfigError, match=r"warmup=400: must be in \[0, steps=300\]"):
        TrainConfig(warmup=400)
    with pytest.raises(ConfigError, match=r"lora_rank=4: LoRA adapts a trained model: give "
                       r"--from SOURCE, or --lora-random-base"):
        TrainConfig(lora_rank=4)
    assert TrainConfig(lora_rank=4, lora_random_base=True).lora_rank == 4


def test_precision_vocabulary_accepts_aliases():
    assert TrainConfig(precision="mixed").precision == "bf16"
    assert TrainConfig(precision="FP16").loss_scale == "auto"
    with pytest.raises(ConfigError, match="loss_scale='none': fp16 without loss scaling"):
        TrainConfig(precision="half", loss_scale="none")
    with pytest.raises(ConfigError, match="precision='fp8'"):
        TrainConfig(precision="fp8")


def test_config_files_load_toml_and_json_and_round_trip(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('model = "tiny"\nsteps = 40\nlr = 1e-3\nmesh = "data=2,fsdp=4"\n'
                    'strategy = "fsdp"\n')
    cfg = TrainConfig.from_file(toml)
    assert (cfg.model, cfg.steps, cfg.lr, cfg.mesh) == ("tiny", 40, 1e-3, {"data": 2, "fsdp": 4})
    js = tmp_path / "run.json"
    js.write_text(json.dumps({**cfg.to_dict(), "run": {"anything": 1}, "versions": {}}))
    assert TrainConfig.from_file(js) == cfg
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        TrainConfig.from_file(bad)


def test_every_field_has_one_flag_with_help_and_the_default_once():
    parser = build_parser()
    train_parser = parser._subparsers._group_actions[0].choices["train"]
    flags = {a.dest: a for a in train_parser._actions}
    for f in dataclasses.fields(TrainConfig):
        action = flags[f.name]
        assert flag_of(f.name) in action.option_strings
        assert action.help and action.help.count("(default:") <= 1, f.name
    assert flag_of("coordinator_address") == "--coordinator"
    assert flag_of("lora_rank") == "--lora-rank"


def test_flags_override_the_config_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"steps": 40, "lr": 1e-3, "model": "tiny"}))
    args = build_parser().parse_args(["train", "--config", str(path), "--lr", "0.01"])
    cfg = config_from_args(args)
    assert (cfg.steps, cfg.lr, cfg.model, cfg.batch_size) == (40, 0.01, "tiny", 16)


# The model interface -----------------------------------------------------------------------------

def test_gpt_implements_the_interface_and_round_trips():
    model = gpt_config("tiny", seq_len=32)
    assert FAMILIES["gpt"] is GPTConfig and preset("tiny") == gpt_config("tiny")
    assert model_from_dict(model.to_dict()) == model
    shape = model.shape()
    leaves = [x.size for x in __import__("jax").tree.leaves(model.abstract_params())]
    assert shape.num_params == sum(leaves)
    assert (shape.layers, shape.hidden, shape.kv_heads) == (2, 64, 4)
    with pytest.raises(ConfigError, match="did you mean 'tiny'"):
        preset("tinyy")
    with pytest.raises(ConfigError, match="model_config.d_modell"):
        model_from_dict({"family": "gpt", **dataclasses.asdict(model), "d_modell": 3})
    with pytest.raises(ConfigError, match="unknown model family; known: gemma3, gpt"):
        model_from_dict({"family": "gptx"})


def test_masked_loss_averages_only_trained_positions():
    import jax
    import jax.numpy as jnp

    model = gpt_config("tiny", seq_len=8)
    params = model.init_params(jax.random.key(0))
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    mask = jnp.zeros((2, 8)).at[:, 4:].set(1.0)
    loss, _ = model.loss_fn()(params, {"inputs": tokens, "targets": tokens, "mask": mask})
    logits = model.logits_fn()(params, tokens)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    nll = -jnp.take_along_axis(logp, tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(float(loss), float(jnp.mean(nll[:, 4:])), rtol=1e-6)


def test_one_device_is_a_one_device_mesh():
    job = plan_job(gpt_config("tiny", seq_len=16), "fp32", optax.adam(1e-3), batch_size=2)
    assert job.mesh.size == 1 and job.strategy.name == "ddp"
    assert all(s.mesh.size == 1 for s in __import__("jax").tree.leaves(job.shardings))


# train(config) -----------------------------------------------------------------------------------

def test_a_run_config_reproduces_the_run(tmp_path, corpus):
    first = train(TrainConfig(steps=6, data=corpus, out=str(tmp_path / "x"), **TINY))
    assert first.status == "done"
    again = TrainConfig.from_file(tmp_path / "x" / "config.json").with_overrides(
        out=str(tmp_path / "y"))
    second = train(again)
    a = [json.loads(x) for x in (tmp_path / "x" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "y" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # bitwise: same floats in JSON
    assert second.summary["eval_loss"] == first.summary["eval_loss"]
    assert first.config.precision == "fp32" and first.config.warmup == 1


def test_a_finished_run_is_left_untouched(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    cfg = TrainConfig(steps=4, data=corpus, out=str(out), **TINY)
    assert train(cfg).status == "done"
    # What another process of a multi-process run may be writing: the check only looks (a
    # Checkpointer would open the directory for writing and clean this up).
    in_progress = out / "checkpoints" / "6.orbax-checkpoint-tmp-1"
    in_progress.mkdir()
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()
              if p.is_file()}
    # Settings that a resume may change freely (evaluation, checkpoint cadence) still find
    # the same run.
    result = train(cfg.with_overrides(eval_batches=2, keep=5, checkpoint_every=3))
    assert result.status == "finished_before"
    assert "already holds this run, finished at step 4" in capsys.readouterr().out
    after = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()
             if p.is_file()}
    assert after == before
    assert in_progress.is_dir()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, corpus):
    """A finished 4-step run (its config), shared by the tests that only read it."""
    cfg = TrainConfig(steps=4, data=corpus, out=str(tmp_path_factory.mktemp("runs") / "done"),
                      **TINY)
    assert train(cfg).status == "done"
    return cfg


@pytest.mark.parametrize("change, shown", [
    (dict(model="mini", seq_len=None), "model {d_model=64, n_layers=2} -> {d_model=128, "
     "n_layers=4} (must match"),
    (dict(precision="bf16"), "precision 'fp32' -> 'bf16' (must match"),
    (dict(seed=7, batch_size=4), "seed 0 -> 7 (must match the checkpointed run); batch_size "
     "2 -> 4 (must match"),
    (dict(lora_rank=2, lora_random_base=True), "lora None -> {lora_rank=2"),
    (dict(steps=2), "steps 4 -> 2 (add --allow-changes steps to accept)"),
    (dict(lr=1e-4), "lr 0.003 -> 0.0001 (add --allow-changes lr to accept)"),
])
def test_a_finished_run_with_other_settings_is_refused_listing_each(finished_run, change,
                                                                    shown):
    """Only ``steps`` used to be compared: another model, precision or seed into a finished
    run's directory said "nothing to do" and exited 0."""
    out = finished_run.out
    before = sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in
                    pathlib.Path(out).rglob("*") if p.is_file())
    with pytest.raises(ConfigError) as e:
        train(finished_run.with_overrides(**change))
    assert e.value.field == "out"
    assert "holds a run finished at step 4 with other settings: " in e.value.problem
    assert shown in e.value.problem, e.value.problem
    after = sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in
                   pathlib.Path(out).rglob("*") if p.is_file())
    assert after == before  # refused before anything was written


def test_a_finished_run_past_fewer_steps_is_left_alone_when_the_change_is_allowed(
        finished_run, capsys):
    result = train(finished_run.with_overrides(steps=2, allow_changes="steps"))
    assert result.status == "finished_before"
    out = capsys.readouterr().out
    assert "at step 4, past --steps=2; nothing to do" in out
    assert "or train it further with --steps 8 --allow-changes steps" in out


def test_more_steps_continue_a_finished_run_and_the_derived_warmup_follows(tmp_path, corpus,
                                                                           capsys):
    """``--steps`` with ``--allow-changes steps`` is enough: the warm-up left to its default
    (5% of the steps) follows the new length instead of being refused as a second change."""
    cfg = TrainConfig(steps=40, data=corpus, out=str(tmp_path / "run"), checkpoint_every=40,
                      **TINY)
    assert train(cfg).config.warmup == 2
    # What the finished run's message suggests, as it says it, works.
    assert train(cfg).status == "finished_before"
    suggested = re.search(r"--steps (\d+) --allow-changes steps", capsys.readouterr().out)
    assert suggested and suggested.group(1) == "80"
    with pytest.raises(ConfigError, match=r"steps 40 -> 60 \(add --allow-changes steps"):
        train(cfg.with_overrides(steps=60))
    result = train(cfg.with_overrides(steps=80, allow_changes="steps"))
    assert result.status == "done" and result.summary["steps"] == 80
    assert result.config.warmup == 4
    (resume,) = json.loads((tmp_path / "run" / "config.json").read_text())["resumes"]
    assert resume["changed"]["steps"] == [40, 80] and resume["changed"]["warmup"] == [2, 4]
    # A warm-up the user set to another value than the steps' default (5) is a setting of its
    # own: changing it is named, with every flag the resume needs.
    with pytest.raises(ConfigError, match=r"warmup 4 -> 6 \(add --allow-changes steps,warmup"):
        train(cfg.with_overrides(steps=100, warmup=6, allow_changes="steps"))
    # Left to its default, it follows the steps: the message asks for steps alone.
    with pytest.raises(ConfigError, match=r"steps 80 -> 100 \(add --allow-changes steps to "
                       r"accept\); warmup 4 -> 5 \(follows --steps: accepted with it\)"):
        train(cfg.with_overrides(steps=100))


def test_bad_settings_fail_before_anything_is_written(tmp_path, corpus):
    out = tmp_path / "never"
    with pytest.raises(ConfigError, match="lora_targets='nothing'"):
        train(TrainConfig(steps=2, data=corpus, out=str(out), lora_rank=2,
                          lora_targets="nothing", lora_random_base=True, **TINY))
    assert not out.exists() or not any(out.rglob("*.json"))
    assert not os.path.exists(out / "metrics.jsonl")


# A second family plugs in, and pretrained models are a source ----------------------------------

def test_the_llama_family_trains_through_the_same_recipe(tmp_path, corpus):
    result = train(TrainConfig(steps=3, data=corpus, out=str(tmp_path / "l"),
                               **{**TINY, "model": "llama-tiny"}))
    config = json.loads((tmp_path / "l" / "config.json").read_text())
    assert config["run"]["model_config"]["family"] == "llama"
    assert result.summary["steps"] == 3 and np.isfinite(result.summary["eval_loss"])


def test_lora_from_a_gguf_file_freezes_its_weights_and_exports_hf_names(tmp_path, corpus):
    gguf = pytest.importorskip("gguf", reason="loading GGUF files needs the gguf package")
    del gguf
    import jax
    from _llama_files import VOCAB_SIZE, write_gguf
    from safetensors.numpy import load_file

    from effijax.models import llama_config

    model = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=16)
    params = model.init_params(jax.random.key(3))
    file = tmp_path / "tiny.gguf"
    write_gguf(file, model, params)
    out = tmp_path / "run"
    result = train(TrainConfig(model_from=str(file), lora_rank=2, steps=3, data=corpus,
                               out=str(out), **{**TINY, "model": "mini"}))
    record = json.loads((out / "config.json").read_text())["run"]
    import hashlib

    assert record["init_from_checkpoint"] == {
        "path": str(file.resolve()), "sha256": hashlib.sha256(file.read_bytes()).hexdigest()}
    assert record["model_config"]["family"] == "llama"
    assert result.summary["eval_loss"] < result.summary["eval_loss_start"]  # it learns
    names = sorted(load_file(out / "peft" / "adapter_model.safetensors"))
    assert names[0].startswith("base_model.model.model.layers.0.")
    peft_config = json.loads((out / "peft" / "adapter_config.json").read_text())
    assert peft_config["base_model_name_or_path"] == str(file)
    with pytest.raises(ConfigError, match="model_from='nowhere.gguf': no such run directory"):
        train(TrainConfig(model_from="nowhere.gguf", lora_rank=2, out=str(tmp_path / "x"),
                          **TINY))


def test_export_hf_writes_the_merged_model_transformers_loads(tmp_path, corpus):
    # A LoRA run on a (tiny, saved) Hugging Face model: OUT/hf holds the adapters merged into
    # the base, whose logits equal the base + adapters applied factored; OUT/model.gguf (f32)
    # holds the same weights.
    import jax
    import numpy as np

    from effijax.interop import load_pretrained, save_hf
    from effijax.lora import load_adapters
    from effijax.models import preset

    base = preset("llama-tiny")
    save_hf(tmp_path / "base", base, base.init_params(jax.random.key(0)))
    out = tmp_path / "run"
    result = train(TrainConfig(steps=3, data=corpus, out=str(out),
                               model_from=str(tmp_path / "base"), lora_rank=4, lr=1e-2,
                               seq_len=16, batch_size=4, eval_batches=1, progress=False,
                               export_hf=True, export_gguf="f32"))
    assert result.summary["hf"] == str(out / "hf")
    assert result.summary["gguf"] == str(out / "model.gguf")
    merged_model, merged = load_pretrained(out / "hf")
    _, plain = load_pretrained(tmp_path / "base")
    adapters, spec = load_adapters(out / "adapters.safetensors", plain)
    tokens = np.arange(16, dtype=np.int32)[None] % base.vocab_size
    want = base.logits_fn(spec)({"base": plain, "adapters": adapters}, tokens)
    got = merged_model.logits_fn()(merged, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The adapters moved the model: the export is not the base.
    assert not np.allclose(merged_model.logits_fn()(plain, tokens), got, atol=1e-4)
    gguf_model, from_gguf = load_pretrained(out / "model.gguf", seq_len=merged_model.seq_len)
    assert gguf_model == merged_model
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(from_gguf),
                                                    jax.tree.leaves(merged), strict=True))


def test_export_hf_is_refused_for_the_gpt(tmp_path, corpus):
    with pytest.raises(ConfigError, match="export_hf=True: writes a Hugging Face"):
        train(TrainConfig(steps=2, data=corpus, out=str(tmp_path / "g"), export_hf=True, **TINY))
    with pytest.raises(ConfigError, match=r"^export_gguf='q8_0': writes a GGUF file; "
                       r"model='.*': the gpt family has no Hugging Face counterpart"):
        train(TrainConfig(steps=2, data=corpus, out=str(tmp_path / "g"), export_gguf="q8_0",
                          **TINY))
    with pytest.raises(ConfigError, match=r"^export_gguf='q4_k': GGUF tensor types effijax "
                       r"writes: f32, f16, bf16, q8_0"):
        TrainConfig(export_gguf="q4_k")
    assert not (tmp_path / "g").exists()


def test_a_file_that_is_not_a_model_is_named_as_such(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model\n")
    with pytest.raises(ConfigError, match=r"model_from='.*notes.txt': is a file but not a GGUF "
                       r"model \(it starts with b'not ', not b'GGUF'\)"):
        train(TrainConfig(model_from=str(notes), out=str(tmp_path / "run"), **TINY))


def test_too_little_text_says_how_much_is_needed_and_the_longest_window_that_fits(tmp_path):
    from effijax.sources._data import load_dataset

    small = tmp_path / "notes.txt"
    small.write_text("x = 1\n" * 281)  # 1,686 bytes
    model = gpt_config("tiny", seq_len=128)
    with pytest.raises(ConfigError) as e:
        load_dataset(str(small), model)
    assert e.value.field == "data"
    assert ("1,686 tokens are too few for seq_len 128: it needs at least 2,590 (5% is held "
            "out for validation, and each part must hold a window of 130 tokens); add data, "
            "or lower --seq-len to at most 82") in e.value.problem, e.value.problem
    # Both suggestions work: the longest window named, and the amount of data named.
    assert load_dataset(str(small), gpt_config("tiny", seq_len=82)).tokens == 1686
    with pytest.raises(ConfigError, match="at most 82"):
        load_dataset(str(small), gpt_config("tiny", seq_len=83))
    enough = tmp_path / "enough.txt"
    enough.write_bytes(b"x" * 2590)
    assert load_dataset(str(enough), model).tokens == 2590
    enough.write_bytes(b"x" * 2589)
    with pytest.raises(ConfigError, match="needs at least 2,590"):
        load_dataset(str(enough), model)


def test_a_run_killed_after_its_last_checkpoint_completes_its_end_and_summarises_it_all(
        tmp_path, corpus, capsys):
    """A finished run is one whose end (evaluation, exports, summary.json) was written: a run
    stopped after its last checkpoint is completed by the same command, and a resumed run's
    summary describes every step, not only the steps after the resume."""
    import shutil

    cfg = TrainConfig(steps=8, data=corpus, checkpoint_every=2, keep=10, **TINY)
    whole = train(cfg.with_overrides(out=str(tmp_path / "whole"))).summary
    assert whole["final_loss_steps"] == 8 and whole["trained_tokens"] == 8 * 2 * 16
    # Killed after the final checkpoint: no summary.json yet.
    ended = tmp_path / "ended"
    shutil.copytree(tmp_path / "whole", ended)
    (ended / "summary.json").unlink()
    capsys.readouterr()
    done = train(cfg.with_overrides(out=str(ended)))
    assert done.status == "done"
    out = capsys.readouterr().out
    assert "stopped before its end was written; completing it" in out
    assert "(mean of the last 8 steps)" in out  # not "of the last 10" of an 8-step run
    # Killed after step 4: the resumed run's summary is the uninterrupted one's.
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "whole", part)
    (part / "summary.json").unlink()
    for step in ("6", "8"):
        shutil.rmtree(part / "checkpoints" / step)
    resumed = train(cfg.with_overrides(out=str(part))).summary
    assert resumed["start_step"] == 4
    for summary in (done.summary, resumed):
        for key in ("steps", "final_loss", "final_loss_steps", "trained_tokens", "eval_loss"):
            assert summary[key] == whole[key], (key, summary[key], whole[key])
    assert json.loads((part / "summary.json").read_text())["final_loss"] == whole["final_loss"]
    assert train(cfg.with_overrides(out=str(ended))).status == "finished_before"
