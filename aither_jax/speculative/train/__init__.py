"""Trains a DFlash draft for a target model: `python -m aither_jax.train_draft`.

Three resumable stages, each skipped when its output exists:

1. Prompts: chat requests built from the docstrings of Python's standard library, read with
   `ast` from the interpreter's own source files (no import, nothing downloaded); modules
   whose name hashes into the held-out tenth are never used (`--split eval` lists those).
   Then general chat requests (`prompts.chat_prompts`: explanations, how-tos, tips, stories,
   emails, small programs) from hand-written topic lists (`requests.json`) kept apart from
   `scripts/data/chat_eval.jsonl`. Then, with `--num-self-prompts`, requests the target writes
   itself: sampled from the chat template cut just after the user turn opens, so the
   instruction-tuned model plays the user (unlimited, varied, in its own chat distribution);
   near-copies of the evaluation prompts are dropped.
2. Data: the frozen target's own greedy continuations of those prompts, then, in one pass over
   prompt + continuation, the hidden states of the draft's tapped target layers and the
   target's `--teacher-top-k` most likely next tokens with their log probabilities, stored as
   .npz shards. With `--num-text-sequences`, also conversations whose answers are existing
   text (`document_conversations`: standard-library docstrings and source, no generation):
   the same one pass gives their hidden states, and the labels are the target's own greedy
   next token at every position (teacher-forced on the text), at ~5x the tokens per hour.
3. Training: random anchors in the continuations; the block is [anchor token, masks...]; the
   loss at every masked position mixes cross-entropy with the target's greedy token and with
   its stored distribution (`--soft-weight`), with weights decaying along the block; some
   blocks reveal a random subset of positions so multi-step denoising sees partly filled
   blocks. AdamW (optax) with warm-up and cosine decay; orbax checkpoints every
   `--save-every` steps and at the end; a run restarts from its latest checkpoint. With
   `--time-limit S` no training step starts more than S seconds after the run began (the data
   stage counts, and is never cut): the last step is validated, checkpointed and exported.

`--export F.npz` writes the shipped draft (float16 parameters + config) for `models/draft_io`.
"""
