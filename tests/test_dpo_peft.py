"""A LoRA DPO run's PEFT export, loaded by ``peft`` onto ``transformers``' model of the run's base,
gives effijax's logits of the base with the run's trained adapters (f32, within the 1e-4 the
family parity tests hold for logits of magnitude ~5).

The run is ``effijax train --objective dpo`` from a Hugging Face directory of the tiny Llama (a
base ``transformers`` reads), 3 steps at a high learning rate, so that its adapters move the
logits well past that tolerance.
"""

import dataclasses

import jax
import numpy as np
import pytest
from _llama_files import VOCAB_SIZE, chat_tokenizer
from _pairs import write_pairs
from _parity import our_logits, torch_logits

from effijax.cli import main as cli_main
from effijax.interop import load_hf, save_hf
from effijax.lora import load_adapters
from effijax.models import llama_config

pytestmark = pytest.mark.slow  # a DPO run, peft and transformers imported: about 10 s

SEQ = 32
TINY = dataclasses.replace(llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=SEQ),
                           tokenizer=chat_tokenizer())
ATOL = 1e-4  # as tests/test_hf_parity.py: f32 logits of magnitude ~5, observed ~1e-5


# peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`: their warning, not ours.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_a_lora_dpo_runs_peft_export_gives_its_logits_through_peft(tmp_path):
    pytest.importorskip("torch", reason="needs torch (pip install -e '.[interop]')")
    peft = pytest.importorskip("peft", reason="needs peft (pip install -e '.[interop]')")
    transformers = pytest.importorskip("transformers",
                                       reason="needs transformers (pip install -e '.[interop]')")
    save_hf(tmp_path / "hf", TINY, jax.jit(TINY.init_params)(jax.random.key(0)))
    write_pairs(tmp_path / "pairs.jsonl")
    out = tmp_path / "run"
    assert cli_main(["train", "--objective", "dpo", "--from", str(tmp_path / "hf"),
                     "--lora-rank", "2", "--data", str(tmp_path / "pairs.jsonl"), "--steps",
                     "3", "--batch-size", "4", "--seq-len", str(SEQ), "--eval-batches", "1",
                     "--lr", "5e-2", "--no-checkpoints", "--no-progress",
                     "--out", str(out)]) == 0
    adapters, spec = load_adapters(out / "adapters.safetensors")
    config, base = load_hf(tmp_path / "hf")
    tokens = np.random.default_rng(0).integers(0, VOCAB_SIZE, (2, 16))
    ours = our_logits(config, base, tokens, spec, adapters)
    assert np.abs(ours - our_logits(config, base, tokens)).max() > 100 * ATOL  # DPO moved them
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with_adapters = peft.PeftModel.from_pretrained(hf, out / "peft").eval()
    assert np.abs(torch_logits(with_adapters, tokens) - ours).max() <= ATOL
