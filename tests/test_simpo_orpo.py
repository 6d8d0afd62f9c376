"""SimPO and ORPO through the recipe (`effijax train --objective simpo|orpo`), with and without
LoRA: the losses, gradients and metrics of a batch of pairs on the same tiny Llama equal TRL's
trainers' own code on ``transformers``' model of the same weights, runs train and write TRL's
metrics, settings are checked before anything compiles, and runs recorded before these
objectives existed still load and resume.

The TRL reference is TRL 1.16 (``trl.experimental.cpo.CPOTrainer`` with ``loss_type="simpo"``
and ``trl.experimental.orpo.ORPOTrainer``): their own ``get_batch_loss_metrics``,
``concatenated_forward``, ``concatenated_inputs``, ``get_batch_logps`` and ``cpo_loss`` /
``odds_ratio_loss``, called with a stand-in ``self`` (``types.SimpleNamespace``: a trainer
needs a dataset and an optimizer to be built) on ``LlamaForCausalLM`` loaded from effijax's
``save_hf`` export of the same weights (under LoRA, ``peft`` loading ``save_peft``'s export of
the same adapters). The batch is the recipe's own (:func:`pair_batch`), given to TRL as its
collator would: each row cut after its completion's last token, padded, prompt labels -100.
The tests that need TRL skip without it (the interop extra) and, with the end-to-end runs, are
marked slow (TRL's import alone is about 6 s).
"""

import dataclasses
import functools
import inspect
import json
import math
import types
import warnings

import jax
import numpy as np
import optax
import pytest
from _adapters import random_adapters
from _compiles import compiles
from _llama_files import VOCAB_SIZE, chat_tokenizer, torch_tensors
from _pairs import write_model_and_pairs

from effijax.cli import main as cli_main
from effijax.errors import ConfigError
from effijax.interop import save_hf, save_peft
from effijax.lora import LoraSpec
from effijax.models import llama_config
from effijax.objectives import orpo_loss, simpo_loss
from effijax.recipe import TrainConfig, plan_job
from effijax.recipe._config import OBJECTIVES
from effijax.recipe._identity import OBJECTIVE_SETTINGS, check_resume, identity
from effijax.recipe._objectives import get_objective
from effijax.recipe._pairs import load_pairs, pair_batch

SEQ = 32
TINY = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=SEQ)
PAD = 2  # chat_tokenizer's padding (and EOS, and end of turn): <|im_end|>
slow = pytest.mark.slow

SIMPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                 "logps/chosen", "logps/rejected", "nll_loss")
ORPO_METRICS = SIMPO_METRICS + ("log_odds_ratio", "log_odds_chosen")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = write_model_and_pairs(tmp_path_factory.mktemp("reference_free"), TINY)
    # One pair, 20 times: one copy is held out, every training batch is that pair.
    (d / "one.jsonl").write_text(20 * (json.dumps({"prompt": "3+1", "chosen": "4",
                                                   "rejected": "the 3"}) + "\n"))
    return d


# Settings ---------------------------------------------------------------------------------------


def test_the_config_knows_each_objective_and_its_settings():
    assert set(OBJECTIVE_SETTINGS) == set(OBJECTIVES) >= {"simpo", "orpo"}
    assert not get_objective("simpo").reference and not get_objective("orpo").reference
    # The config's defaults are the losses' (TRL's CPOConfig and ORPOConfig defaults, checked
    # against TRL itself in test_the_defaults_are_trls).
    config = TrainConfig(objective="simpo", data="p.jsonl")
    defaults = {name: p.default for name, p in inspect.signature(simpo_loss).parameters.items()}
    assert config.objective_settings == {k: defaults[k] for k in
                                         ("beta", "gamma", "cpo_alpha", "label_smoothing")}
    assert defaults["cpo_alpha"] == 1.0 and defaults["gamma"] == 0.5
    assert TrainConfig(objective="orpo", data="p.jsonl").objective_settings == {
        "beta": inspect.signature(orpo_loss).parameters["beta"].default}
    assert TrainConfig(objective="simpo", data="p.jsonl", beta=2.0, simpo_gamma=1.0,
                       cpo_alpha=0.0, label_smoothing=0.1).objective_settings == {
        "beta": 2.0, "gamma": 1.0, "cpo_alpha": 0.0, "label_smoothing": 0.1}


