"""One spelling, one default: a flag that several ``effijax`` commands take has the same choices
and the same default in each (``effijax memory --optimizer`` is ``effijax train --optimizer``).

``train``'s flags default to ``argparse.SUPPRESS`` (a flag that was not given leaves the
config's value alone), so its defaults are read from :class:`~effijax.recipe.TrainConfig`.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from effijax.cli import build_parser
from effijax.recipe import TrainConfig

# Flags that differ between commands on purpose, each with its reason. Nothing else may.
ALLOWED = {
    # Three different things that one word names: train's global batch (sequences per step),
    # memory's micro-batch per device (one of its optional model-shape flags, no default), and
    # eval's windows per forward pass.
    "--batch-size": "train: sequences per step; memory: per device, optional; eval: per pass",
    # Required where the command has nothing to work on without it (eval and generate score or
    # continue a given model); optional where a default model or a count stands in.
    "--from": "required by eval and generate, optional in train, memory, plan, data prepare",
    # train trains the mini preset by default; memory and plan need one of --params, --model or
    # --from (a required group), so none is the default there.
    "--model": "train's default preset vs. memory/plan's required choice of a model",
    # train measures the device it runs on by default; plan has no device to measure.
    "--device-memory": "train: the device's own by default; plan: required",
    # memory counts one setting (1 device unless told); plan must be told the devices it
    # factorises into meshes.
    "--devices": "memory: default 1; plan: required",
    # memory counts the one tensor degree given (1: none); plan searches every degree unless
    # one is pinned.
    "--tensor": "memory: default 1; plan: searched unless pinned",
    # memory counts full fine-tuning unless a LoRA fraction is given; plan proposes LoRA at
    # this fraction only when full fine-tuning does not fit.
    "--lora-fraction": "memory: none (full fine-tuning); plan: the fraction LoRA would use",
    # One default everywhere (auto: the precision's compute dtype), but train offers the formats
    # it trains on, memory counts any storage width by name (fp8, int4, ... for what-ifs), and
    # plan tries only the quantized bases it may propose.
    "--frozen-dtype": "memory counts more formats by name; plan tries only its bases",
    # train writes a run directory (runs/train by default); data prepare must be told where the
    # store goes.
    "--out": "train: runs/train by default; data prepare: required",
}


def _default(command: str, action: argparse.Action):
    """The value a flag takes when not given (train's from its config field)."""
    if action.default is argparse.SUPPRESS and command == "train":
        fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
        return fields[action.dest].default
    return action.default


def _flags(commands: dict[str, argparse.ArgumentParser]) -> dict[str, list[tuple]]:
    """Each long flag -> (command, required, default, choices) for every command (and
    sub-command, ``data prepare``) that takes it."""
    out: dict[str, list[tuple]] = {}

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    walk(f"{name} {sub}", p)
                continue
            choices = None if action.choices is None else tuple(action.choices)
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    out.setdefault(flag, []).append(
                        (name, action.required, _default(name, action), choices))

    for name, parser in commands.items():
        walk(name, parser)
    return out


def disagreements(commands: dict[str, argparse.ArgumentParser],
                  allowed=ALLOWED) -> dict[str, list[tuple]]:
    """The shared flags whose required-ness, default or choices differ between commands."""
    return {flag: uses for flag, uses in _flags(commands).items()
            if len(uses) > 1 and flag not in allowed
            and len({(required, repr(default), choices)
                     for _, required, default, choices in uses}) > 1}


def test_shared_flags_have_one_spelling_and_one_default():
    found = disagreements(build_parser().commands())
    assert not found, "flags that differ between commands:\n" + "\n".join(
        f"  {flag}: " + "; ".join(f"{c} required={r} default={d!r} choices={ch}"
                                  for c, r, d, ch in uses)
        for flag, uses in found.items())


def test_allowed_differences_are_still_shared_and_still_differ():
    """An entry of ALLOWED that no longer differs (or no longer is shared) goes."""
    flags = _flags(build_parser().commands())
    stale = [flag for flag in ALLOWED if len(flags.get(flag, ())) < 2
             or not disagreements(build_parser().commands(), allowed={})
             .get(flag)]
    assert not stale, f"ALLOWED entries that no longer differ: {stale}"


def test_the_check_finds_a_disagreement():
    """Two made-up commands that spell --optimizer's choices and --precision's default
    differently are caught; agreeing ones are not."""
    def command(optimizers, precision):
        p = argparse.ArgumentParser()
        p.add_argument("--optimizer", default="adamw", choices=optimizers)
        p.add_argument("--precision", default=precision)
        return p

    same = {"a": command(("adamw", "adam"), "auto"), "b": command(("adamw", "adam"), "auto")}
    assert disagreements(same) == {}
    differ = {"a": command(("adamw", "adam"), "auto"),
              "b": command(("adam", "sgd_momentum"), "bf16")}
    assert set(disagreements(differ)) == {"--optimizer", "--precision"}


@pytest.mark.parametrize("command", ["memory", "plan"])
def test_memory_and_plan_take_trains_frozen_dtype_default(command):
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    uses = {c: d for c, _, d, _ in _flags(build_parser().commands())["--frozen-dtype"]}
    assert uses[command] == fields["frozen_dtype"].default == "auto"


@pytest.mark.parametrize("command", ["memory", "plan"])
def test_memory_and_plan_take_trains_optimizers_and_default(command):
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    uses = {c: (d, ch) for c, _, d, ch in _flags(build_parser().commands())["--optimizer"]}
    assert uses[command] == (fields["optimizer"].default, fields["optimizer"].metadata["choices"])
