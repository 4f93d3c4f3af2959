"""The training harness: model, data, configs, checkpoints, the training loop and CLI.

Needs the `lab` extra (grain, orbax-checkpoint, tqdm) on top of the algorithm core.
"""