@pytest.mark.parametrize("kwargs, message", [
    ({"objective": "orpo", "simpo_gamma": 1.0}, "simpo_gamma=1.0: only applies to --objective "
                                                "simpo"),
    ({"objective": "dpo", "lora_rank": 2, "cpo_alpha": 0.0}, "cpo_alpha=0.0: only applies to "
                                                             "--objective simpo"),
    ({"objective": "orpo", "label_smoothing": 0.1}, "label_smoothing=0.1: only applies to "
                                                    "--objective dpo or simpo"),
    ({"objective": "simpo", "dpo_loss": "ipo"}, "dpo_loss='ipo': only applies to --objective "
                                                "dpo"),
    ({"beta": 0.5}, "beta=0.5: only applies to --objective dpo, simpo, orpo or grpo"),
    ({"objective": "simpo", "cpo_alpha": -1.0}, "cpo_alpha=-1.0: must be >= 0"),
    ({"objective": "simpo", "simpo_gamma": math.inf}, "simpo_gamma=inf: must be a finite"),
    ({"objective": "simpo", "label_smoothing": 0.5}, "label_smoothing=0.5: must be in [0, 0.5)"),
    ({"objective": "orpo", "beta": 0.0}, "beta=0.0: must be > 0"),
    ({"objective": "orpo", "batch_size": 5}, "batch_size=5: counts rows, and orpo trains pairs"),
    ({"objective": "simpo", "data": None}, "data=None: simpo trains on preference pairs"),
])
def test_a_bad_or_misplaced_setting_is_refused_by_name(kwargs, message):
    kwargs = {"model_from": "x.gguf", "data": "p.jsonl", **kwargs}
    with pytest.raises(ConfigError) as e:
        TrainConfig(**kwargs)
    assert str(e.value).startswith(message), str(e.value)


def test_simpo_and_orpo_train_without_lora_and_simpo_smooths_labels():
    for kwargs in ({"objective": "simpo", "label_smoothing": 0.2, "cpo_alpha": 0.0},
                   {"objective": "orpo", "beta": 0.5}):
        assert TrainConfig(model_from="x.gguf", data="p.jsonl", **kwargs).lora_rank is None


def test_bad_settings_are_refused_before_compiling(files, tmp_path, capsys):
    with compiles() as compiled:
        assert cli_main(["train", "--objective", "orpo", "--from", str(files / "tiny.gguf"),
                         "--data", str(files / "pairs.jsonl"), "--simpo-gamma", "1",
                         "--out", str(tmp_path / "run")]) == 2
    assert compiled == []
    err = capsys.readouterr().err.strip()
    assert "--simpo-gamma" in err and "only applies to --objective simpo" in err, err
    assert len(err.splitlines()) == 1, err
    # The library path: the loss's own checks, on abstract values, when the job is planned.
    spec = LoraSpec(rank=2, targets=TINY.lora_targets)
    for name, settings, field in (("simpo", {"beta": 0.0}, "beta"),
                                  ("simpo", {"gamma": "1"}, "gamma"),
                                  ("simpo", {"cpo_alpha": -1.0}, "cpo_alpha"),
                                  ("orpo", {"beta": -1.0}, "beta"),
                                  ("dpo", {"loss_type": "ipo", "label_smoothing": 0.1},
                                   "label_smoothing")):
        with pytest.raises(ConfigError) as e:
            plan_job(TINY, "fp32", optax.sgd(0.0), batch_size=4, masked=True, segmented=False,
                     lora=spec if name == "dpo" else None, objective=get_objective(name),
                     objective_settings=settings)
        assert e.value.field == field
        assert not getattr(e.value, "__notes__", None)  # no traced function's note from JAX


