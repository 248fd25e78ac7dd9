"""Built-in workload kinds, one module per model; imported on first use (see flare.bench.workload.BUILTIN)."""
