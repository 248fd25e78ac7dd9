"""flare.plugins.bench: compare two ways of serving a model, A->B->B->A.

`flare bench A.toml B.toml` (see `cli.py`) loads two configurations
(`config.py`), asks the model's workload kind (`workload.py`; each model
plugin contributes its own through the `flare_bench_workloads` hook) for the
requests and a runner per configuration (Flare prepared or rebuilt,
`flare_runner.py`; or a peer such as onnxruntime or NumPy, contributed through
`flare_bench_peers`, sharing `peer_runner.py`), runs them in warmed A B B A blocks (`order.py`,
`harness.py`) while watching peak memory (`memory.py`), checks that outputs
agree (`compare.py`) and reports a table, JSON (`report.py`) and a plot
(`plot.py`).

Use from Python:

    from flare.plugins.bench import load_config, run_bench
    result = run_bench(load_config("a.toml"), load_config("b.toml"), blocks=1)
"""
from .config import BenchConfig, check_pair, load_config, parse_config
from .errors import BenchConfigError, BenchError
from .harness import BenchResult, run_bench
from .workload import Metric, Option, Peer, Request, Timed, Workload, get_workload, known_models, workloads

__all__ = ["BenchConfig", "BenchConfigError", "BenchError", "BenchResult", "Metric", "Option", "Peer", "Request",
           "Timed", "Workload", "check_pair", "get_workload", "known_models", "load_config", "parse_config",
           "run_bench", "workloads"]
