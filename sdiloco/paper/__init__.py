"""The paper harness: what the notebooks call to regenerate the paper's artifacts.

Needs the `paper` extra (matplotlib, jupytext, nbclient, ipykernel).
"""
