"""NumPy-only models of the paper's systems claims: compute utilization and memory.

Nothing here imports JAX. One concept per module:

- `workloads`: `Workload`, what one step of one replica costs (`paper_workload`,
  `step_time_from_flops`);
- `methods`: `Method`, when the outer gradients cross the link and how big they are
  (`data_parallel_method`, `diloco_method`, `streaming_method`, `eager_method`,
  `table4_methods`; named so as not to clash with `sdiloco.data_parallel` and
  `sdiloco.diloco`, which build what is trained);
- `utilization`: simulates the timeline of a training step against a network of given
  bandwidth (the paper's Table 4 and Figs. 3/4/7/9/14-16). It re-exports the public
  names of `workloads` and `methods`, so `import sdiloco.sim.utilization as ut` is the
  whole simulator;
- `memory`: counts the bytes each method keeps per replica (the paper's §2.5);
- `chaos`: seeded failure and straggler traces per step, and their wall-clock cost;
- `virtual_clock` and `goodput`: learners on a virtual clock, failing, straggling and
  healing on one shared trace, and the methods as policies on it (Data-Parallel,
  elastic Data-Parallel, DiLoCo, Streaming DiLoCo, Decoupled DiLoCo): goodput and
  where the rest of the time went;
- `checks`: the argument checks they share.
"""
