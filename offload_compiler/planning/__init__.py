"""Planning for strategy ``auto``: what to keep resident and how far ahead to fetch, for a device budget.

- `planner`: pure functions from a cost table to the fastest plan that fits (`solve`, `predict`,
  `InfeasibleBudgetError`); its prediction replays the engine's own `passes.schedule`.
- `costmodel`: the cost table of a captured graph (compute per node, transfer rates, activation peak).
- `plots`: optional PNGs of a plan (needs matplotlib).

Nothing is imported here: ``import offload_compiler.planning`` stays light; import the module you need.
(`auto` captures the model and builds the runtime that carries out a plan: it may import the backend.)
"""
