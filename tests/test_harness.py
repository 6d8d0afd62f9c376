"""lm-evaluation-harness over effijax (effijax.harness): the answers of the three request kinds,
the shipped offline tasks, and ``effijax eval --tasks``.

A tiny Llama with a byte-level BPE tokenizer and a chat template, written as a GGUF file and
opened as any model is (``EffijaxLM(path)``): log-likelihoods equal the log-softmax of the
model's full forward logits summed over the continuation (is_greedy: every continuation token
is the argmax), rolling log-likelihoods equal the same sums over the harness's own windows,
generation equals effijax's greedy generation cut at the stop string (and stops early), and no
answer depends on the batch size or the requests' order. The shipped tasks run through
``lm_eval.simple_evaluate`` and their accuracy equals one computed here from the logits.
"""

import functools
import json
import sys

import jax
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="the harness tests need lm-evaluation-harness "
                              "(pip install 'effijax[eval]')")
pytest.importorskip("gguf", reason="the tiny model is written as a GGUF file")

from lm_eval.api.instance import Instance  # noqa: E402

from effijax.errors import ConfigError  # noqa: E402
from effijax.harness import (  # noqa: E402
    SHIPPED_TASKS,
    TASKS_DIR,
    EffijaxLM,
    check_tasks,
    choice_records,
    task_manager,
)

# Sums of f32 log-probabilities from the fused head, in chunks, against a plain log_softmax over
# the full logits, and between batch shapes: they differ in the order of reductions only.
# Measured: equal to the last bit for the loglikelihood requests here, 1.9e-6 between batch
# sizes 1 and 4 (a sum of 123 nats), 1.2e-4 (one f32 ulp) on a text's 1,323 nats over three
# windows; a wrong position or token moves a sum by ~0.1 or more.
ATOL, RTOL = 2e-5, 1e-6
MAX_LENGTH = 112  # the longest row: a prompt of 64 tokens and 48 generated share one shape
CONTEXT = "Question: What is the signature of textwrap.dedent?\nAnswer:"


def _close(value, expected):
    return abs(value - expected) <= ATOL + RTOL * abs(expected)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from _harness_models import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("harness") / "tiny.gguf", MAX_LENGTH)


@pytest.fixture(scope="module")
def lm(tiny_gguf):
    lm = EffijaxLM(str(tiny_gguf), batch_size=4, max_length=MAX_LENGTH, max_gen_toks=24)
    # The shapes the tests share, compiled once here: the scorer's lengths (16, 32, 64 and 112
    # tokens), generation's batch and the reference's forward pass.
    lm.loglikelihood(_requests("loglikelihood", [("a", "b"), (CONTEXT[:24], " x"),
                                                 (CONTEXT, " x"), (CONTEXT * 2, " x")]))
    lm.generate_until(_requests("generate_until", [(CONTEXT, {"until": ["\n"]})]))
    _reference(lm, [1, 2, 3], 1)
    return lm


@pytest.fixture
def no_environment_report(monkeypatch):
    """lm_eval records the environment in its results by running torch's collect_env (pip, in
    11 subprocesses: 4 s); nothing here reads it."""
    import lm_eval.evaluator

    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)


def _records(name):
    return [json.loads(line) for line in (TASKS_DIR / name).read_text().splitlines()]


