"""A reward a tiny random model can learn in a few GRPO steps, given to ``--rewards`` by dotted
path (``_grpo_rewards:low_ids``): the fraction of a completion's tokens in the lower half of
the tiny vocabulary (about 0.5 for a random policy, 1 at best)."""

from _llama_files import VOCAB_SIZE


def low_ids(prompts, completions, completion_ids, **columns):
    return [sum(i < VOCAB_SIZE // 2 for i in ids) / max(len(ids), 1) for ids in completion_ids]
