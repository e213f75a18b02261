"""The benchmark programs: ordinary imperative training loops on synthetic data.

Each module is one program a user could have written, in a tiny configuration that runs here in
seconds per runner. The harness contract is in benchmarks/harness/runtime.py (load_program):
build(seed, rt) -> state, step(state, i) -> loss, STEPS_PER_REP and friends. PROGRAMS lists them
in report order: model families first, then programs built around one Python feature.

A program that needs an optional package (hf_gpt2: transformers) sets UNAVAILABLE to a reason
when it is missing; the harness then records the program as skipped instead of running it.
"""

PROGRAMS: tuple[str, ...] = (
    "mlp",
    "cnn_bn",
    "lstm",
    "gpt",
    "hf_gpt2",
    "dcgan",
    "loader",
    "materialize",
    "generator",
    "try_except",
    "mutation",
    "branches",
    "trip_count",
)