def _requests(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def _reference(lm, ids, scored):
    """(log-probability, greedy) of the last ``scored`` of ``ids`` from the full forward pass's
    logits: log_softmax at each target, summed; every target the argmax. A text longer than
    the model reads loses its first tokens, as the harness's ``hf`` model cuts it."""
    ids = list(ids)[-(MAX_LENGTH + 1):]
    inputs = np.zeros((1, MAX_LENGTH), np.int32)  # one shape, one compile: causal, so the
    inputs[0, :len(ids) - 1] = ids[:-1]  # padding after the text changes nothing before it
    logp = np.asarray(_log_softmax(lm)(lm.params, inputs))[0]
    targets = np.asarray(ids[1:])
    rows = np.arange(len(targets))[len(targets) - scored:]
    return (float(logp[rows, targets[rows]].sum()),
            bool((logp[rows].argmax(-1) == targets[rows]).all()))


@functools.cache
def _log_softmax(lm):
    logits_fn = lm.loaded.model.logits_fn(lm.loaded.lora)
    return jax.jit(lambda p, x: jax.nn.log_softmax(logits_fn(p, x).astype(np.float32)))


def _split(lm, context, continuation):
    """The harness's tokens of a (context, continuation) pair (the whole encoded, the
    context's tokens split off, its trailing spaces moved to the continuation; an empty context
    is the prefix token: BOS)."""
    if not context:
        return [lm.prefix_token_id], lm.tok_encode(continuation, add_special_tokens=False)
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, head = lm.tok_encode(context + continuation), lm.tok_encode(context)
    return head, whole[len(head):]


def _greedy_ids(lm, prompts, n, eos_id=None):
    """effijax's greedy generation of each prompt's ``n`` tokens (up to ``eos_id``), as a
    batch filled to ``lm.batch_size`` rows: the shapes ``lm`` compiled (each row is what its
    prompt alone gives)."""
    from effijax.generate import generate

    rows = list(prompts) + [prompts[-1]] * (lm.batch_size - len(prompts))
    out = generate(lm.loaded.model, lm.params, rows, max_new_tokens=n, eos_id=eos_id)
    return [row.tolist() for row in out.outputs[:len(prompts)]]


def test_loglikelihood_is_the_log_softmax_of_the_logits_and_says_when_it_is_greedy(lm):
    pairs = [(CONTEXT, " textwrap.dedent(text)"), ("the thin", "g"), ("", "the thing"),
             ("In one line, what does json.dumps do? ", "Serialize obj.")]
    # As the hf model: an empty context is BOS (<|im_start|>), generation ends at EOS.
    assert (lm.prefix_token_id, lm.eot_token_id) == (lm.tokenizer.bos_id, lm.tokenizer.eos_id)
    out = lm.loglikelihood(_requests("loglikelihood", pairs))
    for (context, continuation), (logp, greedy) in zip(pairs, out, strict=True):
        head, tail = _split(lm, context, continuation)
        ref = _reference(lm, head + tail, len(tail))
        assert _close(logp, ref[0]) and greedy == ref[1], (context, logp, ref)
        assert logp < -1.0  # random weights: no continuation is likely
    # A continuation that is the model's own greedy rollout is greedy; change one token and
    # it is not.
    head = lm.tok_encode(CONTEXT)
    rollout = _greedy_ids(lm, [head], 5)[0]
    changed = rollout[:-1] + [(rollout[-1] + 7) % lm.loaded.model.vocab_size]
    answers = lm._loglikelihood_tokens([(None, head, rollout), (None, head, changed)])
    assert [g for _, g in answers] == [True, False]
    for (logp, _), tail in zip(answers, (rollout, changed), strict=True):
        assert _close(logp, _reference(lm, head + tail, len(tail))[0])


def test_rolling_loglikelihood_is_the_text_scored_in_the_harness_windows(lm):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    short, long = "the thin thing", "Text wrapping and filling. " * 9  # 1 and 3 windows
    out = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(short,), (long,)]))
    ids = lm.tok_encode(short)
    assert len(ids) + 1 <= MAX_LENGTH
    whole = _reference(lm, [lm.prefix_token_id, *ids], len(ids))[0]  # the whole text, one pass
    assert _close(out[0], whole)
    ids = lm.tok_encode(long)
    windows = list(map(make_disjoint_window, get_rolling_token_windows(
        ids, lm.prefix_token_id, MAX_LENGTH, 1)))
    assert len(windows) == 3 and sum(len(c) for _, c in windows) == len(ids)
    expected = sum(_reference(lm, (ctx + cont)[-(MAX_LENGTH + 1):], len(cont))[0]
                   for ctx, cont in windows)
    assert _close(out[1], expected)


