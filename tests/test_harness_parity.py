"""The harness's answers through effijax equal its answers through its own ``hf`` model.

One tiny random Llama (matrices scaled up: sharp softmaxes, so greedy continuations depend on
the context) with a byte-level BPE tokenizer and a chat template, written by effijax as a
Hugging Face directory (:func:`effijax.interop.save_hf`: ``config.json``, safetensors, the
tokenizer files). lm_eval's ``HFLM`` (``transformers``, f32) and :class:`EffijaxLM` both open
that directory, and the same requests go through both: log-likelihoods (an empty context, a
one-character one, a trailing space, a context longer than the window, the model's own greedy
continuation), rolling log-likelihoods of a text several windows long, and greedy generation
with stop strings (a prompt cut on the left, replies cut at the stop, replies cut at
``max_gen_toks``). Tokens, BOS handling and windows are the harness's in both: the answers must
agree to the f32 reductions' order.
"""

import dataclasses

import pytest
from _reference import reference

lm_eval = pytest.importorskip("lm_eval", reason="the harness parity tests need "
                              "lm-evaluation-harness (pip install 'effijax[eval]')")
# Imported when the module fixture first needs them (``import torch`` alone costs 4.5 s on 2
# cores: not at collection, where the fast tier would pay it too).
torch = reference("torch", reason="the harness's hf model needs torch (effijax[interop])")
transformers = reference("transformers", reason="the harness's hf model needs transformers "
                         "(pip install effijax[interop])")

from lm_eval.api.instance import Instance  # noqa: E402

# f32 sums of log-probabilities from two libraries' kernels (matmul and reduction orders
# differ). Measured here: at most 3.8e-5 absolute over the loglikelihood requests (sums up to
# 122 nats: a few f32 ulps), 1.5e-7 relative on the rolling texts (1,192 nats over 4 windows);
# a wrong token, position or window moves a sum by ~0.1 or more.
ATOL = 1e-4
RTOL_ROLLING = 1e-4
MAX_LENGTH = 64  # the window: rows of 16, 32 and 64 tokens (effijax's compiled lengths)
MAX_GEN_TOKS = 16
BATCH = 4
CONTEXT = "Question: What is the signature of textwrap.dedent?\nAnswer:"

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: torch on one thread


