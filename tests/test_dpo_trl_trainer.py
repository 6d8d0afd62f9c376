"""Full fine-tuning DPO against TRL's own ``DPOTrainer`` with an explicit ``ref_model``: on the
same tiny Llama, weights and batch of pairs, effijax's training step gives TRL's loss, every
parameter's gradient and TRL's reward metrics.

The TRL reference is TRL 1.16's ``trl.DPOTrainer`` itself, built as a user builds it
(``DPOConfig`` with ``beta=0.1``, ``loss_type=["sigmoid"]``, no precomputed reference, dropout
off, and ``bf16=False``: its default is True, bf16 autocast even on the CPU, which accelerate
wraps around the ``ref_model``'s forward when the trainer prepares it), on ``transformers``'
``LlamaForCausalLM`` loaded from effijax's ``save_hf`` export of the policy's weights, with
``ref_model`` a second ``LlamaForCausalLM`` loaded from the export of the reference's (the
starting weights; the trainer prepares it in evaluation mode). TRL 1.x has no
separate ``dpo_loss``: its ``compute_loss`` runs the policy and the reference through its fused
LM head (``add_fused_lm_head``), sums the completion tokens' log-probabilities, and logs its
metrics into ``_metrics["train"]``; that is what is called here, on one batch, without
``train()`` (which would also step an optimizer), inside ``compute_loss_context_manager`` as its
``training_step`` calls it, and ``loss.backward()`` gives the gradients.
The loss follows TRL 1.0's refactor (PR #3906): ``sigmoid`` takes no label smoothing.

The batch is the recipe's own (:func:`pair_batch`: 4 pairs), given to TRL as its
``DataCollatorForPreference`` (the trainer's ``data_collator``) collates ``prompt_ids`` /
``chosen_ids`` / ``rejected_ids``, read off effijax's rows. TRL's own tokenization of the same
conversations is checked against those ids first: the prompt's ids are effijax's, and TRL's
completion is effijax's followed by the ``"\\n"`` the chat template writes after
``<|im_end|>``, which effijax leaves out of the completion (docs/preference.md, Rendering):
here the ids are effijax's, so that the two compute the same quantity.

effijax's side is ``plan_job`` with the dpo objective in fp32 (the llama has no dropout) and
its reference copy in float32, one call of its jitted training step; the gradients are the
ones the step hands its optimizer (an optax transformation that keeps them as its state).
Importing TRL (torch, transformers, accelerate, datasets) alone takes seconds: the module is
slow, and skips where torch or TRL is not installed (the interop extra).
"""

import dataclasses
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _llama_files import VOCAB_SIZE, chat_tokenizer, torch_tensors
from _pairs import write_pairs

from effijax.interop import save_hf
from effijax.models import llama_config
from effijax.recipe import init_state, plan_job
from effijax.recipe._objectives import get_objective
from effijax.recipe._pairs import PAIR_METRICS, load_pairs, pair_batch, read_pairs

pytestmark = pytest.mark.slow

SEQ = 32
TINY = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=SEQ)
ROWS = 8  # 4 pairs
BETA = 0.1
PAD = 2  # <|im_end|>: the tiny vocabulary's EOS and padding
NEWLINE = 13  # "\n" (byte 0x0a) in the tiny vocabulary
EPS = float(np.finfo(np.float32).eps)