def test_old_runs_load_and_simpo_settings_are_its_identity():
    # A DPO run recorded before simpo_gamma and cpo_alpha existed: the same config, the same run.
    old = {"seed": 0, "batch_size": 4, "precision": "fp32", "loss_scale": "none",
           "accumulate": 1, "lora_rank": 2, "model_from": "x.gguf", "data": "p.jsonl",
           "objective": "dpo", "beta": 0.1, "dpo_loss": "sigmoid", "label_smoothing": 0.0,
           "run": {"corpus_sha256": "ab", "model_config": {"family": "llama", "seq_len": 32}}}
    new = {**old, **{k: v for k, v in TrainConfig.from_dict(old).to_dict().items()
                     if k in ("simpo_gamma", "cpo_alpha")}}
    assert TrainConfig.from_dict(old).objective == "dpo" and "cpo_alpha" in new
    assert identity(old) == identity(new)
    assert check_resume(old, new, (), where="ckpt") == {}
    # A SimPO run continues only with its settings; another gamma is another run.
    simpo = {**new, "objective": "simpo", "simpo_gamma": 0.5, "cpo_alpha": 1.0}
    assert check_resume(simpo, simpo, (), where="ckpt") == {}
    with pytest.raises(ConfigError, match="simpo_gamma"):
        check_resume(simpo, {**simpo, "simpo_gamma": 1.0}, (), where="ckpt")
    with pytest.raises(ConfigError, match="objective"):
        check_resume(simpo, {**simpo, "objective": "orpo"}, (), where="ckpt")


# Parity with TRL --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trl(one_torch_thread):
    """TRL's CPO and ORPO trainers and configs (the classes, never instantiated), and torch."""
    pytest.importorskip("trl", minversion="1.16",
                        reason="trl>=1.16 (the interop extra) is not installed: the parity "
                        "tests against TRL's SimPO and ORPO skip")
    import torch

    with warnings.catch_warnings():
        # trl.experimental says on its first import that its APIs may change: why the interop
        # extra bounds TRL's version and these tests name what they call.
        warnings.filterwarnings("ignore", message="You are importing from 'trl.experimental'")
        from trl.experimental.cpo import CPOConfig, CPOTrainer
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer
    return types.SimpleNamespace(torch=torch, CPOTrainer=CPOTrainer, ORPOTrainer=ORPOTrainer,
                                 CPOConfig=CPOConfig, ORPOConfig=ORPOConfig)


@pytest.fixture(scope="module")
def same_model(files, tmp_path_factory, trl):
    """The tiny Llama (random weights, the chat tokenizer) in effijax and as ``transformers``
    loads its ``save_hf`` export, random LoRA adapters on it (their ``save_peft`` export), and
    a training batch of 4 pairs as the recipe draws it."""
    import transformers

    d = tmp_path_factory.mktemp("hf")
    model = dataclasses.replace(TINY, tokenizer=chat_tokenizer())
    params = model.init_params(jax.random.key(0))
    save_hf(d / "model", model, params)
    spec = LoraSpec(rank=2, alpha=8.0, targets=model.lora_targets)
    adapters = random_adapters(params, spec, seed=3, scale=0.1)
    save_peft(d / "adapter", model, adapters, spec, base_model=str(d / "model"))
    batch = pair_batch(load_pairs(str(files / "pairs.jsonl"), model).train, seed=0, step=0,
                       batch_size=8, seq_len=SEQ)

    def hf():
        """A fresh ``transformers`` model of the export, in training mode."""
        loaded = transformers.AutoModelForCausalLM.from_pretrained(d / "model",
                                                                   dtype=trl.torch.float32)
        # transformers builds the embedding with padding_idx = the pad id, and torch never
        # trains that row; effijax trains every row (here <|im_end|> is the pad, the EOS and a
        # real token of every pair). Cleared: the gradients compare on every row.
        assert loaded.model.embed_tokens.padding_idx == PAD
        loaded.model.embed_tokens.padding_idx = None
        return loaded.train()

    return types.SimpleNamespace(model=model, params=params, spec=spec, adapters=adapters,
                                 batch=batch, hf=hf, dir=d)