def test_generation_is_greedy_generate_cut_at_the_stop_string_and_stops_early(lm, monkeypatch):
    import effijax.generate

    prompts = [CONTEXT, "the thin", "In one line, what does json.dumps do?\nAnswer:"]
    rollouts = _greedy_ids(lm, [lm.tok_encode(p) for p in prompts], 24)
    full = [lm.tok_decode(ids) for ids in rollouts]
    stop = full[0][6:8]  # two characters the first reply holds
    assert stop and stop in full[0]
    steps = []
    real = effijax.generate.generate

    def counted(*args, on_tokens, **kwargs):
        def step(tokens_B):
            steps.append(1)
            on_tokens(tokens_B)
        return real(*args, on_tokens=step, **kwargs)

    monkeypatch.setattr(effijax.generate, "generate", counted)
    settings = {"until": [stop], "max_gen_toks": 24, "do_sample": False}
    out = lm.generate_until(_requests("generate_until", [(p, settings) for p in prompts]))
    assert out == [text.split(stop)[0] for text in full]
    # Alone, the first prompt stops at the step whose token completes the stop string.
    steps.clear()
    assert lm.generate_until(_requests("generate_until", [(prompts[0], settings)])) == out[:1]
    first = next(k for k in range(1, 25) if stop in lm.tok_decode(rollouts[0][:k]))
    assert len(steps) == first < 24


def test_answers_do_not_depend_on_the_batch_size_or_the_order(lm, tiny_gguf):
    pairs = [("the thin", "g"), ("a", " b c d e f g h"), ("x", "y"), ("the", " thin thing"),
             ("json.dumps", "(obj)")]  # short: one compiled length
    one = EffijaxLM(str(tiny_gguf), batch_size=1, max_length=MAX_LENGTH)
    order = [3, 0, 4, 2, 1]
    batched = lm.loglikelihood(_requests("loglikelihood", pairs))
    single = one.loglikelihood(_requests("loglikelihood", [pairs[i] for i in order]))
    for i, (logp, greedy) in zip(order, single, strict=True):
        assert _close(logp, batched[i][0]) and greedy == batched[i][1]
    # Generation's rows are what each prompt gives alone (tests/test_generate.py), and its
    # answers come back in the requests' order (the generation test above).


def test_shipped_tasks_run_offline_and_their_accuracy_is_the_logits(lm, no_environment_report):
    out = lm_eval.simple_evaluate(model=lm, tasks=list(SHIPPED_TASKS), limit=4,
                                  task_manager=task_manager(include_defaults=False),
                                  log_samples=False, bootstrap_iters=0, torch_random_seed=None)
    results = out["results"]
    # Multiple choice: the choice whose " choice" after the question is likeliest, computed
    # from the logits here.
    docs = _records("qa_choice.jsonl")[:4]
    hits, normed = [], []
    for doc in docs:
        context = f"Question: {doc['prompt']}\nAnswer:"
        scores = [_reference(lm, sum(_split(lm, context, " " + c), []),
                             len(_split(lm, context, " " + c)[1]))[0] for c in doc["choices"]]
        hits.append(int(np.argmax(scores)) == doc["gold"])
        normed.append(int(np.argmax([s / len(c) for s, c in  # per character of the choice
                                     zip(scores, doc["choices"], strict=True)])) == doc["gold"])
    assert results["effijax_qa_choice"]["acc,none"] == pytest.approx(np.mean(hits))
    assert results["effijax_qa_choice"]["acc_norm,none"] == pytest.approx(np.mean(normed))
    # Exact match: greedy replies to the first four questions, first line, spaces stripped.
    qa = _records("qa.jsonl")[:4]
    replies = _greedy_ids(lm, [lm.tok_encode(f"Question: {doc['prompt']}\nAnswer:",
                                             left_truncate_len=MAX_LENGTH - 48) for doc in qa],
                          48, eos_id=lm.tokenizer.eos_id)
    matches = [lm.tok_decode(new).split("\n")[0].lstrip() == doc["response"]
               for new, doc in zip(replies, qa, strict=True)]
    assert results["effijax_qa_exact"]["exact_match,strip"] == pytest.approx(np.mean(matches))
    perplexity = results["effijax_docs_perplexity"]
    assert perplexity["byte_perplexity,none"] == pytest.approx(
        2 ** perplexity["bits_per_byte,none"], rel=1e-9)
    assert 1.0 < perplexity["byte_perplexity,none"] < 1e4