def _keep_grads() -> optax.GradientTransformation:
    """An optimizer that leaves the parameters as they are and keeps the step's gradients as
    its state: what the training step hands an optimizer, exactly."""
    return optax.GradientTransformation(
        init=lambda params: jax.tree.map(jnp.zeros_like, params),
        update=lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


@pytest.fixture(scope="module")
def same(tmp_path_factory):
    """The tiny Llama's reference (seed 0) and a policy moved away from it, both exported by
    ``save_hf``, the pairs, and the recipe's training batch of 4 pairs."""
    d = tmp_path_factory.mktemp("dpo_trl")
    write_pairs(d / "pairs.jsonl")
    model = dataclasses.replace(TINY, tokenizer=chat_tokenizer())
    reference = model.init_params(jax.random.key(0))
    leaves, treedef = jax.tree.flatten(reference)
    keys = jax.random.split(jax.random.key(5), len(leaves))
    # A policy one training run away from its reference (as tests/test_dpo.py moves it): the
    # rewards are then not 0 and the pairs not all tied.
    policy = treedef.unflatten([x + 0.02 * jax.random.normal(k, x.shape, x.dtype)
                                for x, k in zip(leaves, keys, strict=True)])
    save_hf(d / "policy", model, policy)
    save_hf(d / "reference", model, reference)
    batch = pair_batch(load_pairs(str(d / "pairs.jsonl"), model).train, seed=0, step=0,
                       batch_size=ROWS, seq_len=SEQ)
    return types.SimpleNamespace(dir=d, model=model, policy=policy, reference=reference,
                                 batch=batch)


@pytest.fixture(scope="module")
def ours(same):
    """effijax's training step on the batch: (loss, metrics, gradients in transformers' names
    and layout)."""
    job = plan_job(same.model, "fp32", _keep_grads(), batch_size=ROWS, masked=True,
                   segmented=False, objective=get_objective("dpo"), frozen_dtype="float32",
                   objective_settings={"beta": BETA, "loss_type": "sigmoid"})
    state = init_state(job, same.policy)
    state, metrics = job.step(state, {**same.batch, "reference": same.reference})
    grads = {name: array for name, (_, array) in torch_tensors(same.model,
                                                               state.opt_state).items()}
    return float(metrics["loss"]), {k: float(v) for k, v in metrics.items()}, grads


def _pair_ids(batch) -> list[dict]:
    """TRL's tokenized examples (``prompt_ids``, ``chosen_ids``, ``rejected_ids``) of the
    batch's pairs, read off effijax's rows: the tokens before the completion, and the
    completion's (its trained tokens)."""
    tokens_BW = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
    mask_BW = np.concatenate([np.zeros_like(batch["mask"][:, :1]), batch["mask"]], axis=1)
    sides = []
    for ids, mask in zip(tokens_BW.tolist(), mask_BW, strict=True):
        trained = np.flatnonzero(mask)
        first, last = int(trained[0]), int(trained[-1])
        assert trained.tolist() == list(range(first, last + 1))  # one span
        sides.append((ids[:first], ids[first:last + 1]))
    examples = []
    for (prompt, chosen), (other, rejected) in zip(sides[0::2], sides[1::2], strict=True):
        assert prompt == other  # a pair's two rows share their prompt
        examples.append({"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected})
    return examples


@pytest.fixture(scope="module")
def theirs(same):
    """TRL's ``DPOTrainer`` on the same batch: (loss, its train metrics, {parameter name:
    gradient}), and the trainer."""
    pytest.importorskip("torch", reason="the TRL parity test needs torch (effijax[interop])")
    pytest.importorskip("trl", minversion="1.16",
                        reason="trl>=1.16 (the interop extra) is not installed: the parity "
                        "test against TRL's DPOTrainer skips")
    import datasets
    import torch
    import transformers
    import trl
    from _reference import torch_threads

    datasets.disable_progress_bars()
    with torch_threads(1), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TRL's and transformers' advice
        # TRL 1.16 reads transformers 5's deprecated `is_gradient_checkpointing` around the
        # reference's forward: their warning, not ours.
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated",
                                FutureWarning)

        def load(name):
            model = transformers.LlamaForCausalLM.from_pretrained(same.dir / name,
                                                                  dtype=torch.float32)
            # transformers builds the embedding with padding_idx = the pad id, and torch never
            # trains that row; effijax trains every row (<|im_end|> is the pad, the EOS and a
            # real token of every pair). Cleared: the gradients compare on every row.
            assert model.model.embed_tokens.padding_idx == PAD
            model.model.embed_tokens.padding_idx = None
            return model

        policy, reference = load("policy"), load("reference")
        tokenizer = transformers.AutoTokenizer.from_pretrained(same.dir / "policy")
        # The pairs in TRL's conversational form, which the trainer tokenizes with the chat
        # template save_hf wrote (effijax renders a pair the same way: [user, assistant]).
        dataset = datasets.Dataset.from_list([
            {"prompt": [{"role": "user", "content": p.prompt}],
             "chosen": [{"role": "assistant", "content": p.chosen}],
             "rejected": [{"role": "assistant", "content": p.rejected}]}
            for p in read_pairs(str(same.dir / "pairs.jsonl"))])
        args = trl.DPOConfig(
            output_dir=str(same.dir / "trl"), report_to="none", use_cpu=True,
            bf16=False,  # DPOConfig's default is True: bf16 autocast, even on the CPU
            beta=BETA, loss_type=["sigmoid"], precompute_ref_log_probs=False,
            activation_checkpointing=False, disable_dropout=True, dataloader_num_workers=0,
            per_device_train_batch_size=ROWS // 2, seed=0)
        trainer = trl.DPOTrainer(model=policy, ref_model=reference, args=args,
                                 train_dataset=dataset, processing_class=tokenizer)
        assert trainer.ref_model is reference and not reference.training
        assert trainer.accelerator.mixed_precision == "no"
        examples = _pair_ids(same.batch)
        inputs = trainer._prepare_inputs(trainer.data_collator(examples))
        trainer.model.train()  # as train() sets it: the metrics are logged as "train"
        trainer.model.zero_grad()
        with trainer.compute_loss_context_manager():  # as its training_step calls it
            loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in trainer.model.named_parameters()}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert not any(p.grad is not None for p in reference.parameters())  # frozen, no_grad
    return types.SimpleNamespace(loss=loss.item(), metrics=metrics, grads=grads,
                                 trainer=trainer, examples=examples)


def test_trl_tokenizes_the_pairs_as_effijax_but_for_the_newline_after_the_turn(theirs):
    # TRL's own tokenization of the same conversations (its train_dataset), pair by pair.
    tokenized = {tuple(ex["prompt_ids"]): ex for ex in theirs.trainer.train_dataset}
    for ours in theirs.examples:
        trl_ex = tokenized[tuple(ours["prompt_ids"])]  # the same prompt ids
        for side in ("chosen_ids", "rejected_ids"):
            assert ours[side][-1] == PAD  # the completion ends with <|im_end|> ...
            assert trl_ex[side] == ours[side] + [NEWLINE]  # ... TRL's with the "\n" after it


def test_full_dpo_loss_and_gradients_equal_trls_dpo_trainer(theirs, ours):
    loss, _, grads = ours
    # Measured: the same f32 loss to the bit; the bound is 4 roundings of it.
    assert abs(loss - theirs.loss) <= 4 * EPS * abs(theirs.loss), (loss, theirs.loss)
    assert abs(loss - np.log(2)) > 1e-3  # the policy is not its reference
    assert set(grads) == set(theirs.grads) and len(grads) == 3 + 2 * 9  # every parameter
    # Each parameter's gradient within f32 rounding of its largest entry (entries near 0 are
    # sums that cancel, and the two frameworks add in other orders). Measured: at most 5.4
    # roundings (6.4e-7, layer 1's input norm); the bound is 16.
    worst = {}
    for name, want in theirs.grads.items():
        scale = np.abs(want).max()
        assert scale > 0, name
        worst[name] = np.abs(grads[name] - want).max() / scale
    assert max(worst.values()) <= 16 * EPS, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


def test_the_steps_metrics_are_trls_by_name_and_value(theirs, ours):
    _, metrics, _ = ours
    assert set(PAIR_METRICS) <= set(metrics) and set(PAIR_METRICS) <= set(theirs.metrics)
    # A reward is beta times a difference of two log-probabilities of order 10 to 30: its
    # rounding is beta times theirs, not its own. Measured: the log-probabilities equal to the
    # bit, the rewards at most 0.4 roundings of a log-probability (times beta) apart.
    unit = EPS * max(abs(theirs.metrics["logps/chosen"]), abs(theirs.metrics["logps/rejected"]))
    for name in PAIR_METRICS:
        want = theirs.metrics[name]
        bound = 4 * unit * (BETA if name.startswith("rewards/") else 1.0)
        assert abs(metrics[name] - want) <= bound, (name, metrics[name], want)
    assert metrics["rewards/accuracies"] == theirs.metrics["rewards/accuracies"]  # k / 4 pairs
    assert abs(metrics["rewards/margins"]) > 100 * unit * BETA  # not a tie at the reference