def _trl_batch(torch, batch):
    """The recipe's batch as TRL's collator gives it: ``{chosen,rejected}_{input_ids,
    attention_mask,labels}``, each row cut after its completion's last token (its sequence,
    as the ORPO objective counts it) and padded, the prompt's labels -100."""
    tokens_BW = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
    mask_BW = np.concatenate([np.zeros_like(batch["mask"][:, :1]), batch["mask"]], axis=1)
    length_B = np.array([np.flatnonzero(row).max() + 1 for row in mask_BW])
    width = length_B.max()
    real_BW = np.arange(width) < length_B[:, None]
    ids_BW = np.where(real_BW, tokens_BW[:, :width], PAD)
    labels_BW = np.where(mask_BW[:, :width] != 0, tokens_BW[:, :width], -100)
    out = {}
    for side, rows in (("chosen", slice(0, None, 2)), ("rejected", slice(1, None, 2))):
        out[f"{side}_input_ids"] = torch.tensor(ids_BW[rows], dtype=torch.long)
        out[f"{side}_attention_mask"] = torch.tensor(real_BW[rows].astype(np.int64))
        out[f"{side}_labels"] = torch.tensor(labels_BW[rows], dtype=torch.long)
    return out


def _stand_in(trl, trainer, **attributes):
    """A ``self`` for ``trainer``'s methods: what they read, and the methods they call."""
    torch = trl.torch
    self = types.SimpleNamespace(
        is_encoder_decoder=False, aux_loss_enabled=False, pad_token_id=PAD, padding_value=PAD,
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x,
                                          gather_for_metrics=lambda x: x), **attributes)
    self.concatenated_inputs = trainer.concatenated_inputs  # static methods
    self.get_batch_logps = trainer.get_batch_logps
    self.concatenated_forward = functools.partial(trainer.concatenated_forward, self)
    return self


def _trl_side(trl, name, settings, model, batch):
    """TRL's ``get_batch_loss_metrics`` on ``model`` (torch): (loss, metrics, {parameter name:
    gradient}) of the trained parameters."""
    if name == "simpo":
        self = _stand_in(trl, trl.CPOTrainer, loss_type="simpo", alpha=0.0,
                         beta=settings["beta"], simpo_gamma=settings["gamma"],
                         cpo_alpha=settings["cpo_alpha"],
                         label_smoothing=settings["label_smoothing"])
        self.cpo_loss = functools.partial(trl.CPOTrainer.cpo_loss, self)
        trainer = trl.CPOTrainer
    else:
        self = _stand_in(trl, trl.ORPOTrainer, beta=settings["beta"])
        self.odds_ratio_loss = functools.partial(trl.ORPOTrainer.odds_ratio_loss, self)
        trainer = trl.ORPOTrainer
    model.zero_grad()
    loss, metrics = trainer.get_batch_loss_metrics(self, model, _trl_batch(trl.torch, batch))
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.requires_grad}
    return loss.item(), metrics, grads


def _ours(name, settings, model, spec, trained, batch):
    """The objective's loss (the recipe's) differentiated: (loss, metrics, gradients)."""
    loss = get_objective(name).loss(model, spec, **settings)
    (value, metrics), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(trained, batch)
    return float(value), {k: float(v) for k, v in metrics.items()}, grads


def _assert_close(ours, theirs, what, rtol=2e-6):
    np.testing.assert_allclose(np.float64(ours), np.float64(theirs), rtol=rtol, atol=rtol,
                               err_msg=what)


def _assert_grads_close(ours: dict, theirs: dict, rtol: float):
    """Each parameter's gradient within ``rtol`` of its largest entry (entries near 0 are sums
    that cancel, and the two frameworks add in other orders)."""
    assert set(ours) == set(theirs) and ours
    for name, want in theirs.items():
        scale = np.abs(want).max()
        assert scale > 0, name
        assert np.abs(ours[name] - want).max() <= rtol * scale, name


SETTINGS = [
    ("simpo", {"beta": 0.1, "gamma": 0.5, "cpo_alpha": 1.0, "label_smoothing": 0.0}),  # TRL's
    ("simpo", {"beta": 2.0, "gamma": 1.0, "cpo_alpha": 0.0, "label_smoothing": 0.1}),
    ("orpo", {"beta": 0.1}),
    ("orpo", {"beta": 1.0}),
]


@slow
def test_the_defaults_are_trls(trl):
    config = TrainConfig(objective="simpo", data="pairs.jsonl")  # beta: the objective's own
    cpo = {f.name: f.default for f in dataclasses.fields(trl.CPOConfig)}
    orpo = {f.name: f.default for f in dataclasses.fields(trl.ORPOConfig)}
    assert (config.objective_settings["beta"], config.simpo_gamma, config.cpo_alpha,
            config.label_smoothing) == (cpo["beta"], cpo["simpo_gamma"], cpo["cpo_alpha"],
                                        cpo["label_smoothing"])
    assert TrainConfig(objective="orpo", data="pairs.jsonl").objective_settings["beta"] \
        == orpo["beta"]


