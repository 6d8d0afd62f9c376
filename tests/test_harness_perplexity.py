"""The harness's rolling log-likelihood against ``effijax eval``'s perplexity on one text.

Both score a text in disjoint windows of ``L`` targets, each row reading the one token before
its targets; they differ at the two ends by design (docs/evaluation.md, "Perplexity"):

* the harness predicts the text's first token from the prefix token (BOS, else EOS), where
  ``effijax eval`` reads its stream's first token without scoring it, and ``effijax eval``
  scores the end-of-text token it puts after each document, which the harness's text lacks;
* the harness reads its last, partial window after a full window of context, where ``effijax
  eval``'s last row holds the stream's tail after one token.

So a file that starts with the prefix token (``<|im_start|>``, written out as text: the tokenizer
reads special tokens) gives ``effijax eval`` the stream ``[BOS] + text + <|endoftext|>``, whose
rows are the harness's windows over ``text + "<|endoftext|>"`` whenever the token count is a
multiple of the window: then the perplexities are equal. One token more and they differ by
exactly the last window's context.
"""

import math

import pytest

pytest.importorskip("lm_eval", reason="the harness tests need lm-evaluation-harness "
                    "(pip install 'effijax[eval]')")
pytest.importorskip("gguf", reason="the tiny model is written as a GGUF file")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from effijax.harness import EffijaxLM  # noqa: E402
from effijax.recipe import evaluate_model  # noqa: E402

WINDOW = 32  # the harness's max_length and effijax eval's --seq-len
# The same f32 log-probabilities from two programs (the harness's fused scoring head, summed per
# row in float64; effijax eval's loss function, a masked mean per batch): they differ in the
# order of their reductions only. Measured: equal to the last bit here; 1e-5 is ~60 f32 ulps
# of the mean loss (5.9 nats), where two tokens scored after another context move the sum by
# more than 1e-2 (asserted below).
RTOL = 1e-5
BOS, END = "<|im_start|>", "<|endoftext|>"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from _harness_models import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("perplexity") / "tiny.gguf", 112)


@pytest.fixture(scope="module")
def lm(tiny_gguf):
    return EffijaxLM(str(tiny_gguf), batch_size=4, max_length=WINDOW)


def _rolling(lm, text):
    """The harness's rolling log-likelihood of ``text`` and its token count."""
    out = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    return out[0], len(lm.tok_encode(text))


def _eval(tiny_gguf, tmp_path, text):
    """``effijax eval --from tiny.gguf FILE --seq-len WINDOW`` of a file holding ``text``."""
    file = tmp_path / "text.txt"
    file.write_text(text)
    return evaluate_model(str(tiny_gguf), str(file), seq_len=WINDOW, batch_size=4,
                          precision="fp32")


def test_rolling_loglikelihood_is_effijax_evals_perplexity_in_the_same_windows(lm, tiny_gguf,
                                                                              tmp_path):
    assert lm.prefix_token_id == lm.tok_encode(BOS, add_special_tokens=False)[0]
    text = "Text wrapping and filling. The thin thing in the 12 rooms. " * 2
    while len(lm.tok_encode(text + END)) % WINDOW:  # '.' is one token: the windows fill up
        text += "."
    logp, tokens = _rolling(lm, text + END)
    result = _eval(tiny_gguf, tmp_path, BOS + text)
    assert (result.tokens, result.rows) == (tokens, tokens // WINDOW) == (128, 4)
    assert result.perplexity == pytest.approx(math.exp(-logp / tokens), rel=RTOL)

    # Two tokens more: the last window holds 2 targets; the harness reads them after a full
    # window, effijax eval after the one token before. Everything else is the same.
    longer = text + "ab"
    logp, tokens = _rolling(lm, longer + END)
    result = _eval(tiny_gguf, tmp_path, BOS + longer)
    assert (result.tokens, result.rows) == (tokens, 5)
    ids = lm.tok_encode(longer + END)
    context, tail = list(map(make_disjoint_window, get_rolling_token_windows(
        ids, lm.prefix_token_id, WINDOW, 1)))[-1]
    start = 4 * WINDOW
    assert tail == ids[start:] and len(tail) == 2 and len(context) == WINDOW - 1
    (harness_last, _), (eval_last, _) = lm._loglikelihood_tokens(
        [(None, context, tail), (None, ids[start - 1:start], tail)])
    assert abs(harness_last - eval_last) > 1e-2
    assert -result.loss * result.tokens == pytest.approx(logp - harness_last + eval_last,
                                                         rel=RTOL)
    assert result.perplexity != pytest.approx(math.exp(-logp / tokens), rel=1e-3)
