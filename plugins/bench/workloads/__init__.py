"""Built-in workload kinds, one module per model; imported on first use (see flare.plugins.bench.workload.BUILTIN)."""