def test_the_shipped_choices_are_the_shipped_questions_with_turning_answers():
    qa, shipped = _records("qa.jsonl"), _records("qa_choice.jsonl")
    assert shipped == choice_records(qa)
    assert np.bincount([r["gold"] for r in shipped]).tolist() == [85, 85, 84, 84]
    for record, question in zip(shipped, qa, strict=True):
        assert record["choices"][record["gold"]] == question["response"]
        assert len(set(record["choices"])) == 4


def test_registered_as_effijax_and_built_from_model_args(tiny_gguf, no_environment_report):
    from lm_eval.api.registry import get_model

    assert get_model("effijax") is EffijaxLM
    out = lm_eval.simple_evaluate(model="effijax", model_args=f"from={tiny_gguf},max_length="
                                  f"{MAX_LENGTH}", batch_size=4, tasks=["effijax_qa_choice"],
                                  limit=2, task_manager=task_manager(include_defaults=False),
                                  log_samples=False, torch_random_seed=None)
    assert 0 <= out["results"]["effijax_qa_choice"]["acc,none"] <= 1
    built = EffijaxLM.create_from_arg_string(f"from={tiny_gguf},max_length=64",
                                             {"batch_size": 2, "device": None})
    assert built.batch_size == 2 and built.max_length == 64
    chat = built.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ConfigError, match="batch_size='auto'"):
        EffijaxLM(str(tiny_gguf), batch_size="auto")
    with pytest.raises(ConfigError, match="model_args='trust_remote_code': not settings of the "
                       "effijax model; it takes from .or model_from., loaded, batch_size"):
        EffijaxLM.create_from_arg_string(f"from={tiny_gguf},trust_remote_code=True")
    with pytest.raises(ConfigError, match="precision='fp64'"):
        EffijaxLM("no/such/model", precision="fp64")  # before the model is looked for


def test_cli_runs_tasks_and_prints_the_harness_table(tiny_gguf, capsys, monkeypatch):
    import lm_eval.evaluator

    from effijax.cli import main

    report = lm_eval.evaluator.add_env_info

    code = main(["eval", "--from", str(tiny_gguf), "--tasks", "effijax_qa_choice",
                 "--limit", "2", "--batch-size", "4", "--seq-len", str(MAX_LENGTH)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.splitlines()[0] == f"effijax eval: {tiny_gguf} in fp32, batch 4, limit 2"
    assert "|effijax_qa_choice|" in out.replace(" ", "") and "acc_norm" in out
    # --chat: each prompt rendered with the model's chat template.
    rendered, real = [], EffijaxLM.apply_chat_template

    def spied(self, history, add_generation_prompt=True):
        rendered.append(real(self, history, add_generation_prompt))
        return rendered[-1]

    monkeypatch.setattr(EffijaxLM, "apply_chat_template", spied)
    assert main(["eval", "--from", str(tiny_gguf), "--tasks", "effijax_qa_choice", "--limit",
                 "2", "--batch-size", "4", "--seq-len", str(MAX_LENGTH), "--chat", "--json"]) == 0
    chat = json.loads(capsys.readouterr().out)
    assert chat["results"]["effijax_qa_choice"]["acc,none"] in (0, 0.5, 1)
    # The machine recorded from JAX, not by the harness's report (torch's collect_env: torch
    # and transformers imported, pip run in subprocesses), which is back in place after.
    assert chat["pretty_env_info"].startswith("effijax "), chat["pretty_env_info"]
    assert f"jax {jax.__version__}" in chat["pretty_env_info"]
    assert chat["transformers_version"] == "N/A (the model is effijax's)"
    assert lm_eval.evaluator.add_env_info is report
    first = _records("qa_choice.jsonl")[0]["prompt"]
    assert rendered[0] == (f"<|im_start|>user\nQuestion: {first}\nAnswer:<|im_end|>\n"
                           "<|im_start|>assistant\n"), rendered[:1]


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "effijax_qa_exact", "data.txt"], "--tasks runs the tasks' own data"),
    (["--limit", "3"], "--limit=3: counts harness documents: give --tasks too"),
    (["--chat", "data.txt"], "--chat=True: renders harness prompts: give --tasks too"),
    ([], "give a file to evaluate on, or --tasks A,B"),
])
def test_cli_refuses_bad_flags_before_loading(tiny_gguf, capsys, argv, message):
    from effijax.cli import main

    assert main(["eval", "--from", str(tiny_gguf), *argv]) == 2
    assert message in capsys.readouterr().err


