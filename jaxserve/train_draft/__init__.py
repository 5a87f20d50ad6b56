"""`jaxserve train-draft`: train an EAGLE3 draft head for a target model, in JAX.

    data.py        the dataset (ShareGPT, chat JSONL, text, token ids) -> token sequences,
                   the held-out split, the draft vocabulary, padded batches
    target.py      the target's forward over a padded batch: its aux layers' residual
                   streams and its next-token logits over the draft vocabulary
    head.py        the head, a flax.nnx module: its Params, its training-time-test forward,
                   the HF export
    train.py       the loss, the nnx.Optimizer over optax, the jitted step, held-out metrics
    checkpoint.py  orbax checkpoints of the (head, optimizer) nnx state (resume)
    evaluate.py    acceptance measured by the engine's own spec-decode metrics
    regenerate.py  --regenerate: the target's own greedy replies as the training text
    main.py        the command: argument parsing and the training loop
"""
