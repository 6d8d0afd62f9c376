"""What watches a run from the recipe: the sinks and the profiler its config asks for, opened on
the main process only (:mod:`effijax.observe`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from tqdm.auto import tqdm

from effijax import distributed
from effijax.observe import Profiler, Sinks, TensorBoardSink, WandbSink, memory_markdown
from effijax.recipe._sections import OutputSection

__all__ = ["Watch", "watching"]


class Watch(NamedTuple):
    """The run's sinks (possibly none) and profiler (possibly None)."""

    sinks: object
    profiler: object | None

    def step(self, step_fn: Callable) -> Callable:
        """The step function, traced over the profiled steps."""
        return step_fn if self.profiler is None else self.profiler.wrap(step_fn)

    @property
    def callbacks(self) -> tuple:
        """``train_loop``'s callbacks: each step's record to every sink."""
        return (self.sinks.log,) if self.sinks.active else ()

    def finish(self, summary: dict) -> None:
        """The end-of-run numbers (evaluation loss, throughput) at the final step."""
        values = {"eval/loss": summary.get("eval_loss"),
                  "train/final_loss": summary.get("final_loss"),
                  "perf/median_tokens_per_s": summary.get("tokens_per_s")}
        self.sinks.values(summary["steps"], {k: v for k, v in values.items() if v is not None})
        if "eval_loss_start" in summary:
            self.sinks.values(0, {"eval/loss": summary["eval_loss_start"]})  # the run's start


@contextlib.contextmanager
def watching(output: OutputSection, run_json: dict, memory: dict,
             start_step: int) -> Iterator[Watch]:
    """Opens what ``output`` asks for (``tensorboard``, ``wandb``, ``profile_steps``) on the main
    process, writes the config (``run_json``) and the memory report as text, and closes them all
    at the end (also when training fails)."""
    out = Path(output.out)
    is_main = distributed.is_main()
    sinks, profiler = [], None
    try:
        if is_main and output.tensorboard:
            sinks.append(TensorBoardSink(out / "tensorboard", start_step=start_step))
        if is_main and output.wandb:
            sinks.append(WandbSink(output.wandb, out, config=run_json, mode=output.wandb_mode))
        if is_main and output.profile_range is not None:
            first, last = output.profile_range
            # Said during the loop: tqdm.write keeps the progress bar whole below it.
            profiler = Profiler(out / "profile", first, last, start_step=start_step,
                                report=lambda text: tqdm.write(f"effijax train: {text}"))
        watch = Watch(Sinks(sinks), profiler)
        if start_step == 0:
            settings = json.dumps(run_json, indent=2, sort_keys=True, default=str)
            watch.sinks.text("config", f"```json\n{settings}\n```", 0)
            watch.sinks.text("memory", memory_markdown(memory), 0)
        yield watch
    finally:
        if profiler is not None:
            profiler.close()
        Sinks(sinks).close()