def _requests(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The tiny Llama with the chat tokenizer, as effijax writes a Hugging Face directory."""
    from _llama_files import VOCAB_SIZE, chat_tokenizer, sharp_params

    from effijax.interop import save_hf
    from effijax.models import llama_config

    model = dataclasses.replace(llama_config("llama-tiny", vocab_size=VOCAB_SIZE,
                                             seq_len=MAX_LENGTH), tokenizer=chat_tokenizer())
    directory = tmp_path_factory.mktemp("harness_parity") / "tiny"
    save_hf(directory, model, sharp_params(model))
    return directory


@pytest.fixture(scope="module")
def models(hf_dir):
    """``(hf, effijax)``: lm_eval's ``HFLM`` and :class:`EffijaxLM` on the same directory, the
    same batch size, window and generation length."""
    from lm_eval.models.huggingface import HFLM

    from effijax.harness import EffijaxLM

    hf = HFLM(pretrained=str(hf_dir), batch_size=BATCH, max_length=MAX_LENGTH, device="cpu",
              dtype="float32")
    ours = EffijaxLM(str(hf_dir), batch_size=BATCH, max_length=MAX_LENGTH,
                     max_gen_toks=MAX_GEN_TOKS)
    assert type(hf.model).__name__ == "LlamaForCausalLM" and hf.model.dtype == torch.float32
    return hf, ours


def _greedy_rollout(hf, ids, n):
    """``n`` tokens after ``ids`` by argmax of the ``transformers`` model's logits."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = hf.model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[-n:]


def test_loglikelihoods_and_greedy_flags_equal_the_hf_models(models):
    hf, ours = models
    # The same tokens and special ids (an empty context is read after BOS, <|im_start|>).
    assert (ours.prefix_token_id, ours.eot_token_id) == (hf.prefix_token_id, hf.eot_token_id)
    for text in [CONTEXT, "naïve 東京 the thin 12", "<|im_start|>user\nhi"]:
        assert ours.tok_encode(text) == hf.tok_encode(text), text
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert ours.apply_chat_template(history) == hf.apply_chat_template(history)

    pairs = [(CONTEXT, " textwrap.dedent(text)"), ("", "the thing"), ("a", " b"),
             ("the thin", "g"), ("In one line, what does json.dumps do? ", "Serialize obj."),
             (CONTEXT * 3, " x y")]  # the last: 165 tokens, cut on the left to the window
    assert len(hf.tok_encode(pairs[-1][0])) > MAX_LENGTH
    requests = _requests("loglikelihood", pairs)
    theirs, mine = hf.loglikelihood(requests), ours.loglikelihood(requests)
    for pair, (ref, ref_greedy), (logp, greedy) in zip(pairs, theirs, mine, strict=True):
        assert abs(logp - ref) <= ATOL and greedy == ref_greedy, (pair, logp, ref)
        assert logp < -1.0

    # Token-level requests (what both classes' loglikelihood reduces to): the model's own
    # greedy continuation is greedy in both, one token changed is not.
    head = hf.tok_encode(CONTEXT)
    rollout = _greedy_rollout(hf, head, 5)
    changed = rollout[:-1] + [(rollout[-1] + 7) % len(hf.tokenizer)]
    token_requests = [(None, head, rollout), (None, head, changed), (None, [1], rollout[:2])]
    theirs = hf._loglikelihood_tokens(token_requests)
    mine = ours._loglikelihood_tokens(token_requests)
    assert [g for _, g in theirs][:2] == [True, False]
    for (ref, ref_greedy), (logp, greedy) in zip(theirs, mine, strict=True):
        assert abs(logp - ref) <= ATOL and greedy == ref_greedy, (logp, ref)


def test_rolling_loglikelihoods_equal_the_hf_models(models):
    from lm_eval.utils import get_rolling_token_windows

    hf, ours = models
    texts = ["Text wrapping and filling. " * 8, "the thin thing"]
    windows = list(get_rolling_token_windows(hf.tok_encode(texts[0]), hf.prefix_token_id,
                                             MAX_LENGTH, 1))
    assert len(windows) >= 3  # several windows of the harness's own convention
    requests = _requests("loglikelihood_rolling", [(t,) for t in texts])
    theirs, mine = hf.loglikelihood_rolling(requests), ours.loglikelihood_rolling(requests)
    for text, ref, logp in zip(texts, theirs, mine, strict=True):
        assert abs(logp - ref) <= RTOL_ROLLING * abs(ref), (text, logp, ref)


def test_greedy_generations_equal_the_hf_models(models):
    hf, ours = models
    prompts = [CONTEXT, "the thin", "In one line, what does json.dumps do?\nAnswer:",
               CONTEXT * 2]  # the last: cut on the left to max_length - max_gen_toks
    assert len(hf.tok_encode(prompts[-1])) > MAX_LENGTH - MAX_GEN_TOKS
    unstopped = {"until": ["\n\n\n"], "max_gen_toks": MAX_GEN_TOKS, "do_sample": False}
    full = hf.generate_until(_requests("generate_until", [(p, unstopped) for p in prompts]))
    assert ours.generate_until(_requests("generate_until",
                                         [(p, unstopped) for p in prompts])) == full
    # Stop strings the replies hold (two characters of the first reply, the first two of the
    # third: that reply is empty), and fewer tokens for the last two requests: answers cut at
    # a stop and at max_gen_toks, in one list.
    stops = [full[0][3:5], full[2][:2]]
    assert all(len(s) == 2 and "\ufffd" not in s for s in stops)  # whole characters
    stopped = {"until": stops, "max_gen_toks": MAX_GEN_TOKS, "do_sample": False}
    short = {"until": ["\n\n\n"], "max_gen_toks": 6, "do_sample": False}
    args = [(p, stopped) for p in prompts] + [(p, short) for p in prompts[:2]]
    theirs = hf.generate_until(_requests("generate_until", args))
    mine = ours.generate_until(_requests("generate_until", args))
    assert mine == theirs
    assert theirs[0] != full[0] and theirs[2] == "" != full[2]  # the stops did cut
    assert len(theirs[-1]) < len(full[1])