def test_unknown_tasks_and_a_missing_harness_say_what_to_do(tiny_gguf, capsys, monkeypatch):
    manager = task_manager(include_defaults=False)
    with pytest.raises(ConfigError, match="tasks='nope': no such task; offline ones shipped "
                       "with effijax: effijax_qa_exact, effijax_qa_choice, "
                       "effijax_docs_perplexity"):
        check_tasks("effijax_qa_exact,nope", manager)
    assert check_tasks("effijax_offline", manager) == ["effijax_offline"]
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    from effijax.cli import main

    assert main(["eval", "--from", str(tiny_gguf), "--tasks", "effijax_qa_exact"]) == 2
    assert "pip install 'lm_eval>=0.4.8,<0.5'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="needs lm-evaluation-harness"):
        EffijaxLM(str(tiny_gguf))


@pytest.mark.parametrize("dtype", ["float32", "float16"])  # fused head; f16: the unfused one
def test_the_heads_greedy_flag_is_every_marked_target_the_argmax(dtype):
    import jax.numpy as jnp

    from effijax.models import head_sequence_logps
    from effijax.models._head import head_logits

    x = jax.random.normal(jax.random.key(0), (3, 5, 8)).astype(dtype)
    kernel = jax.random.normal(jax.random.key(1), (11, 8)).astype(dtype)
    top = np.asarray(head_logits(x, kernel, transposed=True)).argmax(-1)
    targets = top.copy()
    targets[1, 3] = (top[1, 3] + 1) % 11  # row 1 misses at a marked position,
    targets[2, 0] = (top[2, 0] + 1) % 11  # row 2 at an unmarked one
    where = jnp.asarray(np.broadcast_to(np.arange(5) >= 1, (3, 5)))

    @jax.jit
    def both(x, kernel, targets, where):  # one compile
        return (head_sequence_logps(x, kernel, targets, where, transposed=True, greedy=True),
                head_sequence_logps(x, kernel, targets, where, transposed=True))

    (logps, counts, greedy), (plain, plain_counts) = both(x, kernel, jnp.asarray(targets), where)
    assert greedy.tolist() == [True, False, True] and counts.tolist() == [4, 4, 4]
    assert np.array_equal(logps, plain) and np.array_equal(counts, plain_counts)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_gguf):
    """A LoRA run of the tiny GGUF (two steps, the first a warm-up at lr 0: its adapters move
    the scores)."""
    from effijax.recipe import TrainConfig, train

    root = tmp_path_factory.mktemp("run")
    data = root / "corpus.txt"
    data.write_text("".join(f"the thin {i} in the {i}\n" for i in range(200)))
    train(TrainConfig(model_from=str(tiny_gguf), seq_len=16, batch_size=2, eval_batches=0,
                      progress=False, steps=2, warmup=1, data=str(data), lr=3e-2, lora_rank=2,
                      out=str(root / "lora")))
    return root / "lora"


def test_a_lora_run_is_scored_with_its_adapters_and_keeps_its_results(lora_run, lm, capsys,
                                                                      no_environment_report):
    from effijax.cli import main

    adapted = EffijaxLM(str(lora_run), batch_size=4, max_length=MAX_LENGTH)
    assert adapted.loaded.lora is not None
    pair = [(CONTEXT, " textwrap.dedent(text)")]
    logp, _ = adapted.loglikelihood(_requests("loglikelihood", pair))[0]
    head, tail = _split(adapted, *pair[0])
    assert _close(logp, _reference(adapted, head + tail, len(tail))[0])
    assert abs(logp - lm.loglikelihood(_requests("loglikelihood", pair))[0][0]) > 1e-3
    capsys.readouterr()
    assert main(["eval", "--from", str(lora_run), "--tasks", "effijax_qa_choice", "--limit", "2",
                 "--batch-size", "4", "--seq-len", str(MAX_LENGTH), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    kept = json.loads((lora_run / "eval_tasks.json").read_text())
    assert kept["results"] == printed["results"]
    assert 0 <= kept["results"]["effijax_qa_choice"]["acc,none"] <= 1
