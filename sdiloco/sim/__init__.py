"""NumPy-only models of the paper's systems claims: compute utilization and memory.

Nothing here imports JAX. `sim.utilization` simulates the timeline of a training step
against a network of given bandwidth (the paper's Table 4 and Figs. 3/4/7/9/14-16);
`sim.memory` counts the bytes each method keeps per replica (the paper's §2.5).
"""