@slow
@pytest.mark.parametrize("name, settings", SETTINGS)
def test_full_fine_tuning_equals_trl(trl, same_model, name, settings):
    m = same_model
    loss, metrics, grads = _ours(name, settings, m.model, None, m.params, m.batch)
    trl_loss, trl_metrics, trl_grads = _trl_side(trl, name, settings, m.hf(), m.batch)
    _assert_close(loss, trl_loss, "loss")
    names = ORPO_METRICS if name == "orpo" else SIMPO_METRICS
    assert set(metrics) == set(names)
    for metric in names:
        if metric == "nll_loss" and settings.get("cpo_alpha") == 0.0:
            assert trl_metrics[metric] == 0.0  # TRL skips the NLL then; effijax logs it
            assert metrics[metric] > 0
            continue
        _assert_close(metrics[metric], trl_metrics[metric], metric)
    # Measured: at most 4.4e-7 of a parameter's largest entry.
    _assert_grads_close({k: a for k, (_, a) in torch_tensors(m.model, grads).items()},
                        trl_grads, rtol=2e-6)


# peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`: their warning, not ours.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@slow
@pytest.mark.parametrize("name, settings", [SETTINGS[1], SETTINGS[2]])
def test_lora_equals_trl_with_peft(trl, same_model, name, settings, tmp_path):
    import peft
    import safetensors.numpy

    m = same_model
    loss, metrics, grads = _ours(name, settings, m.model, m.spec, m.adapters,
                                 {**m.batch, "base": m.params})
    hf = peft.PeftModel.from_pretrained(m.hf(), m.dir / "adapter").train()
    for p_name, p in hf.named_parameters():  # the adapters trained, the base frozen
        p.requires_grad_(".lora_" in p_name)
    trl_loss, trl_metrics, trl_grads = _trl_side(trl, name, settings, hf, m.batch)
    _assert_close(loss, trl_loss, "loss")
    for metric in ORPO_METRICS if name == "orpo" else SIMPO_METRICS[:-1]:
        _assert_close(metrics[metric], trl_metrics[metric], metric)
    # The adapters' gradients in PEFT's names and layout, as save_peft writes adapters.
    save_peft(tmp_path, m.model, grads, m.spec, base_model="x")
    ours = safetensors.numpy.load_file(tmp_path / "adapter_model.safetensors")
    # Measured: at most 6.4e-6 of an adapter's largest entry (PEFT scales B's product, effijax
    # the factored one: another order of the same products).
    _assert_grads_close(ours, {k.replace(".default", ""): g for k, g in trl_grads.items()},
                        rtol=2e-5)


# End to end -------------------------------------------------------------------------------------


@slow
@pytest.mark.parametrize("objective", ["simpo", "orpo"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_run_trains_a_fixed_pair_and_writes_trls_metrics(files, tmp_path, objective, lora):
    out = tmp_path / "run"
    assert cli_main(["train", "--objective", objective, "--from", str(files / "tiny.gguf"),
                     "--data", str(files / "one.jsonl"), "--steps", "6", "--batch-size", "4",
                     "--seq-len", str(SEQ), "--lr", "1e-2", "--precision", "fp32",
                     "--eval-batches", "1", "--no-progress", "--out", str(out),
                     *(["--lora-rank", "2"] if lora else [])]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for name in (*(ORPO_METRICS if objective == "orpo" else SIMPO_METRICS), "loss", "tokens"):
        assert all(math.isfinite(r[name]) for r in records), name
    assert "lm_loss" not in records[0]
    losses = [r["loss"] for r in records]
    # Step 1 trains at the warm-up's learning rate 0; from there each step lowers the loss.
    assert losses[1] == losses[0]
    assert all(b < a for a, b in zip(losses[1:], losses[2:], strict=False)), losses
    assert losses[-1] < 0.95 * losses[0], losses
    assert records[-1]["rewards/accuracies"] == 1.0  # the chosen side now has the higher reward
    config = json.loads((out / "config.json").read_text())
    assert config["objective"] == objective and (config["lora_rank"] == 2) == lora
